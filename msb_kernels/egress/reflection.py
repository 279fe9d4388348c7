"""Whether an answer hands back a secret in some other form than the one that was sent (issue 54).

Redaction (secrets.py) masks the forms a request carried, byte for byte. A host that reflects what it gets can hand it
back changed: upper-cased, JSON-, HTML-, URL- or shell-escaped, in base64 or base64url (of the value, of the header,
of a Basic credential), in hex, or in pieces with text between. Reflection looks for any 8-byte piece of a value
in each of those forms; the proxy refuses an answer in which it finds one (a 502 naming the secret, or, once an
answer's body has begun to flow, the connection cut), rather than pass it masked where it cannot say where the value
is.

How, cheaply enough for a 100 MiB download (bench/egress_secrets.py): every form of every piece is a literal, known
when the request goes out, and holds one of a few 4-byte blocks, so an Aho-Corasick matcher of those blocks
(ahocorasick_rs, Rust, with SIMD) finds every candidate in one pass, at a few GB/s; the whole pieces are checked
around each. A binary answer (a NUL byte) is read as it is, for the value as sent, lower- or upper-cased. Text is
read with its escapes of printable characters undone (twice: a double-encoded value) and its spacing dropped (wrapped
or quoted base64), for base64's pieces as they are, and lower-cased, for the value's and hex's in any mix of cases.
Where two chunks meet, the end of one and the start of the next are read together, so a value split across chunks,
frames or TLS records is found whole.
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
_CODE_ESCAPE = re.compile(rb"\\u([0-9a-fA-F]{4})|\\x([0-9a-fA-F]{2})")
_PLAIN_ESCAPE = re.compile(rb"\\(.)", re.DOTALL)  # JSON's \/ and \", a shell's \$: the character itself
_LOWER = bytes.maketrans(bytes(range(65, 91)), bytes(range(97, 123)))
_SPACING = b" \t\r\n\x0b\x0c\"'"  # what a wrapped or quoted base64 text holds between its characters


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
# Escapes of printable ASCII (what a value is made of); each distinct one in a chunk is found by a regular expression
# and replaced everywhere at once (bytes.replace, in C), which costs nothing like a Python call for each escape (a
# chunk of JSON holds thousands: that took a JSON download's check to 5 s a 100 MiB). Escapes of other characters
# (\u00e9, %C3, &eacute;) are left as they are: a piece of a value holds none of them, whether decoded or not.
# \u002F, \x2f, octal as C writes it (\057) and as printf's %b does (\57)
_BACKSLASH_CODE = re.compile(rb"\\(?:u00|x)[2-7][0-9a-fA-F]|\\(?:0[4-7]|1[0-7])[0-7]|\\[4-7][0-7]")
# Numeric ones with leading zeros or without their ';' too, as HTML parsers read them.
_ENTITY = re.compile(rb"&(?:#0*(?:[3-9][0-9]?|1[0-2][0-9]);?|#[xX]0*[2-7][0-9a-fA-F];?|[A-Za-z]{2,6};)")
_PERCENT = re.compile(rb"%[2-7][0-9a-fA-F]")
# What after a backslash is more than the character itself, found in one SIMD pass (`in` for each, where backslashes
# are many, took 0.2 ms a chunk): an escape of a printable character by its code, and JSON's spacing (\n: base64
# wrapped inside a JSON string is read without it, not with an n in each line).
_CODE_PREFIXES = (
    [b"\\u00%d" % high for high in range(2, 8)]
    + [b"\\x%d" % high for high in range(2, 8)]
    + [b"\\0%d" % high for high in range(4, 8)]
    + [b"\\%d" % high for high in range(1, 8)]
)
_JSON_SPACING = [b"\\n", b"\\r", b"\\t", b"\\b", b"\\f"]
_BACKSLASHED = ahocorasick_rs.BytesAhoCorasick(_CODE_PREFIXES + _JSON_SPACING, matchkind=ahocorasick_rs.MATCHKIND_LEFTMOST_FIRST)


def _replace_each(data: bytes, pattern: re.Pattern, decode) -> bytes:
    for form in sorted(set(pattern.findall(data)), key=len, reverse=True):  # &#83; before &#83, the prefix of it
        data = data.replace(form, decode(form))
    return data


def _backslash_code(form: bytes) -> bytes:
    return bytes([int(form[-2:], 16) if form[1:2] in b"ux" else int(form[1:], 8) & 0xFF])


def _entity(form: bytes) -> bytes:
    body = form[1:].rstrip(b";")
    if not body.startswith(b"#"):
        return _ENTITIES.get(body.lower(), form)
    number = int(body[2:], 16) if body[1:2] in b"xX" else int(body[1:])
    return bytes([number]) if number < 127 else form


def unescape(data: bytes) -> bytes:
    """data with the JSON, shell, HTML and URL escapes of printable ASCII undone (each once), as bytes. A backslash
    before anything else is dropped (JSON's \\/ and \\", a shell's \\$), but for JSON's spacing (\\n: a space)."""
    if b"\\" in data:
        found = {index for index, _, _ in _BACKSLASHED.find_matches_as_indexes(data)}
        if min(found, default=len(_CODE_PREFIXES)) < len(_CODE_PREFIXES):
            data = _replace_each(data, _BACKSLASH_CODE, _backslash_code)
        for index in found.difference(range(len(_CODE_PREFIXES))):
            data = data.replace(_JSON_SPACING[index - len(_CODE_PREFIXES)], b" ")
        data = data.replace(b"\\", b"")  # a doubled one too: a value that holds one is read as it is as well (check)
    if b"&" in data:
        data = _replace_each(data, _ENTITY, _entity)
    if b"%" in data:
        data = _replace_each(data, _PERCENT, lambda form: bytes([int(form[1:], 16)]))
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
        self._searches = _searches_for(tuple(sorted(values.items())))
        self._tail = b""  # the end of the last chunk, as it is (binary's seam)
        self._view_tail = b""  # the end of the last chunk's text, as it was read (unescaped, without spacing)
        self._pending = b""  # an escape the last chunk of text ended inside

    def __bool__(self) -> bool:
        return bool(self._searches)

    def check(self, data: bytes, binary: bool | None = None) -> Found | None:
        """A piece of a value in data, in any form here; None where there is none. Stateless: a header's value.
        Text (no NUL byte) is read unescaped, twice (a double-encoded value), then without spacing (wrapped or quoted
        base64) and lower-cased too (a value in any mix of cases, title-cased say); as it is only where a value holds
        spacing or an escape's character, which those views would lose. A binary answer holds no escapes to undo and
        no text to change the case of: it is read as it is."""
        return self._read(data, b"\0" in data if binary is None else binary)[0]

    def _read(self, data: bytes, binary: bool) -> tuple[Found | None, bytes]:
        """check's answer, and the view it read last: text unescaped and without spacing, or binary data as it is."""
        searches = self._searches
        if binary:
            name = searches.raw.first(data)
            return (Found(name) if name is not None else None), data
        views = [data] if searches.literal else []
        if any(escape in data for escape in _ESCAPES):
            data = unescape(data)
            if searches.literal:  # the second pass would undo a backslash or escape that is the value's own
                views.append(data)
            data = unescape(data)
        views.append(data.translate(None, _SPACING))
        return self._first(views), views[-1]

    def _first(self, views: list[bytes]) -> Found | None:
        for view in views:  # base64's pieces as they are, the value's and hex's in lower case
            if (name := self._searches.exact.first(view) or self._searches.folded.first(view.lower())) is not None:
                return Found(name)
        return None

    def follows(self, head: bytes) -> None:
        """The body's scan goes on from head (its answer's head, as check read it): a value split between the last
        header and the body is found whole."""
        self._tail = head[-OVERLAP:]
        self._view_tail = head.translate(None, _SPACING)[-OVERLAP:]

    def scan(self, chunk: bytes, last: bool = False) -> Found | None:
        """check() over a stream: each chunk, and where it meets the chunk before, so a piece across them is found.
        Text is read on from the last chunk's view too (unescaped, without spacing: a piece spread wide, each
        character padded, is whole there), and an escape a chunk ends inside is read with the rest of it, from the
        next (last: there is none, and all is read now)."""
        binary = b"\0" in chunk
        found = self._read(self._tail + chunk[:OVERLAP], binary)[0] if self._tail else None
        data, self._pending = self._pending + chunk, b""
        if not binary and not last and (opened := _open_escape(data)) is not None:
            data, self._pending = data[:opened], data[opened:]
        if found is None:
            found, view = self._read(data, binary)
            if found is None and self._view_tail:
                found = self._first([self._view_tail + view[:OVERLAP]])
            self._view_tail = (self._view_tail + view[-OVERLAP:])[-OVERLAP:]
        self._tail = (self._tail + chunk)[-OVERLAP:] if len(chunk) < OVERLAP else chunk[-OVERLAP:]
        return found


