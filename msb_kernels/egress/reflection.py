"""Whether an answer hands back a secret in some other form than the one that was sent (issue 54).

Redaction (secrets.py) masks the forms a request carried, byte for byte. A host that reflects what it gets can hand it
back changed: upper-cased, JSON-, HTML-, URL- or shell-escaped, in base64 or base64url (of the value, of the header,
of a Basic credential), in hex, or in pieces with text between. Reflection looks for any 8-byte piece of a value
in each of those forms; the proxy refuses an answer in which it finds one (a 502 naming the secret, or, once an
answer's body has begun to flow, the connection cut), rather than pass it masked where it cannot say where the value
is.

How, cheaply enough for a 100 MiB download (bench/egress_secrets.py): every form of every piece is a literal, known
when the request goes out, and holds one of a few 4-byte blocks, so an Aho-Corasick matcher of those blocks
(ahocorasick_rs, Rust, with SIMD) finds every candidate in one pass over the answer as it is, at a few GB/s; the whole
pieces are checked around each. Text (no NUL
byte) is read again without spacing, and where it holds an escape (a backslash, '%' or '&') unescaped, once and twice
(a double-encoded value). Where two chunks meet, the end of one and the start of the next are read together, so a
value split across chunks, frames or TLS records is found whole.
"""

from __future__ import annotations

import base64
import functools
import re
from dataclasses import dataclass

import ahocorasick_rs

PIECE = 8  # bytes of a value that count as handing it back (and the piece length searched for in each form)
BASE64_PIECE = 9  # base64 characters that any PIECE bytes fix wholly, in any alignment (64 bits hold 9 whole cells)
HEX_PIECE = 2 * PIECE
BLOCK = 4  # bytes of the blocks the automaton looks for first (_Automaton)
TEDDY = 60  # blocks a matcher: ahocorasick_rs searches up to 64 literals with SIMD, more about 50 times slower
WIDEST = max(PIECE, BASE64_PIECE, HEX_PIECE)
# Longest reach of one piece in any form here (\u00XX is 6 characters a byte), so a piece across two stretches is seen.
OVERLAP = 6 * PIECE + 16
_ESCAPES = (b"\\", b"%", b"&")
_TO_URLSAFE = bytes.maketrans(b"+/", b"-_")
_JSON_ESCAPE = re.compile(rb"\\u([0-9a-fA-F]{4})|\\x([0-9a-fA-F]{2})|\\(.)", re.DOTALL)
_SPACING = b" \t\r\n\"'"  # what a wrapped or quoted base64 text holds between its characters


@dataclass(frozen=True)
class Found:
    """A piece of a secret, in some form, in an answer: which secrets hold that piece (two values can share one, such
    as a token's common prefix), never a value."""

    names: tuple[str, ...]


def _pieces(data: bytes, length: int, step: int = 1) -> set[bytes]:
    return {data[i : i + length] for i in range(0, len(data) - length + 1, step)}


def _base64_stable(value: bytes) -> list[tuple[bytes, int]]:
    """The base64 characters that the value's bytes alone fix in base64 of anything holding it, at each of the three
    alignments a byte can have in a base64 group; each with where its first whole group starts in it (any
    BASE64_PIECE characters of it hold a whole group: a block)."""
    stable = []
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + value + b"\0\0")
        first = (offset * 8 + 5) // 6  # the first character none of whose bits come before the value
        last = ((offset + len(value)) * 8) // 6  # past the last character all of whose bits are the value's
        stable.append((encoded[first:last], -first % 4))
    return stable


# The entities an HTML page writes printable ASCII with, besides numeric ones (&#47; &#x2F;).
_ENTITIES = {
    b"amp": b"&",
    b"lt": b"<",
    b"gt": b">",
    b"quot": b'"',
    b"apos": b"'",
    b"sol": b"/",
    b"plus": b"+",
    b"equals": b"=",
    b"colon": b":",
    b"num": b"#",
    b"dollar": b"$",
    b"percnt": b"%",
    b"lpar": b"(",
    b"rpar": b")",
    b"comma": b",",
    b"period": b".",
    b"excl": b"!",
    b"quest": b"?",
    b"semi": b";",
    b"lowbar": b"_",
    b"hyphen": b"-",
    b"ast": b"*",
    b"commat": b"@",
    b"lsqb": b"[",
    b"rsqb": b"]",
    b"lcub": b"{",
    b"rcub": b"}",
    b"verbar": b"|",
    b"bsol": b"\\",
    b"grave": b"`",
    b"hat": b"^",
    b"tilde": b"~",
    b"nbsp": b" ",
}
_ENTITY = re.compile(rb"&(?:#([0-9]{1,7})|#[xX]([0-9a-fA-F]{1,6})|([A-Za-z]{2,8}));")
_PERCENT = re.compile(rb"%([0-9a-fA-F]{2})")


def unescape(data: bytes) -> bytes:
    """data with JSON, shell, HTML and URL escapes undone (each once), as bytes."""

    def json_char(match: re.Match) -> bytes:
        code, byte, plain = match.groups()
        if code is not None:
            number = int(code, 16)
            return bytes([number]) if number < 256 else b"?"
        return bytes([int(byte, 16)]) if byte is not None else plain

    def entity(match: re.Match) -> bytes:
        decimal, hexadecimal, name = match.groups()
        if name is not None:
            return _ENTITIES.get(name.lower(), match.group(0))
        number = int(decimal) if decimal is not None else int(hexadecimal, 16)
        return bytes([number]) if number < 256 else b"?"

    if b"\\" in data:
        data = _JSON_ESCAPE.sub(json_char, data)
    if b"&" in data:
        data = _ENTITY.sub(entity, data)
    if b"%" in data:
        data = _PERCENT.sub(lambda match: bytes([int(match.group(1), 16)]), data)
    return data


