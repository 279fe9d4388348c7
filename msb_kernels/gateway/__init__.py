"""``msb-kernels serve``: one jupyter_server process that JupyterLab (``--gateway-url``) and MCP clients share.

- manager.py: the kernel and kernelspec managers (limits, capacity, culling, stats)
- handlers.py: /api/msb/stats, /api/msb/health, and the kernel/session start handlers that pass KERNEL_* env
- app.py: the ServerApp subclass and its settings; cli.py: the ``serve`` subcommand (imports app.py only when run)
- asgi.py, mcp.py: the bridge that mounts the MCP bridge's ASGI app at /mcp
"""
