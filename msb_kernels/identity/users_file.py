"""The users file: a team's people without a JupyterHub, each with a token and an admin flag.

A JSON file, ``{"users": {"alice": {"token_sha256": "…", "admin": false}}}``, written by ``msb-kernels users``.
Tokens are stored as SHA-256 digests only: they are 256 random bits, so a fast hash is enough (no dictionary to
guess from), as JupyterHub stores its API tokens. The gateway rereads the file when it changes, so adding or removing
a person needs no restart. Like an ssh key, a file others can write (or read) is refused: its admin flags are
powers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from msb_kernels.errors import ConfigError, InvalidRequest
from msb_kernels.identity.people import USER_NAME, Person
from msb_kernels.settings.value_checks import check_private_file

SETTING = "MSB_USERS_FILE"


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_hex(32)


@dataclass(frozen=True)
class Entry:
    """One person of the file."""

    name: str
    token_sha256: str
    admin: bool = False


def check_name(name: str) -> str:
    if not USER_NAME.match(name):
        raise InvalidRequest(
            f"{name!r} is not a user name here",
            ["use 1 to 64 letters, digits and . _ @ + - (starting with a letter or digit), such as alice"],
        )
    return name


def check_mode(path: Path) -> None:
    """Refuse a file that another user can read or write, naming the mode and the chmod that fixes it (the same rule
    as every private file's: value_checks.check_private_file). A missing file is read's to report."""
    problem = check_private_file(str(path)) if path.exists() else None
    if problem:
        raise ConfigError(f"{SETTING}={path} {problem}: other users could change who is an admin here", [f"chmod 600 {path}"])


def read(path: Path) -> dict[str, Entry]:
    """The file's people; ConfigError (naming the file and what is wrong) for anything it cannot use."""
    try:
        check_mode(path)
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{SETTING}={path} does not exist", [f"create it with `msb-kernels users add NAME --file {path}`"]) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{SETTING}={path} cannot be read: {exc}", ["fix or remove the file, then `msb-kernels users list`"]) from None
    users = raw.get("users") if isinstance(raw, dict) else None
    if not isinstance(users, dict):
        raise ConfigError(f'{SETTING}={path} is not a users file: it needs {{"users": {{...}}}}', ["write it with `msb-kernels users add`"])
    entries = {}
    for name, fields in users.items():
        digest = fields.get("token_sha256") if isinstance(fields, dict) else None
        if not USER_NAME.match(str(name)) or not isinstance(digest, str) or len(digest) != 64:
            raise ConfigError(
                f"{SETTING}={path}: the entry {name!r} is malformed", ["remove it and add the person again with `msb-kernels users add`"]
            )
        entries[name] = Entry(name, digest, bool(fields.get("admin", False)))
    return entries


def write(path: Path, entries: dict[str, Entry]) -> None:
    """Replace the file at once (a gateway reading it never sees half of it), mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"users": {e.name: {"token_sha256": e.token_sha256, "admin": e.admin} for e in sorted(entries.values(), key=lambda e: e.name)}}
    fd, temporary = tempfile.mkstemp(prefix=".users-", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(body, out, indent=2)
            out.write("\n")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


class UsersFile:
    """The gateway's view of the file: reread when its mtime or size changes, looked up by token digest."""

    def __init__(self, path: Path):
        self.path = path
        self._seen: tuple[int, int] | None = None
        self._by_digest: dict[str, Entry] = {}
        self.reload()  # a bad file stops the gateway's start, naming it

    def reload(self) -> None:
        st = self.path.stat()
        entries = read(self.path)
        self._by_digest = {entry.token_sha256: entry for entry in entries.values()}
        self._seen = (st.st_mtime_ns, st.st_size)

    def _fresh(self) -> None:
        try:
            st = self.path.stat()
        except OSError:
            return  # keep the last good view; the operator sees the file gone in `msb-kernels users list`
        if (st.st_mtime_ns, st.st_size) != self._seen:
            with contextlib.suppress(ConfigError):  # a half-edited or broken file: keep the last good one
                self.reload()

    def person(self, token: str) -> Person | None:
        self._fresh()
        entry = self._by_digest.get(token_digest(token))
        return Person(entry.name, entry.admin, "users-file") if entry is not None else None
