"""Who calls the MCP tools: a bearer token to a Person, bound to the MCP session it opened, and the caller of each
tool call.

The MCP SDK's own pieces carry it: a ``TokenVerifier`` turns the token into an ``AccessToken`` whose subject is the
person, the HTTP app puts an ``AuthenticatedUser`` in the request's scope, and the SDK's session manager then refuses a
session to any other principal (as if it did not exist). A tool call runs in its session's task, not its request's,
so the bridge reads the person back from the request that carried the call (``person_of_request``) and acts as them.
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from typing import Any

from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken

from msb_kernels.identity.people import Person

CLIENT_ID = "msb-kernels"  # one client for every person: a session is bound to the person, not to one of their tokens


def access_token(person: Person, token: str) -> AccessToken:
    return AccessToken(
        token=token, client_id=CLIENT_ID, scopes=["admin"] if person.admin else [], subject=person.name, claims={"iss": person.source}
    )


# Where a person a token verifier made can come from: never the system, which no token is.
TOKEN_SOURCES = ("token", "users-file", "hub", "local")


def person_of(access: AccessToken | None) -> Person | None:
    """The person an access token of ours stands for; None (nobody) for anything else."""
    if access is None or access.client_id != CLIENT_ID or not access.subject:
        return None
    source = (access.claims or {}).get("iss")
    return Person(access.subject, "admin" in access.scopes, source) if source in TOKEN_SOURCES else None


def access_of_request(request: Any) -> AccessToken | None:
    """The access token the HTTP app put in the scope of the request that carried a tool call (None over stdio)."""
    scope = getattr(request, "scope", None)
    user = scope.get("user") if isinstance(scope, dict) else None
    return user.access_token if isinstance(user, AuthenticatedUser) else None


def person_of_request(request: Any) -> Person | None:
    """The person of the HTTP request that carried a tool call (None over stdio: the desktop's one user)."""
    return person_of(access_of_request(request))


class PersonVerifier:
    """The MCP SDK's TokenVerifier over a function from a token to a Person (the gateway's msb_kernels.identity.tokens)."""

    def __init__(self, person_for: Callable[[str], Awaitable[Person | None]]):
        self._person_for = person_for

    async def verify_token(self, token: str) -> AccessToken | None:
        person = await self._person_for(token)
        return access_token(person, token) if person is not None else None


def single_token(token: str, person: Person) -> PersonVerifier:
    """One token for one person (``msb-mcp --http --token``): the standalone server's only caller."""
    expected = token.encode()

    async def person_for(candidate: str) -> Person | None:
        return person if hmac.compare_digest(candidate.encode(), expected) else None

    return PersonVerifier(person_for)


# The bearer token of the request that carried the tool call now running: under JupyterHub, the notebook tools reach
# the caller's own server with it (mcp_bridge.notebooks.hub). Nothing else of the request is kept: where the tools
# connect comes from configuration, never from a header the caller sends.
_credentials: ContextVar[str | None] = ContextVar("msb_mcp_credentials", default=None)


def caller_token() -> str | None:
    return _credentials.get()


@contextlib.contextmanager
def calling_with(request: Any) -> Iterator[None]:
    """Keep the token of ``request`` (the HTTP request of a tool call) for the call's span."""
    access = access_of_request(request)
    reset = _credentials.set(access.token if access is not None else None)
    try:
        yield
    finally:
        _credentials.reset(reset)
