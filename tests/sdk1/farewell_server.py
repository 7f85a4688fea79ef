"""A stdio MCP server that says goodbye: when its input ends it logs one last `notifications/message`
before it exits, as servers that log their shutdown do. Plain JSON-RPC lines, standard library only.

It offers `charge_card` (answers a fixed text). For the MCP SDK's 1.x stdio client, that farewell
arrives after the session closed its read stream: the client's close race, every time.
"""

from __future__ import annotations

import json
import sys
from typing import Any

TOOL = {
    "name": "charge_card",
    "description": "Charge a card (a stand-in: nothing is charged).",
    "inputSchema": {
        "type": "object",
        "properties": {
            "card": {"type": "string"},
            "amount_cents": {"type": "integer"},
            "description": {"type": "string"},
            "idempotency_key": {"type": "string"},
        },
        "required": ["card", "amount_cents"],
    },
}


def answer(request: dict[str, Any]) -> dict[str, Any] | None:
    method, request_id = request.get("method"), request.get("id")
    if request_id is None:
        return None  # a notification
    if method == "initialize":
        result: dict[str, Any] = {
            "protocolVersion": request["params"]["protocolVersion"],
            "capabilities": {"tools": {}, "logging": {}},
            "serverInfo": {"name": "farewell", "version": "1"},
        }
    elif method == "tools/list":
        result = {"tools": [TOOL]}
    elif method == "tools/call":
        result = {"content": [{"type": "text", "text": "charged"}], "isError": False}
    else:
        result = {}
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


for line in sys.stdin:
    if line.strip():
        reply = answer(json.loads(line))
        if reply is not None:
            send(reply)
send({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "goodbye"}})
