"""Wrapping without loss: `commitgate policy init` run again, on a config it rewrote, and `policy unwrap`.

Every command runs as the real CLI in a subprocess against real stdio and HTTP MCP servers; what a
rerun keeps is compared byte for byte, and calls through the policy are counted in the servers' own
effect log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.wrapping import CONSOLE_SCRIPT, TESTS_DIR, annotated_web, call, error_code, serve

NAMED = str(TESTS_DIR / "support" / "named_server.py")
ANNOTATED = str(TESTS_DIR / "support" / "annotated_server.py")


def cli(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`commitgate ARGS` as a user runs it."""
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def named(root: Path, name: str, tools: list[dict[str, Any]], **env: str) -> dict[str, Any]:
    """A stdio entry for named_server.py offering `tools` (its spec file can be edited later)."""
    spec = root / f"{name}-tools.json"
    spec.write_text(json.dumps(tools), encoding="utf-8")
    return {
        "command": sys.executable,
        "args": [NAMED, name, str(spec)],
        "env": {"EFFECTS": str(root / "effects"), **env},
    }


def effects(root: Path) -> list[dict[str, Any]]:
    path = root / "effects"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_json(path: Path, document: dict[str, Any]) -> bytes:
    data = (json.dumps(document, indent=2) + "\n").encode()
    path.write_bytes(data)
    return data


DB_TOOLS = [{"name": "read_query"}, {"name": "write_query"}, {"name": "list_tables"}]
FILES_TOOLS = [
    {"name": "read_file", "annotations": {"readOnlyHint": True}},
    {"name": "write_file", "annotations": {"destructiveHint": True}},
]


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """An annotated HTTP server (its effects in its own file)."""
    effects = tmp_path_factory.mktemp("web") / "effects"
    with annotated_web(effects) as url:
        yield url, effects


def test_a_rerun_keeps_every_edit_adds_what_is_new_and_reports_each_addition(tmp_path: Path) -> None:
    config = tmp_path / "claude_desktop_config.json"
    servers = {
        "db": named(tmp_path, "db", DB_TOOLS, DB_TOKEN="t-db"),
        "files": named(tmp_path, "files", FILES_TOOLS),
    }
    write_json(config, {"mcpServers": servers})
    first = cli("policy", "init", "--from-config", config)
    assert first.returncode == 0, first.stderr
    policy = tmp_path / "commitgate.toml"
    # The user's edits: a line at the top, a comment rewritten, a value changed, a key added.
    edited = policy.read_text(encoding="utf-8")
    edited = '# mine\n[server]\nname = "mine"\n\n' + edited
    edited = edited.replace(
        '[tools.write_query]\nupstream = "db"\n', '[tools.write_query]\nupstream = "db"\ntimeout = "45s"\n'
    )
    edited = edited.replace(
        "# db declares no annotations.\n# safe-retry", "# checked by hand: a read\n# safe-retry", 1
    )
    policy.write_text(edited, encoding="utf-8")
    # Meanwhile: files gained a tool, a server was added to the config.
    (tmp_path / "files-tools.json").write_text(json.dumps([*FILES_TOOLS, {"name": "search_files"}]))
    servers["notes"] = named(tmp_path, "notes", [{"name": "add_note"}, {"name": "get_note"}])
    write_json(config, {"mcpServers": servers})

    rerun = cli("policy", "init", "--from-config", config)
    assert rerun.returncode == 0, rerun.stderr
    text = policy.read_text(encoding="utf-8")
    assert text.startswith(edited)  # every line as the user left it, byte for byte
    added = [line for line in rerun.stdout.splitlines() if line.startswith("added ")]
    assert added == [
        "added [upstreams.notes]",
        "added [tools.search_files]: 'search_files' of files, safe-retry",
        "added [tools.add_note]: 'add_note' of notes, key-required",
        "added [tools.get_note]: 'get_note' of notes, safe-retry",
    ]
    document = tomllib.loads(text)
    assert document["server"] == {"name": "mine"} and document["tools"]["write_query"]["timeout"] == "45s"
    assert len(document["tools"]) == 5 + 3 and set(document["upstreams"]) == {"db", "files", "notes"}
    assert "#" + " [tools" not in text and "\n# class" not in text  # nothing commented out
    env = {"EFFECTS": str(tmp_path / "effects"), "DB_TOKEN": "t-db"}
    assert cli("policy", "check", policy, env=env).returncode == 0

    # Nothing new, and a tool the server no longer offers: reported, its entry kept, the policy byte
    # for byte as it was.
    (tmp_path / "db-tools.json").write_text(json.dumps(DB_TOOLS[:2]))
    again = cli("policy", "init", "--from-config", config)
    assert again.returncode == 0 and policy.read_text(encoding="utf-8") == text
    assert f"{policy}: nothing new; left as it was" in again.stdout
    assert (
        "db no longer offers 'list_tables': [tools.list_tables] stays; remove it if it is gone for good"
        in again.stdout
    )


