"""Upstream tools as their own servers declare them: hints kept true, `tools = "all"`, slow starts.

Every upstream is a real process: tests/support/hinted_server.py, whose tools declare each kind of
annotation and whose effects are counted in its own log, behind a real `commitgate serve`. One
server of the 1.x SDK (from `.venv-sdk1`) shows the handshake raises no validation errors there.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.shared.subscriptions import ToolsListChanged
from support.wrapping import (
    CONSOLE_SCRIPT,
    TESTS_DIR,
    call,
    eventually,
    operation,
    serve,
    text,
    upstream_listed,
)

from commitgate.server.policy.loading import loads_policy
from commitgate.server.policy.problems import PolicyError

ROOT = TESTS_DIR.parent
HINTED = TESTS_DIR / "support" / "hinted_server.py"
SDK1_PYTHON = ROOT / ".venv-sdk1" / "bin" / "python"
KEY = {"idempotency_key"}
SERVER = """
[server]
respond_within = "20s"

[ledger]
url = "sqlite:///{ledger}"
"""
STUCK = 'upstream_tool = "note"\ntimeout = "1s"\nretry = { attempts = 1 }'
WARNING = "note is served as safe-retry, but its server does not declare it read-only"


def upstream(root: Path, name: str, extra: str = "", **env: str | Path) -> str:
    variables = {"HINTED_EFFECTS": root / f"{name}.jsonl", "HINTED_PID": root / f"{name}.pid", **env}
    written = ", ".join(f'{k} = "{v}"' for k, v in variables.items())
    return f'\n[upstreams.{name}]\ncommand = "{sys.executable}"\nargs = ["{HINTED}"]\nenv = {{ {written} }}\n{extra}\n'


def tool(name: str, cls: str, extra: str = "", upstream: str = "h") -> str:
    return f'\n[tools.{name}]\nupstream = "{upstream}"\nclass = "{cls}"\n{extra}\n'


def effects(root: Path, name: str) -> list[dict[str, Any]]:
    path = root / f"{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def hints(tools: dict[str, Any], name: str) -> dict[str, Any]:
    annotations = tools[name].annotations
    return annotations.model_dump(by_alias=True, exclude_none=True) if annotations else {}


def keyed(tools: dict[str, Any], name: str) -> bool:
    return "idempotency_key" in tools[name].input_schema.get("required", [])


# --- what is advertised, what is warned -----------------------------------------------------------------


@pytest.fixture(scope="module")
def hinted_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hints")
    policy = root / "policy.toml"
    policy.write_text(
        SERVER.format(ledger=root / "ledger.db")
        + upstream(root, "h")
        + upstream(root, "all", 'tools = "all"', HINTED_EXTRA=root / "upgraded")
        + tool("lookup", "safe-retry")
        + tool("note", "safe-retry")  # a write classed safe-retry by mistake
        + tool("erase", "key-required")
        + tool(
            "erase_softly",
            "key-required",
            'upstream_tool = "erase"\ndestructive = false\ntitle = "Soft erase"',
        )
        + tool("tally", "key-required")
        + tool("careful_tally", "key-required", 'upstream_tool = "tally"', upstream="all")
    )
    return policy


@pytest.mark.slow
@pytest.mark.anyio
async def test_upstream_hints_are_kept_and_never_made_up(hinted_policy: Path) -> None:
    root = hinted_policy.parent
    async with serve(hinted_policy, root / "stderr.log") as client:
        await upstream_listed(client, "erase")
        tools = await upstream_listed(client, "all__note")
        note = {"text": "hi", "idempotency_key": "n-1"}
        first, again = await call(client, "all__note", note), await call(client, "all__note", note)
        read = await call(client, "all__lookup", {"name": "x"})
        grown = await _grown(client, root)  # the `tools = "all"` upstream gains a tool
    assert keyed(grown, "added_later")  # declares nothing: key-required
    # kept: title, destructive, open world; read-only only where the server said so
    assert hints(tools, "lookup") == {"title": "Look up", "readOnlyHint": True, "openWorldHint": False}
    assert "readOnlyHint" not in hints(tools, "note")  # safe-retry never makes a write look read-only
    assert hints(tools, "erase") == {
        "title": "Erase",
        "readOnlyHint": False,
        "destructiveHint": True,
        "idempotentHint": True,
        "openWorldHint": True,
    }
    assert tools["erase"].title == "Erase a record" and keyed(tools, "erase")
    softly = hints(tools, "erase_softly")  # the entry's own title and destructive win
    assert (softly["title"], softly["destructiveHint"], tools["erase_softly"].title) == (
        "Soft erase",
        False,
        "Soft erase",
    )
    assert hints(tools, "tally") == {"readOnlyHint": False, "idempotentHint": True}
    # tools = "all": classes from annotations; names the policy or another upstream has get a prefix
    assert not keyed(tools, "all__lookup") and hints(tools, "all__lookup")["readOnlyHint"] is True
    assert keyed(tools, "all__note") and keyed(tools, "all__erase")
    assert "careful_tally" in tools and "all__tally" not in tools  # its own entry serves it
    assert not first.is_error and not read.is_error, (text(first), text(read))
    assert operation(again)["replayed"] is True
    assert [e["tool"] for e in effects(root, "all")] == ["note", "added_later"]  # once each
    log = (root / "stderr.log").read_text()
    assert f"tools.note: {WARNING}" in log
    assert "tools.lookup: lookup is served as safe-retry" not in log
    warnings = [json.loads(line)["msg"] for line in log.splitlines() if '"level":"warning"' in line]
    assert not [w for w in warnings if "refreshed" in w]  # a first connect is normal: info
    assert "upstream all now offers other tools: new added_later, gone none" in "\n".join(warnings)


async def _grown(client: Any, root: Path) -> dict[str, Any]:
    """Upgrade and restart the `all` upstream: its new tool is announced, then served (once per key)."""
    async with client.listen(tools_list_changed=True) as changes:
        (root / "upgraded").touch()  # once restarted, it offers one more tool
        os.kill(int((root / "all.pid").read_text()), signal.SIGTERM)
        with anyio.fail_after(30):  # the reconnect, then the announcement
            while "added_later" not in {t.name for t in (await client.list_tools()).tools}:
                assert isinstance(await changes.__anext__(), ToolsListChanged)
    tools = await upstream_listed(client, "added_later")
    once = {"text": "new", "idempotency_key": "later-1"}
    first, again = await call(client, "added_later", once), await call(client, "added_later", once)
    assert not first.is_error, text(first)
    assert operation(again)["replayed"] is True
    assert [e["tool"] for e in effects(root, "all")].count("added_later") == 1
    return tools


@pytest.mark.slow
def test_policy_show_upstreams_lists_every_offered_tool_with_its_warnings(hinted_policy: Path) -> None:
    command = [str(CONSOLE_SCRIPT), "policy", "show", "--upstreams", str(hinted_policy)]
    runs = [subprocess.Popen(c, stdout=subprocess.PIPE, text=True) for c in ([*command, "--json"], command)]
    (as_json, _), (as_text, _) = (run.communicate(timeout=90) for run in runs)
    assert [run.returncode for run in runs] == [0, 0]
    inventory = {item["name"]: item for item in json.loads(as_json)["upstream_inventory"]}
    offered = {t["name"]: t for t in inventory["h"]["tools"]}
    assert set(offered) == {"lookup", "erase", "note", "tally"}
    assert offered["note"] == {
        "name": "note",
        "served_as": "note",
        "class": "safe-retry",
        "annotations": {},
        "warnings": [offered["note"]["warnings"][0]],
    }
    assert offered["note"]["warnings"][0].startswith(WARNING)
    assert offered["lookup"]["annotations"] == {
        "title": "Look up",
        "readOnlyHint": True,
        "openWorldHint": False,
    }
    assert offered["lookup"]["warnings"] == [] and offered["erase"]["served_as"] == "erase"
    everything = {t["name"]: (t["served_as"], t["class"]) for t in inventory["all"]["tools"]}
    everything.pop("added_later", None)  # offered once the test above upgraded it
    assert everything == {
        "lookup": ("all__lookup", "safe-retry"),
        "erase": ("all__erase", "key-required"),
        "note": ("all__note", "key-required"),
        "tally": ("careful_tally", "key-required"),
    }
    assert "warning: upstream h: " + WARNING in " ".join(as_text.split())


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_risky_class_is_warned_once_however_many_upstreams_connect_after(tmp_path: Path) -> None:
    policy, gate = tmp_path / "policy.toml", tmp_path / "late.installed"
    policy.write_text(
        SERVER.format(ledger=tmp_path / "ledger.db")
        + upstream(tmp_path, "h")
        + tool("note", "safe-retry")  # warned: its server does not declare it read-only
        + upstream(tmp_path, "late", HINTED_GATE=gate)  # connects only once the test says so
        + tool("tally", "key-required", upstream="late")
    )
    log = tmp_path / "stderr.log"
    warned = f"tools.note: {WARNING}"
    async with serve(policy, log) as client:
        await eventually(lambda: warned in log.read_text())  # h connected and its tools were built
        gate.touch()
        await upstream_listed(client, "tally")  # late connected: every tool was built again
        again = await call(client, "note", {"text": "hi"})
    assert not again.is_error, text(again)
    assert log.read_text().count(warned) == 1


# --- an upstream slow to start ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_slow_upstream_delays_neither_initialize_nor_a_call_made_meanwhile(tmp_path: Path) -> None:
    policy, gate = tmp_path / "policy.toml", tmp_path / "slow.installed"
    policy.write_text(
        SERVER.format(ledger=tmp_path / "ledger.db")
        + upstream(tmp_path, "slow", 'tools = "all"\ndefault_class = "key-required"', HINTED_GATE=gate)
        + tool("note", "key-required", upstream="slow")
        + upstream(tmp_path, "stuck", HINTED_SLOW="600")  # never answers within the call's timeout
        + tool("stuck_note", "key-required", STUCK, upstream="stuck")
    )
    ready = tmp_path / "slow.pid.ready"
    note = {"text": "early", "idempotency_key": "early-1"}
    results: list[Any] = []
    stuck_results: list[Any] = []
    async with serve(policy, tmp_path / "stderr.log") as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        assert not ready.exists()  # initialize and tools/list were answered while it still installs
        # the policy alone; the rest of a `tools = "all"` upstream comes when it connects
        assert set(listed["note"].input_schema["properties"]) == KEY | {"confirm_duplicate"}
        assert "lookup" not in listed
        async with anyio.create_task_group() as calls:
            calls.start_soon(_record, results, call(client, "note", note))
            stuck_note = {"text": "never", "idempotency_key": "stuck-1"}  # meanwhile: its timeout runs out
            calls.start_soon(_record, stuck_results, call(client, "stuck_note", stuck_note))
            await anyio.sleep(0.5)
            assert not results and not ready.exists()  # the call waits for the connection...
            gate.touch()  # ...and runs once the install ends
        first = results[0]
        assert ready.exists()
        again = await call(client, "note", note)
        tools = await upstream_listed(client, "lookup")
        (stuck,) = stuck_results
        pidfile = tmp_path / "stuck.pid"  # written as it starts, which may be after its call ran out
        sleeper = int(await eventually(lambda: pidfile.exists() and pidfile.read_text().strip()))
    with contextlib.suppress(ProcessLookupError):  # a client that stops the server at once may orphan it
        os.kill(sleeper, signal.SIGKILL)
    assert keyed(tools, "lookup")  # default_class wins over its read-only annotation
    # still connecting after the tool's timeout: a retryable failure, nothing sent
    assert operation(stuck)["state"] == "FAILED_RETRYABLE" and "not connected" in text(stuck)
    assert effects(tmp_path, "stuck") == []
    assert not first.is_error, text(first)
    assert operation(first)["attempts"] == 1 and operation(again)["replayed"] is True
    assert effects(tmp_path, "slow") == [{"tool": "note", "text": "early"}]


async def _record(results: list[Any], result: Any) -> None:
    results.append(await result)


# --- a server of the 1.x SDK --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.anyio
async def test_an_older_sdk_upstream_is_reached_without_validation_errors(tmp_path: Path) -> None:
    if not SDK1_PYTHON.exists():
        reason = f"{SDK1_PYTHON} is missing: build it with `make .venv-sdk1/.installed`"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    policy = tmp_path / "policy.toml"
    server = TESTS_DIR / "sdk1" / "ping_server.py"
    policy.write_text(
        SERVER.format(ledger=tmp_path / "ledger.db")
        + f'\n[upstreams.old]\ncommand = "{SDK1_PYTHON}"\nargs = ["{server}"]\n'
        + tool("ping", "safe-retry", upstream="old")
    )
    # `policy init` lists its tools the same way (side by side with the server below); what the
    # old server says goes to a file of ours
    logged = tmp_path / "sdk1.err"
    config = tmp_path / "claude_desktop_config.json"
    started = f"exec {SDK1_PYTHON} {server} 2>>{logged}"
    config.write_text(json.dumps({"mcpServers": {"old": {"command": "sh", "args": ["-c", started]}}}))
    init = [str(CONSOLE_SCRIPT), "policy", "init", "--from-config", str(config)]
    initialising = subprocess.Popen(init, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        async with serve(policy, tmp_path / "stderr.log") as client:
            pong = await call(client, "ping")
    finally:
        _, init_said = initialising.communicate(timeout=90)
    assert not pong.is_error and "pong" in text(pong), text(pong)
    said = (tmp_path / "stderr.log").read_text()  # the upstream's stderr is the server's
    assert "validation error" not in said.lower() and "server/discover" not in said
    assert initialising.returncode == 0, init_said
    assert "ListToolsRequest" in logged.read_text() and "validation error" not in logged.read_text()


# --- what the policy accepts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "said"),
    [
        ('default_class = "key-required"', '`default_class` is only used with `tools = "all"`'),
        ('tools = "all"\ndefault_class = "compensable"', "compensable needs a status_check or compensate"),
        ('tools = "some"', "upstreams.u.tools"),
        ('connect_timeout = "0s"', "upstreams.u.connect_timeout"),
    ],
)
def test_upstream_keys_are_checked_with_a_clear_reason(written: str, said: str) -> None:
    with pytest.raises(PolicyError) as caught:
        loads_policy(f'[upstreams.u]\ncommand = "x"\n{written}\n')
    assert said in str(caught.value)


def test_upstream_defaults_keep_hand_written_policies_as_they_were() -> None:
    spec = loads_policy('[upstreams.u]\ncommand = "x"\n').upstreams["u"]
    assert (spec.tools, spec.default_class, spec.connect_timeout) == ("listed", None, 60.0)
