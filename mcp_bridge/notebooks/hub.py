"""Each person's own JupyterLab, under JupyterHub: the notebook tools act in the requesting person's server.

A team runs one Lab per person (``/user/<name>/`` behind the Hub's proxy). The tools reach the caller's own server
with the caller's own token, the one their MCP client sent: the narrowest credential that works. A token from
/hub/token carries ``access:servers!user=<name>`` (it inherits its owner's permissions) and so reaches their server and
nobody else's; the gateway holds no grant to any person's server, so nothing it does on one person's call can open
another person's notebooks. JupyterHub's sharing (access to another's server) is not used: the tools open only the
caller's own default server.
"""

from __future__ import annotations

from urllib.parse import quote

from mcp_bridge.notebooks.documents import NotebookDocuments
from mcp_bridge.notebooks.lab import LabServer
from msb_kernels.errors import InvalidRequest
from msb_kernels.identity.people import Person


class PersonalLabs:
    """One NotebookDocuments per person, over their own server; ``proxy_url`` is where this gateway reaches the Hub's
    proxy, from configuration alone (HubService.proxy_origin). Never a request's Host or X-Forwarded-Host: a header a
    person sends would make the gateway connect, from inside the operator's network, wherever they named."""

    def __init__(self, proxy_url: str | None):
        self.proxy_url = proxy_url.rstrip("/") if proxy_url else None
        self.people: dict[str, NotebookDocuments] = {}

    def documents(self, person: Person, token: str | None) -> NotebookDocuments:
        if self.proxy_url is None:
            raise InvalidRequest(
                "the notebook tools do not know where JupyterHub's proxy is: MSB_HUB_PROXY_URL is unset, and so is "
                "JupyterHub's public_url (JUPYTERHUB_PUBLIC_URL)",
                [
                    "the operator: set MSB_HUB_PROXY_URL for the gateway service (the shipped jupyterhub_config.py sets it)",
                    "or set c.JupyterHub.public_url (the shipped config's MSB_HUB_PUBLIC_URL)",
                ],
            )
        if token is None:
            raise InvalidRequest(
                "the notebook tools need the person's own Hub token", ["send your JupyterHub API token as the bearer token"]
            )
        url = f"{self.proxy_url}/user/{quote(person.name, safe='')}/"
        documents = self.people.get(person.name)
        if documents is None or documents.lab.url != url.rstrip("/"):
            documents = self.people[person.name] = NotebookDocuments(LabServer(url, token))
        elif documents.lab.token != token:  # the same person with a new token: the next calls use it
            documents.lab.use_token(token)
        return documents

    def sizes(self) -> dict[str, int]:
        return {"people": len(self.people), "notebooks": sum(len(d.notebooks) for d in self.people.values())}

    async def close(self) -> None:
        for documents in list(self.people.values()):
            await documents.close()
        self.people.clear()
