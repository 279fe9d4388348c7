"""Who is asking, on every route of the gateway: jupyter_server's IdentityProvider hook.

One IdentityProvider for every route: jupyter_server's REST handlers and the kernel WebSocket call ``get_user``, and
/mcp (mcp/asgi.py) asks the same ``Tokens``. ``get_user`` also makes the person the caller of the request
(msb_kernels.identity.people), which is what the kernel manager's lookup checks (authorizer.py says where).

No login page and no cookie: every request carries its token (``Authorization: token|bearer ...``, or ``?token=``).
"""

from __future__ import annotations

from jupyter_server.auth.identity import IdentityProvider, User
from tornado import web

from msb_kernels.identity.hub import HubUnreachable
from msb_kernels.identity.people import Person, set_acting
from msb_kernels.identity.tokens import Tokens
from msb_kernels.observability import audit


class MsbUser(User):
    """jupyter_server's User, carrying the Person it is."""

    person: Person

    def __init__(self, person: Person):
        super().__init__(username=person.name, name=person.name, display_name=person.name)
        self.person = person


class MsbIdentityProvider(IdentityProvider):
    """Tokens only (the single token, the users file, JupyterHub's), never a login page or a cookie."""

    tokens: Tokens | None = None  # set by the gateway app at start, from its settings

    def get_handlers(self) -> list:
        return []

    @property
    def login_available(self) -> bool:
        return False

    @property
    def auth_enabled(self) -> bool:
        """Always: every request's token is checked (get_user), though IdentityProvider.token, which jupyter_server's
        pages print, holds none."""
        return True

    async def get_user(self, handler: web.RequestHandler) -> User | None:  # type: ignore[override]
        cached = getattr(handler, "_jupyter_current_user", None)
        if isinstance(cached, MsbUser):
            set_acting(cached.person, client_of(handler))
            return cached
        token = self.get_token(handler)
        try:
            person = await self.person_for(token)
        except HubUnreachable as exc:
            raise web.HTTPError(503, exc.message) from None
        # The caller for the rest of this request: the kernel manager's lookup reads it.
        set_acting(person, client_of(handler))
        if person is None:
            if token:  # a token nobody here issued (no token at all is every health check's: not worth a line)
                audit.record("refusal", "unknown token", None, person="?", route=handler.request.path, remote=handler.request.remote_ip)
            return None
        handler._token_authenticated = True  # type: ignore[attr-defined]  # jupyter_server: skip its XSRF and Origin checks
        return MsbUser(person)

    async def person_for(self, token: str | None) -> Person | None:
        """The person a token is, for every route, /mcp's too (HubUnreachable where JupyterHub did not answer)."""
        return await self.tokens.person(token) if self.tokens is not None else None


def client_of(handler: web.RequestHandler) -> str:
    """What the caller uses, for the audit trail: a JupyterLab or jupyter server sends its gateway client's
    User-Agent (tornado's), a script its own."""
    agent = handler.request.headers.get("User-Agent", "")
    kind = "websocket" if handler.request.headers.get("Upgrade", "").lower() == "websocket" else "rest"
    return f"{kind}: {agent}"[:80] if agent else kind
