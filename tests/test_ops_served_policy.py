"""`commitgate ops` without `--policy`: the ledger of the policy Claude Desktop's commitgate entry serves.

A fake HOME holds Claude Desktop's config with the entry `commitgate claude-config --policy P` prints;
the server is started exactly as that entry says, an email is sent through it (counted in the
sandbox), and `commitgate ops list`, run with nothing but that HOME, finds the operation. Without the
config, `ops list` says which `--policy` to pass.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from support.e2e import CONSOLE_SCRIPT, Deployment
from support.wrapping import base_env


def commitgate(*args: str, home: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *args],
        env=base_env(HOME=str(home)),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def desktop_config(home: Path, policy: Path) -> dict[str, Any]:
    """Claude Desktop's config in `home` with the entry `claude-config` prints, beside another server."""
    printed = commitgate("claude-config", "--policy", str(policy), home=home, cwd=home)
    assert printed.returncode == 0, printed.stderr
    entry = json.loads(printed.stdout)["mcpServers"]["commitgate"]
    config = home / ".config" / "Claude" / "claude_desktop_config.json"
    config.parent.mkdir(parents=True)
    servers = {"time": {"command": "uvx", "args": ["mcp-server-time"]}, "commitgate": entry}
    config.write_text(json.dumps({"mcpServers": servers}, indent=2), encoding="utf-8")
    return dict(entry)


@pytest.mark.anyio
async def test_ops_list_finds_the_ledger_of_the_policy_claude_desktop_serves(tmp_path: Path) -> None:
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    deployment = Deployment.create(tmp_path / "deploy")
    entry = desktop_config(home, deployment.policy)
    params = StdioServerParameters(
        command=entry["command"], args=entry["args"], env={**deployment.env(), "HOME": str(home)}
    )
    async with Client(stdio_client(params), read_timeout_seconds=60) as client:
        sent = await client.call_tool(
            "send_email", {"to": "a@example.com", "subject": "s", "body": "b", "idempotency_key": "mail-1"}
        )
        assert not sent.is_error, sent
    assert deployment.count("emails") == 1
    listed = commitgate("ops", "list", "--json", home=home, cwd=elsewhere)
    assert listed.returncode == 0, listed.stderr
    operations = json.loads(listed.stdout)["operations"]
    assert [(op["tool"], op["idempotency_key"]) for op in operations] == [("send_email", "mail-1")]
    assert f"'commitgate' entry of {home / '.config' / 'Claude'}" in listed.stderr


def test_without_a_desktop_entry_ops_says_which_policy_to_pass(tmp_path: Path) -> None:
    listed = commitgate("ops", "list", home=tmp_path, cwd=tmp_path)
    assert listed.returncode == 1
    assert "no ledger at" in listed.stderr and "pass --policy FILE" in listed.stderr, listed.stderr
    assert "Traceback" not in listed.stderr
