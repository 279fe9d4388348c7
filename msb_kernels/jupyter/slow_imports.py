"""Imports that cost a process start seconds for nothing, deferred until they are used.

jupyter_server imports jupyter_events, whose validators import jsonschema's format checkers, which import
rfc3987_syntax at once when it is installed (jsonschema[format-nongpl], pulled in by nbformat and jupyter_events).
That module builds some 35 Lark parsers at import: 0.96 s of the gateway's 1.40 s import on this 2-core host
(`python -X importtime -c "import msb_kernels.gateway.app"`), paid by every `msb-kernels serve`, `doctor` and `run`.
No Jupyter schema uses the `iri` formats it checks (jsonschema issue 1428; opendatahub-io/notebooks issue 3532), so
it is put off until the first such check, which then behaves as before.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

DEFERRED = "rfc3987_syntax"


def defer() -> None:
    """Stand a lazy module in for rfc3987_syntax. Called first by each entry point, before jupyter_server loads."""
    if DEFERRED in sys.modules or importlib.util.find_spec(DEFERRED) is None:
        return
    real: list[types.ModuleType] = []

    def is_valid_syntax(*args: Any, **kwargs: Any) -> Any:
        if not real:
            del sys.modules[DEFERRED]
            try:
                real.append(importlib.import_module(DEFERRED))
            except BaseException:
                sys.modules[DEFERRED] = stand_in
                raise
        return real[0].is_valid_syntax(*args, **kwargs)

    stand_in = types.ModuleType(DEFERRED, "msb_kernels.jupyter.slow_imports' stand-in: the real module loads at first use")
    stand_in.is_valid_syntax = is_valid_syntax  # type: ignore[attr-defined]
    sys.modules[DEFERRED] = stand_in
