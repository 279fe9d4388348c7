"""A Person, and who is acting now.

The caller travels in a context variable: the gateway's IdentityProvider sets it for each HTTP request and WebSocket,
the MCP bridge for each tool call. Work no request started (the culler, the pool, adoption, hibernation) runs with it
unset, as the system. The kernel manager's lookup reads it through ``may_see``: that is the one ownership check.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

# Where a person's identity came from: the gateway's single token, the users file, or JupyterHub.
Source = Literal["token", "users-file", "hub"]

# A name as the users file accepts it; JupyterHub's names are taken as the Hub gives them (see Person.slug).
USER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,63}$")


@dataclass(frozen=True)
class Person:
    """Someone with a token: a kernel they start is theirs; an admin sees and manages every kernel."""

    name: str
    admin: bool = False
    source: Source = "token"

    @property
    def slug(self) -> str:
        """The name made safe as one path component (a per-person directory): letters, digits, '.', '_', '-' kept,
        anything else as %XX, so two different names never share a directory."""
        safe = "".join(c if c.isalnum() or c in "._-" else f"%{ord(c):02X}" for c in self.name)
        return safe if safe not in ("", ".", "..") else f"%{safe}"


_acting: ContextVar[Person | None] = ContextVar("msb_acting_person", default=None)
# What the caller uses (a JupyterLab's gateway client, an MCP client by its name), for the audit trail.
_client: ContextVar[str | None] = ContextVar("msb_acting_client", default=None)


def acting() -> Person | None:
    """The person this request acts for; None for the system (work no request started)."""
    return _acting.get()


def acting_client() -> str | None:
    return _client.get()


def set_acting(person: Person | None, client: str | None = None) -> None:
    """Make ``person`` (using ``client``) the caller for the rest of this task (the gateway's IdentityProvider, once
    per request)."""
    _acting.set(person)
    _client.set(client)


@contextlib.contextmanager
def acting_as(person: Person | None, client: str | None = None) -> Iterator[None]:
    """Run a block as ``person`` (None: as the system), then restore the caller before it."""
    token, client_token = _acting.set(person), _client.set(client)
    try:
        yield
    finally:
        _acting.reset(token)
        _client.reset(client_token)


def may_see(person: Person | None, owner: str | None) -> bool:
    """Whether ``person`` may see and touch a kernel owned by ``owner`` (None: nobody's, such as a waiting pooled
    kernel). The system and admins see every kernel; a person sees their own."""
    return person is None or person.admin or (owner is not None and owner == person.name)
