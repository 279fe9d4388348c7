"""msb_kernels.jupyter.slow_imports: the gateway's imports skip rfc3987_syntax's parsers until a check needs them, and that
check then answers as jsonschema's own does."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = """
import json, sys, time
from msb_kernels.jupyter import slow_imports
slow_imports.defer()
began = time.monotonic()
import jupyter_server.serverapp, jsonschema
imported = time.monotonic() - began
deferred = getattr(sys.modules["rfc3987_syntax"], "__doc__", "")
check = jsonschema.Draft7Validator({"format": "iri"}, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
answers = [check.is_valid(text) for text in ("https://example.org/ä?q=1", "no spaces in an iri", "https://b.example/")]
print(json.dumps({"imported": imported, "deferred": deferred, "answers": answers, "loaded": sys.modules["rfc3987_syntax"].__doc__}))
"""


def test_jupyter_server_loads_without_the_iri_parsers_and_an_iri_check_still_answers():
    run = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert "stand-in" in seen["deferred"], seen  # jupyter_server's import did not load the real module
    assert seen["answers"] == [True, False, True], seen
    assert "stand-in" not in (seen["loaded"] or ""), seen  # the first check loaded it
    print(f"jupyter_server and jsonschema imported in {seen['imported']:.2f} s")
