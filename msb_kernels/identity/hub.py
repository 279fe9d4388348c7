"""JupyterHub's tokens: the gateway as a Hub service, checked with JupyterHub's own HubAuth.

JupyterHub gives a service its environment (JUPYTERHUB_API_URL, JUPYTERHUB_API_TOKEN, JUPYTERHUB_SERVICE_NAME,
JUPYTERHUB_SERVICE_PREFIX, and for a managed service JUPYTERHUB_SERVICE_URL); with it, ``msb-kernels serve`` needs no
other setting. Each request's token is sent to the Hub's ``/hub/api/user`` once per MSB_HUB_AUTH_CACHE_SECONDS
(HubAuth's cache, which also remembers a refusal), and its scopes are checked at every access, so a role taken away
or a token revoked counts within that time. The scope required is JupyterHub's own for a service:
``access:services!service=<name>``; a Hub admin whose token shows it (the model's ``admin``) is an admin here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from msb_kernels.errors import ConfigError, MsbError
from msb_kernels.identity.people import Person

HUB_VARIABLES = ("JUPYTERHUB_API_URL", "JUPYTERHUB_API_TOKEN", "JUPYTERHUB_SERVICE_NAME")


class HubUnreachable(MsbError):
    """The Hub did not answer a token check: the request is refused (503), and nothing is cached."""


@dataclass(frozen=True)
class HubService:
    """What JupyterHub told this process about itself, from its environment."""

    api_url: str
    api_token: str
    name: str
    prefix: str  # where the Hub's proxy sends this service's requests: /services/<name>/
    url: str | None  # where a managed service is to listen (http://127.0.0.1:PORT)

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> HubService | None:
        """The service's environment, or None where JupyterHub did not start this process (or tell it to be its service)."""
        env = os.environ if environ is None else environ
        present = [name for name in HUB_VARIABLES if env.get(name)]
        if not present:
            return None
        missing = [name for name in HUB_VARIABLES if not env.get(name)]
        if missing:
            raise ConfigError(
                f"{', '.join(present)} {'is' if len(present) == 1 else 'are'} set but {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not: a JupyterHub service needs all of {', '.join(HUB_VARIABLES)}",
                [
                    "run msb-kernels serve as a service in jupyterhub_config.py (deploy/jupyterhub/jupyterhub_config.py)",
                    "or, for an external service, export the service's api_token as JUPYTERHUB_API_TOKEN beside the other two",
                ],
            )
        name = env["JUPYTERHUB_SERVICE_NAME"]
        prefix = env.get("JUPYTERHUB_SERVICE_PREFIX") or f"/services/{name}/"
        return cls(
            env["JUPYTERHUB_API_URL"], env["JUPYTERHUB_API_TOKEN"], name, prefix.rstrip("/") + "/", env.get("JUPYTERHUB_SERVICE_URL")
        )

    def proxy_origin(self, configured: str | None) -> str | None:
        """Where this gateway reaches the Hub's proxy (scheme://host:port), from configuration alone: MSB_HUB_PROXY_URL,
        else JupyterHub's public_url (JUPYTERHUB_PUBLIC_URL is this service's public URL, prefix and all). None where
        neither is set: the notebook tools then say which setting is missing."""
        public = configured or os.environ.get("JUPYTERHUB_PUBLIC_URL")
        if not public:
            return None
        parsed = urlparse(public)
        return f"{parsed.scheme}://{parsed.netloc}" if parsed.scheme and parsed.netloc else None

    @property
    def access_scope(self) -> str:
        return f"access:services!service={self.name}"

    @property
    def hub_url(self) -> str:
        """The Hub's own base (for a person to find /hub/token): the API URL less its api/ part."""
        return self.api_url.rstrip("/").removesuffix("/api") + "/"


class HubTokens:
    """Hub API tokens to people, through jupyterhub.services.auth.HubAuth."""

    def __init__(self, service: HubService, cache_seconds: int):
        try:
            from jupyterhub.services.auth import HubAuth
        except ImportError:
            raise ConfigError(
                "msb-kernels serve runs as a JupyterHub service here (JUPYTERHUB_API_URL is set), but jupyterhub is not installed",
                ["pip install 'msb-kernels[hub]' (or jupyterhub) into msb-kernels' environment"],
            ) from None
        self.service = service
        # HubAuth's cache takes 0 for "keep forever"; here 0 means "ask the Hub at every request".
        self.use_cache = cache_seconds > 0
        self.auth: Any = HubAuth(
            api_url=service.api_url,
            api_token=service.api_token,
            cache_max_age=cache_seconds,
            access_scopes={service.access_scope},
        )

    async def person(self, token: str) -> Person | None:
        """The person this token is, if it is a user's token carrying the service's scope; else None."""
        try:
            model = await self.auth.user_for_token(token, use_cache=self.use_cache, sync=False)
        except Exception as exc:  # HubAuth raises tornado HTTPErrors (500/502) when the Hub fails or is away
            raise HubUnreachable(
                f"JupyterHub did not answer the token check at {self.service.api_url}: {getattr(exc, 'log_message', None) or exc}",
                ["try again in a moment", "the operator: check that JupyterHub runs and that this service's api_token is current"],
            ) from None
        if not model or model.get("kind", "user") != "user" or not model.get("name"):
            return None
        if not self.auth.check_scopes(self.auth.access_scopes, model):
            return None
        return Person(str(model["name"]), bool(model.get("admin")), "hub")
