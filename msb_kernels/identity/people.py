"""A Person, the Owner of a kernel, and who is acting now.

The caller travels in a context variable: the gateway's IdentityProvider sets it for each HTTP request and WebSocket,
the MCP bridge for each tool call, and background work (the culler, the pool, hibernation, adoption, the gateway's
stop) sets ``SYSTEM`` explicitly. Nothing set is nobody: a path that forgets to say who it acts for sees no kernel and
may start none, rather than becoming an admin. The kernel manager's lookup reads it through ``may_see``: that is the
one ownership check.
"""

from __future__ import annotations

import contextlib
import getpass
import re
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal

# Where a person's identity came from: the gateway's single token, the users file, JupyterHub, the desktop's one user
# of a stdio MCP server, or the gateway itself (SYSTEM).
Source = Literal["token", "users-file", "hub", "local", "system"]
SOURCES: tuple[str, ...] = ("token", "users-file", "hub", "local", "system")

# A name as the users file accepts it; JupyterHub's names are taken as the Hub gives them. A name is never a key to
# anything on the host: person_registry.py gives each person one of the gateway's own.
USER_NAME = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.@+-]{0,63}\Z")  # \Z: "$" lets a last newline in


@dataclass(frozen=True)
class Owner:
    """Whose a kernel is: the source and the name together, so that the single token's person, a users-file person
    and a Hub person of the same name are three owners, never one."""

    source: Source
    name: str

    def __str__(self) -> str:
        return self.name

    def to_record(self) -> dict[str, str]:
        return {"source": self.source, "name": self.name}

    @classmethod
    def from_record(cls, value: Any) -> Owner | None:
        """An owner as to_record wrote it; None for anything else (a record from before owners had a source)."""
        if not isinstance(value, dict) or value.get("source") not in SOURCES or not isinstance(value.get("name"), str):
            return None
        return cls(value["source"], value["name"])


@dataclass(frozen=True)
class Person:
    """Someone with a token: a kernel they start is theirs; an admin sees and manages every kernel."""

    name: str
    admin: bool = False
    source: Source = "token"

    @property
    def owner(self) -> Owner:
        return Owner(self.source, self.name)

    @property
    def is_system(self) -> bool:
        return self.source == "system"


# The gateway acting for itself: it sees every kernel and owns none. Only code that no request started says it is this.
SYSTEM = Person("system", admin=True, source="system")


def login_name() -> str:
    """This process's user, by name (the single token's person is named after it)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "operator"


def local_person() -> Person:
    """The one user of a process that serves only them (a stdio MCP server, the desktop's): everything here is theirs."""
    return Person(login_name(), admin=True, source="local")


_acting: ContextVar[Person | None] = ContextVar("msb_acting_person", default=None)
# What the caller uses (a JupyterLab's gateway client, an MCP client by its name), for the audit trail.
_client: ContextVar[str | None] = ContextVar("msb_acting_client", default=None)


def acting() -> Person | None:
    """The person this request acts for, SYSTEM for the gateway's own work; None: nobody, who may do nothing."""
    return _acting.get()


def acting_client() -> str | None:
    return _client.get()


def set_acting(person: Person | None, client: str | None = None) -> None:
    """Make ``person`` (using ``client``) the caller for the rest of this task (the gateway's IdentityProvider, once
    per request; background work with SYSTEM)."""
    _acting.set(person)
    _client.set(client)


@contextlib.contextmanager
def acting_as(person: Person | None, client: str | None = None) -> Iterator[None]:
    """Run a block as ``person`` (SYSTEM: as the gateway itself; None: as nobody), then restore the caller before it."""
    token, client_token = _acting.set(person), _client.set(client)
    try:
        yield
    finally:
        _acting.reset(token)
        _client.reset(client_token)


def may_see(person: Person | None, owner: Owner | None) -> bool:
    """Whether ``person`` may see and touch a kernel owned by ``owner`` (None: nobody's, such as a waiting pooled
    kernel). The system and admins see every kernel; a person their own; nobody (None) sees nothing."""
    if person is None:
        return False
    return person.admin or (owner is not None and owner == person.owner)
