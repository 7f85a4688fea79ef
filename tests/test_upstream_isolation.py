"""One broken upstream breaks only itself: a missing secret, a missing command, a refused URL, a crash
loop.

A real `commitgate serve` wraps five upstreams: our stub (tests/support/upstream_server.py), healthy;
the stub again, with a `${VARIABLE}` in its env that is not set; a command that does not exist; a URL
nothing listens on; and a process that exits as soon as it starts. The healthy upstream's keyed call takes effect exactly once
(counted in the stub's own log); each broken one's call answers a retryable failure that names the
upstream and why, with no effect anywhere; `policy check` and `ops list` work without the secret.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.wrapping import CONSOLE_SCRIPT, TESTS_DIR, base_env, call, error_code, operation, serve, text

MISSING = "COMMITGATE_TEST_UNSET_TOKEN"
STUB = TESTS_DIR / "support" / "upstream_server.py"
FAST = 'retry = { attempts = 2, initial = "1ms", max = "10ms" }\ntimeout = "5s"'
SCHEMA = 'input_schema = { type = "object", properties = { note = { type = "string" } } }'


def closed_port() -> int:
    """A loopback port nothing listens on (a connection to it is refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def policy(root: Path) -> Path:
    crash = f"echo started >> {root / 'crash-starts.log'}; exit 3"
    text = f"""
[server]
respond_within = "20s"

[ledger]
url = "sqlite:///{root / "ledger.db"}"

[upstreams.healthy]
command = "{sys.executable}"
args = ["{STUB}"]
env = {{ STUB_LOG = "{root / "healthy.jsonl"}" }}

[upstreams.secretive]
command = "{sys.executable}"
args = ["{STUB}"]
env = {{ STUB_LOG = "{root / "secretive.jsonl"}", STUB_TOKEN = "${{{MISSING}}}" }}

[upstreams.absent]
command = "{root / "no-such-command"}"

[upstreams.refused]
url = "http://127.0.0.1:{closed_port()}/mcp"

[upstreams.crashing]
command = "sh"
args = ["-c", "{crash}"]

[tools.record]
upstream = "healthy"
class = "key-required"
{FAST}

[tools.secret_record]
upstream = "secretive"
upstream_tool = "record"
class = "key-required"
{FAST}
{SCHEMA}

[tools.absent_record]
upstream = "absent"
upstream_tool = "record"
class = "key-required"
{FAST}
{SCHEMA}

[tools.refused_record]
upstream = "refused"
upstream_tool = "record"
class = "key-required"
{FAST}
{SCHEMA}

[tools.crash_record]
upstream = "crashing"
upstream_tool = "record"
class = "key-required"
{FAST}
{SCHEMA}
"""
    path = root / "policy.toml"
    path.write_text(text, encoding="utf-8")
    return path


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.anyio
async def test_each_broken_upstream_fails_alone_and_names_itself(tmp_path: Path) -> None:
    path, stderr = policy(tmp_path), tmp_path / "serve.log"
    async with serve(path, stderr) as client:
        listed = {tool.name for tool in (await client.list_tools()).tools}
        assert {"record", "secret_record", "absent_record", "refused_record", "crash_record"} <= listed
        first = await call(client, "record", {"note": "n", "idempotency_key": "healthy-1"})
        again = await call(client, "record", {"note": "n", "idempotency_key": "healthy-1"})
        assert not first.is_error and not again.is_error, (text(first), text(again))
        assert operation(again)["replayed"] is True
        broken = {
            tool: await call(client, tool, {"note": "n", "idempotency_key": f"{tool}-1"})
            for tool in ("secret_record", "absent_record", "refused_record", "crash_record")
        }
    assert len(lines(tmp_path / "healthy.jsonl")) == 1  # the healthy upstream's effect, exactly once
    reasons = {
        "secret_record": ("secretive", f"environment variable {MISSING} is not set"),
        "absent_record": ("absent", "no-such-command"),
        "refused_record": ("refused", "onnect"),
        "crash_record": ("crashing", "its process exited before answering"),
    }
    for tool, (upstream, reason) in reasons.items():
        result = broken[tool]
        assert error_code(result) == "retries_exhausted", text(result)
        message = result.structured_content["error"]["message"]
        assert f"upstream {upstream!r}" in message and reason in message, message
        assert "not sent" in message, message
    assert lines(tmp_path / "secretive.jsonl") == []  # nothing was sent: no effect anywhere
    recorded = subprocess.run(
        [str(CONSOLE_SCRIPT), "ops", "list", "--policy", str(path), "--json"],
        env=base_env(),  # without the secret, as every command but serve may run
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert recorded.returncode == 0, recorded.stderr
    tools = sorted(op["tool"] for op in json.loads(recorded.stdout)["operations"])
    assert tools == sorted(["record", "secret_record", "absent_record", "refused_record", "crash_record"])
    log = stderr.read_text()
    assert "Traceback" not in log
    warned = [json.loads(line) for line in log.splitlines() if MISSING in line]
    assert warned and all(entry["level"] == "warning" for entry in warned), warned


def test_policy_check_warns_and_ops_works_without_the_secret(tmp_path: Path) -> None:
    path = policy(tmp_path)
    check = subprocess.run(
        [str(CONSOLE_SCRIPT), "policy", "check", str(path)],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"warning: upstreams.secretive: environment variable {MISSING} is not set" in check.stdout
    listed = subprocess.run(
        [str(CONSOLE_SCRIPT), "ops", "list", "--policy", str(path), "--json"],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    # no ledger yet: the answer is about the ledger, never about the upstream's secret
    assert MISSING not in listed.stderr, listed.stderr
    assert "no ledger at" in listed.stderr and "Traceback" not in listed.stderr
