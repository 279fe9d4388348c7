"""``msb-kernels serve``: one jupyter_server process that JupyterLab (``--gateway-url``) and MCP clients share.

- app.py: the ServerApp subclass and its settings; cli.py: the ``serve`` subcommand (imports app.py only when run)
- handlers.py: /api/msb/stats, /api/msb/health, the kernel and session start handlers; errors.py: where an
  MsbError from below becomes an HTTP answer, the one place
- manager.py: the kernel manager, with a room per concept: capacity.py (limits), culling.py, adoption.py
  (kernels that outlive the gateway), activity.py (the activity watch and the closed clients' buffer),
  stats.py; records.py (what it knows of each kernel), kernelspecs.py (only sandboxed ones), host.py
- asgi.py, mcp.py: the bridge that mounts the MCP bridge's ASGI app at /mcp
"""
