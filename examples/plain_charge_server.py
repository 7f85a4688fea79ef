"""The same `charge_card` as a plain MCP server, without commitgate: what the agent example compares with.

It takes an `idempotency_key` like the guarded tool does, and ignores it, as many tools do.
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer

from commitgate.server.demo import tools as demo

server = MCPServer("plain-charge")


@server.tool()
def charge_card(card: str, amount_cents: int, idempotency_key: str, description: str = "") -> dict:
    """Charge a payment card `amount_cents` (integer cents) and return the charge."""
    return demo.charge_card(card, amount_cents, description)


if __name__ == "__main__":
    server.run("stdio")