class Reflection:
    """The forms of what one request sent (each value with its secret's name), and a scanner of its answer's stream."""

    def __init__(self, sent: list[tuple[str, bytes]]):
        """sent: what a request carried, by secret (secrets.substitute_headers): the header, the credential the proxy
        built, and the value itself, the shortest, which every other holds. Only the value's own pieces are looked
        for: a piece of ``Bearer `` or ``user:`` is no secret."""
        values: dict[str, bytes] = {}
        for name, form in sent:
            if name not in values or len(form) < len(values[name]):
                values[name] = form
        self._pieces = _automaton_for(tuple(sorted(values.items())))
        self._tail = b""

    def __bool__(self) -> bool:
        return bool(self._pieces)

    def check(self, data: bytes, binary: bool | None = None) -> Found | None:
        """A piece of a value in data, in any form here; None where there is none. Stateless: a header's value.
        Text (no NUL byte) is read four more ways: without spacing (wrapped or quoted base64), and unescaped once and
        twice (a double-encoded value), each without spacing too; a binary answer holds no escapes to undo."""
        name = self._pieces.first(data)
        if name is not None or (b"\0" in data if binary is None else binary):
            return Found(name) if name is not None else None
        views = [data.translate(None, _SPACING)]
        if any(escape in data for escape in _ESCAPES):
            once = unescape(data)
            twice = unescape(once)
            views += [once, once.translate(None, _SPACING), twice, twice.translate(None, _SPACING)]
        for view in views:
            if (name := self._pieces.first(view)) is not None:
                return Found(name)
        return None

    def scan(self, chunk: bytes) -> Found | None:
        """check() over a stream: each chunk, and where it meets the chunk before (the end of that one and the start
        of this), so a piece across them is found."""
        binary = b"\0" in chunk  # where two chunks meet, read as the chunk is: text, or binary with no escapes
        found = self.check(self._tail + chunk[:OVERLAP], binary) if self._tail else None
        found = found or self.check(chunk, binary)
        self._tail = (self._tail + chunk)[-OVERLAP:] if len(chunk) < OVERLAP else chunk[-OVERLAP:]
        return found


class _Automaton:
    """One pass over a view for every piece at once. The pass looks for BLOCK-byte blocks that every piece holds one
    of (any PIECE bytes of a value hold one of its blocks at a multiple of BLOCK; in base64 and hex, one whole group):
    few, short patterns, which ahocorasick_rs finds with SIMD (Teddy: leftmost-first, at most TEDDY a matcher, a few
    GB/s); around each block found, every piece is checked. A block hidden by an overlapping false one is inside
    what is checked around that one."""

    def __init__(self, folded: dict[bytes, tuple[str, ...]], exact: dict[bytes, tuple[str, ...]], blocks: set[bytes]):
        self.folded, self.exact = folded, exact
        ordered = sorted(blocks)
        self.matchers = [
            ahocorasick_rs.BytesAhoCorasick(ordered[i : i + TEDDY], matchkind=ahocorasick_rs.MATCHKIND_LEFTMOST_FIRST)
            for i in range(0, len(ordered), TEDDY)
        ]

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def first(self, view: bytes) -> tuple[str, ...] | None:
        """The names of the secrets that hold the first piece found in view; None where none is."""
        for matcher in self.matchers:
            for _, start, end in matcher.find_matches_as_indexes(view):
                around = view[max(0, start - WIDEST) : end + WIDEST]
                folded = around.lower()
                for piece, name in self.folded.items():
                    if piece in folded:
                        return name
                for piece, name in self.exact.items():
                    if piece in around:
                        return name
        return None


@functools.lru_cache(maxsize=16)
def _automaton_for(values: tuple[tuple[str, bytes], ...]) -> _Automaton:
    """The pieces of each (secret's name, value) and their blocks, in matchers: built once for the values a kernel's
    requests carry (half a millisecond), not again at each request to a secret's host."""
    folded: dict[bytes, set[str]] = {}  # compared in lower case: the value's pieces and their hex
    exact: dict[bytes, set[str]] = {}  # compared as they are: base64's (upper-cased base64 decodes to no value)
    blocks: set[bytes] = set()
    for name, value in values:
        if len(value) < PIECE:
            continue
        hexadecimal = value.hex().encode()
        for piece in _pieces(value.lower(), PIECE) | _pieces(hexadecimal, HEX_PIECE, 2):
            folded.setdefault(piece, set()).add(name)
        # The cases a host hands text back in (as sent, lower, upper); every mix is caught around a block found.
        for block in _pieces(value, BLOCK, BLOCK) | _pieces(hexadecimal, BLOCK, BLOCK):
            blocks |= {block, block.lower(), block.upper()}
        for stable, group in _base64_stable(value):
            for alphabet in (stable, stable.translate(_TO_URLSAFE)):
                for piece in _pieces(alphabet, BASE64_PIECE):
                    exact.setdefault(piece, set()).add(name)
                blocks |= _pieces(alphabet[group:], BLOCK, BLOCK)
    holders = {piece: tuple(sorted(names)) for pieces in (folded, exact) for piece, names in pieces.items()}
    return _Automaton({p: holders[p] for p in folded}, {p: holders[p] for p in exact}, blocks)
