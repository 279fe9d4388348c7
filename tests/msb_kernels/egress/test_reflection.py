"""Finding a secret that an answer hands back changed (egress/reflection.py): every form of issue 54's table and
its points 2 and 3, a value split across a stream's chunks, and no alarm on answers that do not hold it."""

from __future__ import annotations

import base64
import html
import json
import os
import urllib.parse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msb_kernels.egress.reflection import OVERLAP, Reflection
from tests.parallel import UNIT

pytestmark = UNIT  # starts no process

VALUE = "S3cr3t/Tok+EN=abcdef0123"
HEADER = "Bearer " + VALUE
SENT = [("OP_TOKEN", HEADER.encode()), ("OP_TOKEN", VALUE.encode())]
FORMS = {
    "upper": HEADER.upper(),
    "lower": HEADER.lower(),
    "title-cased": HEADER.title(),
    "every other letter upper": "".join(c.upper() if i % 2 else c.lower() for i, c in enumerate(HEADER)),
    "json with / escaped": json.dumps({"got": HEADER}).replace("/", "\\/"),
    "json \\u escapes": "".join(f"\\u{ord(c):04x}" for c in HEADER),
    "two pieces, text between": VALUE[:12] + " (and then) " + VALUE[12:],
    "hex": VALUE.encode().hex(),
    "HEX": VALUE.encode().hex().upper(),
    "base64 of the header": base64.b64encode(HEADER.encode()).decode(),
    "base64 at each alignment": " ".join(base64.b64encode((p + VALUE).encode()).decode() for p in ("x", "xy")),
    "base64url": base64.urlsafe_b64encode(("?" + HEADER).encode()).decode(),
    "base64, wrapped and quoted": '"'
    + "\n".join(base64.b64encode(("abc" + VALUE).encode()).decode()[i : i + 6] for i in range(0, 60, 6))
    + '"',
    "Basic's user:value": base64.b64encode(f"user:{VALUE}".encode()).decode(),
    "html entities": "".join(f"&#{ord(c)};" for c in HEADER),
    "html hex entities, upper": "".join(f"&#x{ord(c):X};" for c in HEADER.upper()),
    "html named entities, in a page": "<p>caf&eacute; &amp; " + html.escape(VALUE).replace("/", "&sol;").replace("+", "&plus;") + "</p>",
    "url": urllib.parse.quote(HEADER, safe=""),
    "url, every byte": "".join(f"%{c:02x}" for c in HEADER.encode()),
    "url, twice": urllib.parse.quote(urllib.parse.quote(HEADER, safe=""), safe=""),
    "shell": "".join("\\" + c if not c.isalnum() else c for c in VALUE),  # as printf %q writes it
    "octal escapes, printf %b": "".join(f"\\{ord(c):o}" for c in VALUE),
    "html entities, zero-padded and open": "".join(f"&#0{ord(c)}" for c in HEADER),
    "base64 wrapped in a JSON string": json.dumps(
        "\n".join(base64.b64encode(("xy" + HEADER).encode()).decode()[i : i + 8] for i in range(0, 48, 8))
    ),
    "base64 wrapped with form feeds": "\x0c".join(base64.b64encode(("xy" + HEADER).encode()).decode()[i : i + 8] for i in range(0, 48, 8)),
    "octal escapes": "".join(f"\\{ord(c):03o}" for c in VALUE),
    "an 8-byte piece alone": "x" + VALUE[5:13] + "y",
}


@pytest.mark.parametrize("form", FORMS)
def test_every_form_of_a_piece_of_the_value_is_found_and_named_by_its_secret(form: str) -> None:
    found = Reflection(SENT).check(FORMS[form].encode())
    assert found is not None and found.names == ("OP_TOKEN",), form


