"""Where a token becomes a Person: the gateway's single token, the users file, or JupyterHub, in that order.

The gateway's IdentityProvider (every REST route and WebSocket) and /mcp's token verifier both call
``Tokens.person``; nothing else reads a token. Built once at the gateway's start from its settings.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from msb_kernels.identity.hub import HubService, HubTokens
from msb_kernels.identity.people import Person, login_name
from msb_kernels.identity.users_file import UsersFile


class Tokens:
    """The token authorities this gateway trusts. ``single`` is today's one token: one person, an admin."""

    def __init__(
        self,
        single: str | None = None,
        users_file: Path | None = None,
        hub: HubService | None = None,
        hub_cache_seconds: int = 30,
        single_user: str | None = None,
    ):
        self.single = single or None
        self.single_person = Person(single_user or login_name(), admin=True, source="token")
        self.users = UsersFile(users_file) if users_file is not None else None
        self.hub = HubTokens(hub, hub_cache_seconds) if hub is not None else None

    @property
    def sources(self) -> list[str]:
        """What issues tokens here, for the banner and the docs' words."""
        return [s for s, on in (("the gateway's token", self.single), ("the users file", self.users), ("JupyterHub", self.hub)) if on]

    async def person(self, token: str | None) -> Person | None:
        """The person a token is, or None for no token, or one nobody here issued."""
        if not token:
            return None
        if self.single is not None and hmac.compare_digest(token.encode(), self.single.encode()):
            return self.single_person
        if self.users is not None:
            person = self.users.person(token)
            if person is not None:
                return person
        if self.hub is not None:
            return await self.hub.person(token)
        return None