# An escape that a chunk of text ends inside: an HTML entity (digits without end: zeros pad it as far as the host
# likes), a backslash's or a percent's, carried to the next chunk whole, up to CARRY bytes.
_OPEN_ESCAPE = re.compile(rb"(?:&#?[xX]?[0-9a-zA-Z]*|\\(?:u[0-9a-fA-F]{0,3}|x[0-9a-fA-F]?|[0-7]{0,2})?|%[0-9a-fA-F]?)\Z")
CARRY = 64 << 10


def _open_escape(data: bytes) -> int | None:
    """Where the escape that data ends inside begins; None where it ends outside one."""
    start = max(data.rfind(b"&", len(data) - CARRY), data.rfind(b"\\", len(data) - 8), data.rfind(b"%", len(data) - 3))
    return start if start >= 0 and _OPEN_ESCAPE.match(data, start) else None


class _Search:
    """One pass over a view for many pieces at once. The pass looks for BLOCK-byte blocks that every piece holds one
    of (any PIECE bytes of a value hold one of its blocks at a multiple of BLOCK; in base64 and hex, one whole group):
    few, short patterns, which ahocorasick_rs finds with SIMD (Teddy: leftmost-first, at most TEDDY a matcher, a few
    GB/s); around each block found, the whole pieces are looked for, by one call (a Python loop over every piece took
    1 s a 25 MiB of numbers, whose digits a hex value's blocks meet often). A block hidden by an overlapping false one
    is inside what is checked around that one."""

    def __init__(self, blocks: set[bytes], folded: dict[bytes, tuple[str, ...]], exact: dict[bytes, tuple[str, ...]]):
        ordered = sorted(blocks)
        self.matchers = [
            ahocorasick_rs.BytesAhoCorasick(ordered[i : i + TEDDY], matchkind=ahocorasick_rs.MATCHKIND_LEFTMOST_FIRST)
            for i in range(0, len(ordered), TEDDY)
        ]
        self.pieces = [
            (ahocorasick_rs.BytesAhoCorasick(list(pieces)), list(pieces.values()), fold)
            for pieces, fold in ((folded, True), (exact, False))
            if pieces
        ]

    def first(self, view: bytes) -> tuple[str, ...] | None:
        """The names of the secrets that hold the first piece found in view; None where none is."""
        for matcher in self.matchers:
            for _, start, end in matcher.find_matches_as_indexes(view):
                around = view[max(0, start - WIDEST) : end + WIDEST]
                for finder, names, fold in self.pieces:
                    for index, _, _ in finder.find_matches_as_indexes(around.lower() if fold else around):
                        return names[index]
        return None


