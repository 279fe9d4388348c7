"""``msb-kernels serve``: one jupyter_server process that JupyterLab (``--gateway-url``) and MCP clients share, laid out
as jupyter_server is.

- app.py: the ServerApp subclass and its settings; serve_command.py: the ``serve`` subcommand (imports app.py only when run)
- auth/: who is asking (identity.py) and what they may do (authorizer.py)
- kernels/: the kernel service: the kernel manager (manager.py) and its records, the REST handlers and the WebSocket,
  and the manager's rooms: capacity.py (limits), culling.py, hibernation.py, adoption.py (kernels that outlive the
  gateway, and the activity watch), stats.py
- sessions.py, sandboxed_kernelspecs.py: jupyter_server's session manager, per person, and the sandboxed kernelspecs only
- mcp/: the MCP bridge mounted at /mcp (mount.py, asgi.py) and its metadata for clients (metadata.py)
- handlers.py: the table of every route, and /api/msb/health and /api/msb/stats; http_errors.py: where an MsbError
  from below becomes an HTTP answer, the one place; scrape.py: what /metrics reads at scrape time; host.py: what it reads of its host
"""
