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
    """One NotebookDocuments per person, over their own server; ``public_url`` is where the Hub's proxy is
    (JupyterHub's public_url), else the origin the caller reached /mcp at."""

    def __init__(self, public_url: str | None):
        self.public_url = public_url.rstrip("/") if public_url else None
        self.people: dict[str, NotebookDocuments] = {}

    def documents(self, person: Person, token: str | None, origin: str | None) -> NotebookDocuments:
        if token is None:
            raise InvalidRequest(
                "the notebook tools need the person's own Hub token", ["send your JupyterHub API token as the bearer token"]
            )
        base = self.public_url or origin
        if base is None:
            raise InvalidRequest(
                "the gateway does not know where JupyterHub's proxy is",
                [
                    "the operator: set JupyterHub's c.JupyterHub.public_url (the deploy config's MSB_HUB_PUBLIC_URL)",
                    "or reach /mcp through the Hub's proxy",
                ],
            )
        url = f"{base.rstrip('/')}/user/{quote(person.name, safe='')}/"
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
