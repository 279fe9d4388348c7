"""Who is asking: the person behind each request, and the kernels that are theirs.

- people.py: a Person, and the one context variable the HTTP layer and /mcp set for each request (background work
  runs as the system, which sees every kernel);
- users_file.py: the users file of a team without a Hub (hashed tokens, an admin flag);
- hub.py: JupyterHub's tokens, checked with JupyterHub's own HubAuth;
- tokens.py: the one place a token becomes a Person, whichever of the three issued it.

The gateway's IdentityProvider (msb_kernels.gateway.auth.identity) and the MCP bridge's /mcp both ask tokens.py, and the
kernel manager's lookup asks people.py; nothing else decides who may touch a kernel.
"""
