"""The client on the MCP SDK's 1.x line: a LangGraph agent from a venv with only commitgate-client.

`.venv-sdk1` (built by the Makefile) holds commitgate-client installed from client/ as a wheel,
mcp<2 and langchain-mcp-adapters, which requires mcp<2: no server, none of its dependencies. From
it, tests/sdk1/langgraph_agent.py runs a scripted LangGraph agent against a server started from
this venv over stdio, and then `Gate` on the same session. Outside CI a missing venv skips these
tests with the command that builds it; under CI=true it fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.agents import AgentSandbox

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SDK1_PYTHON = ROOT / ".venv-sdk1" / "bin" / "python"
AGENT = ROOT / "tests" / "sdk1" / "langgraph_agent.py"
# Each start of a server process appends its pid: the runs must start exactly one each.
COUNT_STARTS = 'echo $$ >> "$0"; exec "$@"'


@pytest.fixture(scope="module")
def sdk1() -> Path:
    if not SDK1_PYTHON.exists():
        reason = f"{SDK1_PYTHON} is missing: build it with `make .venv-sdk1/.installed`"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return SDK1_PYTHON


def run_config(box: AgentSandbox, command: list[str], run_id: str | None, step: bool) -> dict[str, Any]:
    starts = str(box.root / "starts")
    return {
        "server": ["/bin/sh", "-c", COUNT_STARTS, starts, *command],
        "env": box.env,
        "run_id": run_id,
        "calls": 3,
        "step": step,
    }


@pytest.fixture(scope="module")
def runs(
    sdk1: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[AgentSandbox, dict[str, Any]]]:
    """Agent runs through a plain MCP server and through commitgate, side by side in one process."""
    root = tmp_path_factory.mktemp("sdk1")
    plain, guarded, stepped = (AgentSandbox.create(root / name) for name in ("plain", "guarded", "stepped"))
    configs = {
        "plain": (plain, plain.plain, None, False),
        "guarded": (guarded, guarded.commitgate, "run-1", False),
        "stepped": (stepped, stepped.commitgate, "run-1", True),
    }
    names = list(configs)
    sent = [run_config(box, command, run_id, step) for box, command, run_id, step in configs.values()]
    done = subprocess.run([str(sdk1), str(AGENT), json.dumps(sent)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: (configs[name][0], result) for name, result in zip(names, seen, strict=True)}


def test_the_venv_holds_the_client_alone_on_the_sdk_1_line(sdk1: Path) -> None:
    code = (
        "import importlib.metadata as m, importlib.util as u, json\n"
        "print(json.dumps({'mcp': m.version('mcp'), 'client': m.version('commitgate-client'),\n"
        "  'server': u.find_spec('commitgate.server') is not None,\n"
        "  'adapters': m.version('langchain-mcp-adapters')}))\n"
    )
    found = json.loads(
        subprocess.run([str(sdk1), "-c", code], capture_output=True, text=True, check=True).stdout
    )
    assert found["mcp"].startswith("1.") and not found["server"], found


def test_without_commitgate_the_re_issues_charge_three_times(runs: dict[str, Any]) -> None:
    box, seen = runs["plain"]
    assert seen["status"] == ["success"] * 3
    assert box.charges() == 3


def test_through_commitgate_one_charge_one_process_and_a_readable_refusal(runs: dict[str, Any]) -> None:
    box, seen = runs["guarded"]
    assert seen["mcp"].startswith("1.")
    assert len((box.root / "starts").read_text().split()) == 1  # one server process for the whole run
    assert seen["status"] == ["success", "error", "error"]  # refusals are results; the run went on
    charge = json.loads(seen["read"][0])
    for text in seen["read"][1:]:
        assert text.startswith("[possible_duplicate] Possible duplicate: nothing was executed now.")
        assert "in session 'run-1'" in text and charge["charge_id"] in text  # the run id came in _meta
        assert '{"error' not in text and '{\\"error' not in text
    # The agent's order once, and the Gate's own order (below) once.
    assert box.charges() == 2


def test_with_a_step_in_meta_the_re_issues_get_the_first_answer_back(runs: dict[str, Any]) -> None:
    box, seen = runs["stepped"]
    assert seen["status"] == ["success"] * 3
    first, *replays = seen["read"]
    for text in replays:  # the same charge, and commitgate's note that it was not run again
        assert text.startswith(first) and "this is the recorded outcome; nothing was executed again." in text
    assert box.charges() == 1


def test_gate_on_the_sdk_1_line_replays_a_step_and_names_a_duplicate(runs: dict[str, Any]) -> None:
    _, seen = runs["guarded"]
    gate = seen["gate"]
    assert gate["replayed"] == [False, True] and gate["same"] is True
    assert gate["duplicate_of"] == gate["operation_id"]


SHORT_SESSION = ROOT / "tests" / "sdk1" / "short_session.py"
STUB = ROOT / "tests" / "support" / "upstream_server.py"
NOISE = ("Traceback", "BrokenResourceError", "BrokenPipeError", "EPIPE")


def late_upstreams_policy(box: AgentSandbox, count: int = 4) -> Path:
    """The sandbox's policy plus `count` upstreams (our stub) that come up one after another while a
    short session runs and ends: each announces `tools/list_changed`, and each is still closing, or
    still starting, when the session's client has closed stdin."""
    policy = box.root / "policy.toml"
    text = policy.read_text(encoding="utf-8")
    for n in range(count):
        start = f"sleep {0.4 * n:.1f}; exec {sys.executable} {STUB}"
        text += (
            f'\n[upstreams.late{n}]\ncommand = "sh"\nargs = ["-c", "{start}"]\n'
            f'env = {{ STUB_LOG = "{box.root / f"late{n}.jsonl"}" }}\ntools = "all"\n'
            'default_class = "key-required"\n'
        )
    policy.write_text(text, encoding="utf-8")
    return policy