def test_a_value_split_across_chunks_is_found_in_the_chunk_that_completes_it() -> None:
    reflection = Reflection(SENT)
    data = b"x" * 70_000 + HEADER.upper().encode() + b"y" * 100
    cut = 70_000 + 10
    assert reflection.scan(data[:cut]) is None
    assert reflection.scan(data[cut:]).names == ("OP_TOKEN",)
    assert OVERLAP >= len("".join(f"\\u{ord(c):04x}" for c in VALUE[:8]))  # a piece at its widest fits the overlap


def test_answers_that_do_not_hold_it_pass() -> None:
    reflection = Reflection(SENT)
    noise = os.urandom(4 << 20)
    records = "\n".join(json.dumps({"id": i, "url": f"https://x.test/a/{i}", "note": 'he said "hi", café'}) for i in range(9000))
    escaped = records.replace("/", "\\/").encode()  # JSON as PHP writes it: an escape or two every few bytes, to undo
    for answer in (
        noise,
        base64.b64encode(noise),
        noise.hex().encode(),
        html.escape(repr(noise)).encode(),
        escaped,
        b"Bearer " + b"*" * 24,
    ):
        assert reflection.scan(answer) is None
    assert Reflection(SENT).check(VALUE[:7].encode()) is None  # shorter than a piece: not enough to count
    assert not Reflection([])


def test_a_piece_two_secrets_share_names_both() -> None:
    """Two tokens with a common prefix: a piece of the prefix is each one's, and counts against each (the proxy
    withdraws a secret after refusals of it: one that named only the first would never withdraw the second)."""
    found = Reflection([("A", b"github_pat_11AAAAAAAAAAAAAAAA"), ("B", b"github_pat_11BBBBBBBBBBBBBBBB")]).check(b"GITHUB_PAT_11")
    assert found is not None and found.names == ("A", "B")


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=8, max_size=64),
    st.integers(min_value=0, max_value=56),
    st.sampled_from(["lower", "upper", "hex", "base64", "base64url", "url", "json", "any mix of cases"]),
    st.binary(max_size=5),
    st.lists(st.booleans(), min_size=8, max_size=8),
)
def test_any_8_bytes_of_any_value_are_found_in_each_form_at_any_offset(
    value: str, start: int, form: str, prefix: bytes, flips: list[bool]
) -> None:
    piece = value.encode()[start : start + 8]
    if len(piece) < 8:
        return
    shown = {
        "lower": piece.lower(),
        "upper": piece.upper(),
        "hex": piece.hex().encode(),
        "base64": base64.b64encode(prefix + piece + prefix),
        "base64url": base64.urlsafe_b64encode(prefix + piece),
        "url": urllib.parse.quote(piece, safe="").encode(),
        "json": json.dumps(piece.decode()).replace("/", "\\/").encode(),
        "any mix of cases": bytes(c ^ 0x20 if chr(c).isalpha() and flip else c for c, flip in zip(piece, flips, strict=True)),
    }[form]
    assert Reflection([("S", value.encode())]).check(b"<<" + shown + b">>") is not None, (form, shown)


@pytest.mark.parametrize(
    "spread",
    [
        pytest.param(lambda c: f"&#{'0' * 40}{ord(c)};", id="entities padded with zeros"),
        pytest.param(lambda c: c + " " * 70, id="characters 70 spaces apart"),
    ],
)
def test_a_value_spread_wide_across_many_chunks_is_found(spread) -> None:
    """Each character of the value written wider than a seam's reach, and the stream cut every few bytes, mid-escape
    too (a host that flushes as it writes): the scan reads on from each chunk's decoded text."""
    stream = ("a" * 5000 + "".join(spread(c) for c in HEADER)).encode()
    reflection = Reflection(SENT)
    found = [reflection.scan(stream[i : i + 23]) for i in range(0, len(stream), 23)]
    assert any(found), "the value came through, each piece of it across chunks"


def test_an_escape_a_stream_ends_inside_is_read_at_its_end() -> None:
    """What the last chunk holds after an escape it ends inside (carried, for the next chunk) is read at the end."""
    reflection = Reflection(SENT)
    assert reflection.scan(b"x" * 100) is None
    assert reflection.scan(b"&" + VALUE.encode(), last=True) is not None
