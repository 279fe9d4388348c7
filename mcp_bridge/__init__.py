"""MCP tools over sandboxed kernels (see issue: mcp_bridge)."""