def test_short_langgraph_sessions_close_cleanly(sdk1: Path, tmp_path: Path) -> None:
    """Each run exits 0 with nothing but its answer: no BrokenResourceError from the 1.x SDK's reader
    at the close, no broken-pipe trace of an upstream cut off while the server stopped."""
    box = AgentSandbox.create(tmp_path / "short")
    late_upstreams_policy(box)
    runs = [
        subprocess.Popen(
            [str(sdk1), str(SHORT_SESSION), json.dumps(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for config in (
            {"server": box.commitgate, "env": box.env, "contained": True, "run_id": f"run-{n}"}
            for n in range(3)
        )
    ]
    for run in runs:
        out, err = run.communicate(timeout=300)
        noise = [line for line in err.splitlines() if any(word in line for word in NOISE)]
        assert run.returncode == 0 and not noise, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == ["success"]
    assert box.charges() == 3  # one per run: each had its own run id


FAREWELL = ROOT / "tests" / "sdk1" / "farewell_server.py"


@pytest.mark.parametrize("contained", [True, False], ids=["commitgate_session", "client.session"])
def test_a_message_at_the_close_fails_only_the_bare_session(
    sdk1: Path, tmp_path: Path, contained: bool
) -> None:
    """The 1.x SDK's own race, made certain by a server that logs as it exits: through
    `client.session` the run exits 1 with BrokenResourceError after its work was done; through
    `commitgate_session` it exits 0."""
    config = {"server": [str(sdk1), str(FAREWELL)], "env": {}, "contained": contained, "run_id": "run-1"}
    done = subprocess.run(
        [str(sdk1), str(SHORT_SESSION), json.dumps(config)], capture_output=True, text=True, timeout=300
    )
    if contained:
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1]) == ["success"]
    else:  # the SDK's race itself: if this ever passes, the SDK fixed it and the containment can go
        assert done.returncode == 1 and "BrokenResourceError" in done.stderr, done.stderr[-3000:]