@pytest.mark.anyio
async def test_a_rerun_on_a_rewritten_config_keeps_one_entry_and_the_first_backup(tmp_path: Path) -> None:
    config = tmp_path / "claude_desktop_config.json"
    servers = {
        "db": named(tmp_path, "db", DB_TOOLS, DB_TOKEN="t-db"),
        "files": named(tmp_path, "files", FILES_TOOLS),
    }
    original = write_json(config, {"mcpServers": servers, "theme": "dark"})
    assert cli("policy", "init", "--from-config", config, "--write-config").returncode == 0
    policy = tmp_path / "commitgate.toml"
    wrapped = json.loads(config.read_text())
    assert list(wrapped["mcpServers"]) == ["commitgate"]

    # The user adds a server beside the commitgate entry, and runs init again.
    wrapped["mcpServers"]["notes"] = named(tmp_path, "notes", [{"name": "add_note"}], NOTES_KEY="t-notes")
    with_notes = write_json(config, wrapped)
    before = policy.read_text(encoding="utf-8")
    rerun = cli("policy", "init", "--from-config", config, "--write-config")
    assert rerun.returncode == 0, rerun.stderr
    assert policy.read_text(encoding="utf-8").startswith(before)
    assert set(tomllib.loads(policy.read_text())["upstreams"]) == {"db", "files", "notes"}
    servers_now = json.loads(config.read_text())["mcpServers"]
    assert list(servers_now) == ["commitgate"]  # one entry, the same one: never a second for one policy
    entry = servers_now["commitgate"]
    assert entry["args"] == wrapped["mcpServers"]["commitgate"]["args"]
    assert entry["env"] == {"EFFECTS": str(tmp_path / "effects"), "DB_TOKEN": "t-db", "NOTES_KEY": "t-notes"}
    assert (tmp_path / "claude_desktop_config.json.bak").read_bytes() == original  # the first backup kept
    assert (tmp_path / "claude_desktop_config.json.bak.1").read_bytes() == with_notes
    assert f"the file before is kept as {config}.bak.1" in rerun.stdout
    assert "'commitgate' serves" in rerun.stdout and "commitgate-2" not in rerun.stdout

    # Nothing new: config, policy and backups stay as they are.
    state = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    again = cli("policy", "init", "--from-config", config, "--write-config")
    assert again.returncode == 0, again.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == state

    # The entry's env is all serve needs: a write through each wrapped server runs once.
    async with serve(policy, tmp_path / "serve.log", env=entry["env"], log_level="warning") as client:
        for tool in ("write_query", "add_note"):
            arguments = {"note": tool, "idempotency_key": f"k-{tool}"}
            assert error_code(await call(client, tool, arguments)) is None
            assert error_code(await call(client, tool, arguments)) is None  # replayed
    assert sorted(e["tool"] for e in effects(tmp_path)) == ["add_note", "write_query"]

    # --force writes the policy anew, still from every server the entry serves.
    forced = cli("policy", "init", "--from-config", config, "--write-config", "--force")
    assert forced.returncode == 0, forced.stderr
    assert set(tomllib.loads(policy.read_text())["upstreams"]) == {"db", "files", "notes"}
    assert list(json.loads(config.read_text())["mcpServers"]) == ["commitgate"]
    assert (tmp_path / "claude_desktop_config.json.bak").read_bytes() == original


def test_wrap_unwrap_wrap_is_the_identity(tmp_path: Path, web: tuple[str, Path]) -> None:
    url, _ = web
    config = tmp_path / "claude_desktop_config.json"
    db = named(tmp_path, "db", DB_TOOLS, DB_TOKEN="t-db")
    db["args"] += ["--api-key=k3y", "--token", "t0k", "postgresql://u:pw@localhost/db", "${HOME}/x"]
    db["cwd"] = str(tmp_path)
    document = {
        "mcpServers": {
            "commitgate": {"command": "commitgate", "args": ["serve"]},  # the demo entry: it stays
            "db": db,
            "web": {
                "type": "http",
                "url": url + "?token=q-tok",
                "headers": {"Authorization": "Bearer s3cret-web"},
            },
            "files": named(tmp_path, "files", FILES_TOOLS),
        },
        "globalShortcut": "Ctrl+Space",
    }
    original = write_json(config, document)
    policy = tmp_path / "commitgate.toml"

    wrap = cli("policy", "init", "--from-config", config, "--write-config")
    assert wrap.returncode == 0, wrap.stderr
    wrapped, wrapped_policy = config.read_bytes(), policy.read_bytes()
    assert list(json.loads(wrapped)["mcpServers"]) == ["commitgate", "commitgate-2"]
    for secret in (b"k3y", b"t0k", b":pw@", b"q-tok", b"s3cret", b"t-db"):
        assert secret not in wrapped_policy

    unwrap = cli("policy", "unwrap", "--from-config", config)
    assert unwrap.returncode == 0, unwrap.stderr
    assert config.read_bytes() == original  # every server as it was, secrets included
    assert policy.read_bytes() == wrapped_policy  # the policy stays
    assert (tmp_path / "claude_desktop_config.json.bak.1").read_bytes() == wrapped
    assert f"kept as {config}.bak.1" in unwrap.stdout

    again = cli("policy", "init", "--from-config", config, "--write-config")
    assert again.returncode == 0, again.stderr
    assert config.read_bytes() == wrapped and policy.read_bytes() == wrapped_policy
    assert (tmp_path / "claude_desktop_config.json.bak").read_bytes() == original  # the same backup
    assert not (tmp_path / "claude_desktop_config.json.bak.2").exists()
    assert f"already kept as {config}.bak" in again.stdout


def test_unwrap_without_a_commitgate_entry_says_so(tmp_path: Path) -> None:
    config = tmp_path / "mcp.json"
    data = write_json(config, {"servers": {"db": {"type": "stdio", "command": "db"}}})
    result = cli("policy", "unwrap", "--from-config", config)
    assert result.returncode == 1 and config.read_bytes() == data
    assert result.stderr.splitlines() == [
        f"commitgate: {config}: no commitgate entry serves a policy; there is nothing to unwrap"
    ]
