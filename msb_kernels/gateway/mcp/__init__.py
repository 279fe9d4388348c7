"""The MCP endpoint: the MCP bridge's streamable-HTTP app mounted at /mcp (mount.py), served from tornado (asgi.py),
and the metadata that tells a client which tokens it takes (metadata.py)."""
