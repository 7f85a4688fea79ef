"""What a start-up imports: heavy modules a path does not use stay out of it.

Every `commitgate` process pays for its imports before it does anything, and the test suite, Claude
Desktop and each `commitgate ops ...` start hundreds of them. These tests list the modules a real
process has loaded, so an import added at the top of a module on the way cannot bring a deferred
one back unnoticed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commitgate.server.ledger import open_ledger

# Loaded where they are used: a schema tool (jsonschema), [auth.oauth] (PyJWT), the first HTTP request
# of an http tool (httpcore2 and its TLS context), a WebSocket nobody serves (websockets).
DEFERRED_BY_SERVE = ("jsonschema", "referencing", "jwt", "httpcore2", "websockets")
# `--help` and a mistyped command: the policy's models, the ledger's records, the MCP SDK.
DEFERRED_BY_HELP = ("pydantic", "commitgate.server.policy.models", "commitgate.server.ledger.base", "mcp")

# `ops ... --json`: what writes a policy (tomlkit), what draws tables (rich) and the server stack.
DEFERRED_BY_OPS = ("tomlkit", "rich", "mcp", "commitgate.server.serve.gateway")

# Runs the command as the console script does and writes the names of the loaded modules at exit.
RUN_AND_LIST = """
import atexit, json, runpy, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
sys.argv[0] = "commitgate"
runpy.run_module("commitgate.server.cli", run_name="__main__")
"""


def loaded(names: list[str], deferred: tuple[str, ...]) -> list[str]:
    return [name for name in names if name.split(".")[0] in deferred or name in deferred]


def start_listing(tmp_path: Path, args: list[str]) -> tuple[subprocess.Popen[str], Path]:
    """`commitgate ARGS`, writing the modules it has loaded to the returned file when it exits."""
    out = tmp_path / "modules.json"
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "COMMITGATE_SANDBOX": str(tmp_path / "sandbox.db"),
    }
    process = subprocess.Popen(
        [sys.executable, "-c", RUN_AND_LIST, str(out), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    return process, out


def test_help_imports_no_policy_models_nor_the_sdk(tmp_path: Path) -> None:
    process, out = start_listing(tmp_path, ["--help"])
    process.communicate(timeout=60)
    modules = json.loads(out.read_text())
    assert "commitgate.server.cli.main" in modules
    assert loaded(modules, DEFERRED_BY_HELP) == []


def test_ops_list_imports_neither_policy_writing_nor_the_server(tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    asyncio.run(created(ledger))
    process, out = start_listing(tmp_path, ["ops", "list", "--json", "--ledger", ledger])
    assert json.loads(process.communicate(timeout=60)[0]) == {"operations": []}
    modules = json.loads(out.read_text())
    assert "commitgate.server.cli.ops" in modules
    assert loaded(modules, DEFERRED_BY_OPS) == []


async def created(url: str) -> None:
    await (await open_ledger(url)).close()


@pytest.mark.slow
def test_stdio_server_answers_tools_list_without_the_deferred_modules(tmp_path: Path) -> None:
    """The bundled policy over stdio, up to its first tools/list: no schema tool, no OAuth, no HTTP."""
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    process, out = start_listing(tmp_path, ["serve", "--ledger", ledger])
    assert process.stdin is not None and process.stdout is not None
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "startup-test", "version": "0"},
        },
    }
    try:
        for message in (initialize, {"jsonrpc": "2.0", "method": "notifications/initialized"}):
            process.stdin.write(json.dumps(message) + "\n")
        process.stdin.flush()
        assert json.loads(process.stdout.readline())["id"] == 1
        process.stdin.write(json.dumps({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}) + "\n")
        process.stdin.flush()
        assert json.loads(process.stdout.readline())["result"]["tools"]  # it served
        process.stdin.close()  # end of input: the server stops, and the list is written
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
    modules = json.loads(out.read_text())
    assert "commitgate.tools.http" in modules  # the module that defers them was imported
    assert loaded(modules, DEFERRED_BY_SERVE) == []