@dataclass(frozen=True)
class _Searches:
    """The searches for one set of values: ``raw`` for every piece in any case a binary answer could hold it in (as
    sent, lower, upper), and for text, which is read lower-cased and without spacing, ``folded`` (the value's and its
    hex's pieces, in lower case) and ``exact`` (base64's, as they are): a third of the patterns each, so a third of the
    passes."""

    raw: _Search
    folded: _Search
    exact: _Search
    literal: bool  # a value holds spacing or an escape's character: text is read as it is too

    def __bool__(self) -> bool:
        return bool(self.raw.matchers)


@functools.lru_cache(maxsize=16)
def _searches_for(values: tuple[tuple[str, bytes], ...]) -> _Searches:
    """The pieces of each (secret's name, value) and their blocks, in matchers: built once for the values a kernel's
    requests carry (half a millisecond), not again at each request to a secret's host."""
    folded: dict[bytes, set[str]] = {}  # compared in lower case: the value's pieces and their hex
    exact: dict[bytes, set[str]] = {}  # compared as they are: base64's (upper-cased base64 decodes to no value)
    folded_blocks: set[bytes] = set()
    exact_blocks: set[bytes] = set()
    for name, value in values:
        if len(value) < PIECE:
            continue
        hexadecimal = value.hex().encode()
        for piece in _pieces(value.lower(), PIECE) | _pieces(hexadecimal, HEX_PIECE, 2):
            folded.setdefault(piece, set()).add(name)
        folded_blocks |= _pieces(value.lower(), BLOCK, BLOCK) | _pieces(hexadecimal, BLOCK, BLOCK)
        for stable, group in _base64_stable(value):
            for alphabet in (stable, stable.translate(_TO_URLSAFE)):
                for piece in _pieces(alphabet, BASE64_PIECE):
                    exact.setdefault(piece, set()).add(name)
                exact_blocks |= _pieces(alphabet[group:], BLOCK, BLOCK)
    holders = {piece: tuple(sorted(names)) for pieces in (folded, exact) for piece, names in pieces.items()}
    folded_holders = {p: holders[p] for p in folded}
    exact_holders = {p: holders[p] for p in exact}
    # A binary answer is read as it is: its blocks in the cases a host hands text back in (as sent, lower, upper).
    cased = {form for block in folded_blocks for form in (block, block.upper())}
    cased |= {block for _, value in values if len(value) >= PIECE for block in _pieces(value, BLOCK, BLOCK)}
    return _Searches(
        raw=_Search(cased | exact_blocks, folded_holders, exact_holders),
        folded=_Search(folded_blocks, folded_holders, {}),
        exact=_Search(exact_blocks, {}, exact_holders),
        literal=any(set(value) & set(_SPACING + b"".join(_ESCAPES)) for _, value in values),
    )
