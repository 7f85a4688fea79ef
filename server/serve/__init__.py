"""Serving MCP: the gateway over the boundary, the tool registry, stdio and HTTP transports, auth,
metrics, logs and policy reload."""
