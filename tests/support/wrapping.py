"""Helpers for the tests of wrapped tools (http and upstream sources).

* `serve(policy, env)`: a real `commitgate serve` process over stdio behind an SDK `Client`, its stderr
  captured to a file (run at `--log-level debug`, so tests can look for secrets in it).
* `memory_server()`: the npm reference server `@modelcontextprotocol/server-memory`, installed once
  with the tests' other npm packages into build/node22 (support/node.py).
* small readers for results: the operation in `_meta`, the error code.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.types import CallToolResult

from support.node import MEMORY_SERVER, NodeMissing, package

TESTS_DIR = Path(__file__).resolve().parent.parent
CONSOLE_SCRIPT = Path(sys.executable).parent / "commitgate"
SESSION_META = "commitgate/session"
STEP_META = "commitgate/step"


def base_env(**extra: str) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": os.environ.get("HOME", "/tmp"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(TESTS_DIR),
    }
    env.update(extra)
    return env


@contextlib.asynccontextmanager
async def serve(
    policy: Path, stderr: Path, env: Mapping[str, str] | None = None, log_level: str = "debug"
) -> AsyncIterator[Client]:
    """`commitgate serve --policy POLICY --log-level debug`, stderr to a file, behind a Client."""
    params = StdioServerParameters(
        command=str(CONSOLE_SCRIPT),
        args=["serve", "--policy", str(policy), "--log-level", log_level],
        env=base_env(**(env or {})),
    )
    with stderr.open("a", encoding="utf-8") as errlog:
        async with Client(stdio_client(params, errlog=errlog), read_timeout_seconds=60) as client:
            yield client


async def call(
    client: Client, tool: str, arguments: Mapping[str, Any] | None = None, *, session: str | None = None
) -> CallToolResult:
    meta = {SESSION_META: session} if session else None
    return await client.call_tool(tool, dict(arguments or {}), meta=meta)  # type: ignore[arg-type]


def operation(result: CallToolResult) -> dict[str, Any]:
    assert result.meta is not None, result
    return dict(result.meta["commitgate/operation"])


def error_code(result: CallToolResult) -> str | None:
    if not result.is_error:
        return None
    assert result.structured_content is not None, result
    return str(result.structured_content["error"]["code"])


def text(result: CallToolResult) -> str:
    return "\n".join(getattr(block, "text", "") for block in result.content)


async def eventually(probe: Any, within: float = 20.0, every: float = 0.1) -> Any:
    """Call `probe()` (sync or async) until it returns a truthy value (fails after `within` seconds)."""
    with anyio.fail_after(within):
        while True:
            value = probe()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            await anyio.sleep(every)


async def upstream_listed(client: Client, tool: str, within: float = 30.0) -> dict[str, Any]:
    """The served tools, once `tool` is advertised with what its upstream declared (upstreams
    connect in the background: until then a tool is advertised from the policy alone)."""

    async def listed() -> dict[str, Any] | None:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        served = tools.get(tool)
        own = set((served.input_schema or {}).get("properties", {})) if served else set()
        return tools if own - {"idempotency_key", "confirm_duplicate"} else None

    tools: dict[str, Any] = await eventually(listed, within)
    return tools


# --- the third-party MCP server -----------------------------------------------------------------------


def memory_server() -> Path:
    """The installed server's entry point (installed on first use); skips without npm."""
    try:
        return package(MEMORY_SERVER) / "dist" / "index.js"
    except (NodeMissing, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"{MEMORY_SERVER} (the third-party upstream) cannot be installed: {exc}")


def memory_entities(store: Path, name: str | None = None) -> list[dict[str, Any]]:
    """The entities in server-memory's own JSONL store (optionally only those called `name`)."""
    if not store.exists():
        return []
    items = [json.loads(line) for line in store.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [i for i in items if i.get("type") == "entity" and (name is None or i.get("name") == name)]


@contextlib.contextmanager
def annotated_web(effects: Path) -> Iterator[str]:
    """The annotated test server over HTTP (its effects in `effects`); yields its URL."""
    process = subprocess.Popen(
        [sys.executable, str(TESTS_DIR / "support" / "annotated_server.py"), "web", "http"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "EFFECTS": str(effects)},
    )
    try:
        assert process.stdout is not None
        yield process.stdout.readline().strip()
    finally:
        process.terminate()
        process.wait(timeout=10)
