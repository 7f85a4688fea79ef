"""`commitgate verify` end to end: the real command, a real server, effects counted in the system of record.

A correct tool passes; each deliberately broken one fails the test that catches it (exit 1); input
verify cannot work with is refused with a one-line reason (exit 2) before any effect.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tools_e2e.verify_tools import API_DB_ENV

from commitgate.server.demo import tools as demo
from commitgate.server.demo.payments_api import SandboxProcess

TESTS_DIR = Path(__file__).resolve().parent
CONSOLE_SCRIPT = Path(sys.executable).parent / "commitgate"
CHARGE = json.dumps({"card": "4242424242424242", "amount_cents": 500})


def demo_policy(path: Path, cls: str = "key-and-status-check", status_check: str | None = None) -> Path:
    status = status_check or "commitgate.server.demo.tools:find_charge"
    status_line = f'status_check = "{status}"\n' if cls == "key-and-status-check" else ""
    path.write_text(
        '[server]\nname = "verify-test"\n\n'
        "[tools.charge_card]\n"
        f'class = "{cls}"\n'
        'python = "commitgate.server.demo.tools:charge_card"\n'
        f"{status_line}"
        'retry = { attempts = 3, initial = "10ms", max = "50ms" }\n',
        encoding="utf-8",
    )
    return path


def http_policy(path: Path, url: str) -> Path:
    schema = (
        '{ type = "object", properties = { card = { type = "string" }, amount_cents = { type = "integer", '
        'minimum = 1 } }, required = ["card", "amount_cents"] }'
    )
    path.write_text(
        '[server]\nname = "verify-http"\n\n'
        "[tools.create_charge]\n"
        'class = "key-and-status-check"\n'
        "forwards_key = true\n"
        'retry = { attempts = 3, initial = "50ms", max = "200ms" }\n'
        f"input_schema = {schema}\n"
        f'http = {{ method = "POST", url = "{url}/v1/charges", body = "json", timeout = "5s" }}\n'
        f'status_check = {{ http = {{ method = "GET", url = "{url}/v1/charges?idempotency_key={{idempotency_key}}" }} }}\n',
        encoding="utf-8",
    )
    return path


def verify(cwd: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    """Run `commitgate verify ... --json` as a user would; (exit code, report, stderr)."""
    environment = {**os.environ, "PYTHONPATH": str(TESTS_DIR), **(env or {})}
    done = subprocess.run(
        [str(CONSOLE_SCRIPT), "verify", *args, "--json"],
        cwd=cwd,
        env=environment,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout), done.stderr


def verdicts(report: dict[str, Any]) -> dict[str, str]:
    return {check["name"]: check["verdict"] for check in report["checks"]}


def charges_by_key() -> Counter[str]:
    return Counter(row["idempotency_key"] for row in demo.rows("charges"))


@pytest.fixture(scope="module")
def api_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxProcess]:
    with SandboxProcess(tmp_path_factory.mktemp("api") / "api.db") as process:
        yield process


@dataclass
class Api:
    """The sandbox payments API as one test sees it: its settings its own, only its charges counted."""

    process: SandboxProcess
    earlier: set[str]  # the ids of charges made before this test

    def charges_per_key(self) -> list[int]:
        mine = [row for row in self.process.rows("charges") if row["id"] not in self.earlier]
        return sorted(Counter(row["idempotency_key"] for row in mine).values())


def api_for(process: SandboxProcess, **settings: Any) -> Api:
    process.configure(**settings)  # every setting not given back to its default
    return Api(process, {row["id"] for row in process.rows("charges")})


# --- correct tools pass ----------------------------------------------------------------------------


def test_a_correct_python_tool_passes_counted_by_its_status_check(tmp_path: Path, sandbox: Path) -> None:
    code, report, stderr = verify(
        tmp_path, "charge_card", "--policy", str(demo_policy(tmp_path / "p.toml")), "--arguments", CHARGE
    )
    assert code == 0, report
    assert report["counted_by"] == "status check"
    assert "real" in stderr  # it said it performs real effects
    assert verdicts(report) == {
        "lost answer after success": "pass",
        "failure before the call": "pass",
        "8 concurrent duplicates": "pass",
        "status check finds the tool's effect": "pass",
        "status check: not found for a new key": "pass",
    }
    assert sorted(charges_by_key().values()) == [1, 1, 1]  # one charge per test, in the system of record


def test_a_count_function_counts_effects_in_the_system_of_record(tmp_path: Path, sandbox: Path) -> None:
    policy = demo_policy(tmp_path / "p.toml", cls="key-required")
    code, report, _ = verify(
        tmp_path,
        "charge_card",
        "--policy",
        str(policy),
        "--arguments",
        CHARGE,
        "--count",
        "tools_e2e.verify_tools:demo_charges",
        "--concurrency",
        "4",
    )
    assert code == 0, report
    assert report["counted_by"] == "count function"
    assert [check["effects"] for check in report["checks"]] == [1, 1, 1]
    assert sorted(charges_by_key().values()) == [1, 1, 1]


def test_the_payments_api_passes_with_its_forwards_key_claim(
    tmp_path: Path, api_process: SandboxProcess
) -> None:
    api = api_for(api_process)
    policy = http_policy(tmp_path / "p.toml", api_process.url)
    code, report, _ = verify(
        tmp_path,
        "create_charge",
        "--policy",
        str(policy),
        "--arguments",
        CHARGE,
        "--count",
        "tools_e2e.verify_tools:api_charges",
        env={API_DB_ENV: str(api_process.db)},
    )
    assert code == 0, report
    assert verdicts(report)["forwards_key: the downstream dedups"] == "pass"
    assert api.charges_per_key() == [1, 1, 1, 1]


@pytest.mark.parametrize(
    "served",
    [
        '\n[tools.record]\nclass = "key-required"\nupstream = "stub"\n',
        'tools = "all"\n',  # no entry: served with the class its annotations give (key-required)
    ],
    ids=["entry", "tools-all"],
)
def test_an_upstream_mcp_tool_passes(tmp_path: Path, served: str) -> None:
    log = tmp_path / "stub.jsonl"
    log.touch()
    server = TESTS_DIR / "support" / "upstream_server.py"
    policy = tmp_path / "p.toml"
    policy.write_text(
        f'[upstreams.stub]\ncommand = "{sys.executable}"\nargs = ["{server}"]\nenv = {{ STUB_LOG = "{log}" }}\n'
        + served,
        encoding="utf-8",
    )
    code, report, _ = verify(
        tmp_path,
        "record",
        "--policy",
        str(policy),
        "--arguments",
        '{"note": "hello"}',
        "--count",
        "tools_e2e.verify_tools:stub_records",
        "--concurrency",
        "4",
        env={"STUB_LOG": str(log)},
    )
    assert code == 0, report
    steps = Counter(json.loads(line)["step"] for line in log.read_text().splitlines())
    assert sorted(steps.values()) == [1, 1, 1]


# --- broken tools fail -----------------------------------------------------------------------------


def test_a_write_tool_declared_safe_retry_fails_on_a_lost_answer(tmp_path: Path, sandbox: Path) -> None:
    policy = demo_policy(tmp_path / "p.toml", cls="safe-retry")
    code, report, _ = verify(tmp_path, "charge_card", "--policy", str(policy), "--arguments", CHARGE)
    assert code == 1, report
    assert report["counted_by"] == "invocations"
    checks = {check["name"]: check for check in report["checks"]}
    assert checks["lost answer after success"]["verdict"] == "fail"
    assert checks["lost answer after success"]["invocations"] == 2
    assert checks["8 concurrent duplicates"]["verdict"] == "fail"
    # In the system of record: 2 for the lost answer, 1 for the failure before, 8 for the duplicates.
    assert demo.count("charges") == 11


@pytest.mark.parametrize(
    ("status_check", "failing"),
    [
        ("tools_e2e.verify_tools:find_nothing", "status check finds the tool's effect"),
        ("tools_e2e.verify_tools:find_anything", "status check: not found for a new key"),
    ],
)
def test_a_status_check_that_lies_fails_its_claim(
    tmp_path: Path, sandbox: Path, status_check: str, failing: str
) -> None:
    policy = demo_policy(tmp_path / "p.toml", status_check=status_check)
    code, report, _ = verify(
        tmp_path,
        "charge_card",
        "--policy",
        str(policy),
        "--arguments",
        CHARGE,
        "--count",
        "tools_e2e.verify_tools:demo_charges",
        "--concurrency",
        "3",
    )
    assert code == 1, report
    failed = [name for name, verdict in verdicts(report).items() if verdict == "fail"]
    assert failed == [failing]
    assert sorted(charges_by_key().values()) == [1, 1, 1]


def test_a_forwards_key_claim_the_downstream_does_not_honour_fails(
    tmp_path: Path, api_process: SandboxProcess
) -> None:
    api = api_for(api_process, idempotency=False)
    policy = http_policy(tmp_path / "p.toml", api_process.url)
    code, report, _ = verify(
        tmp_path,
        "create_charge",
        "--policy",
        str(policy),
        "--arguments",
        CHARGE,
        "--count",
        "tools_e2e.verify_tools:api_charges",
        "--concurrency",
        "3",
        env={API_DB_ENV: str(api_process.db)},
    )
    per_key = api.charges_per_key()
    assert code == 1, report
    failed = [check for check in report["checks"] if check["verdict"] == "fail"]
    assert [check["name"] for check in failed] == ["forwards_key: the downstream dedups"]
    assert failed[0]["effects"] == 2
    assert per_key == [1, 1, 1, 2]  # the gateway kept the three tests to one charge each


# --- input verify cannot work with -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["refund_everything", "--arguments", CHARGE], "no tool 'refund_everything'"),
        (
            ["charge_card", "--arguments", '{"card": "4242", "amount_cents": "lots"}'],
            "do not match charge_card",
        ),
        (["charge_card", "--arguments", "{card"], "--arguments is not JSON"),
        (
            ["charge_card", "--arguments", CHARGE, "--count", "no_such_module:count"],
            "cannot import no_such_module",
        ),
        (
            ["charge_card", "--arguments", CHARGE, "--count", "tools_e2e.verify_tools:not_a_number"],
            "not a number",
        ),
    ],
)
def test_bad_input_is_refused_before_any_effect(
    tmp_path: Path, sandbox: Path, args: list[str], reason: str
) -> None:
    code, report, stderr = verify(tmp_path, "--policy", str(demo_policy(tmp_path / "p.toml")), *args)
    assert code == 2
    assert report["verdict"] == "could_not_run" and reason in report["reason"], report
    assert stderr.strip().splitlines() == [f"commitgate verify: could not run: {report['reason']}"]
    assert demo.count("charges") == 0


def test_a_target_that_is_down_is_could_not_run(tmp_path: Path) -> None:
    with socket.socket() as bound:  # a port of ours that never listens: every connection is refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}"
        policy = http_policy(tmp_path / "p.toml", url)
        code, report, _ = verify(tmp_path, "create_charge", "--policy", str(policy), "--arguments", CHARGE)
    assert code == 2, report
    assert report["reason"].startswith("the first call failed, so nothing could be tested"), report


def test_the_table_names_each_check_and_the_overall_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    from commitgate.server.verify.command import _print_report
    from commitgate.server.verify.effects import CountedBy, Evidence
    from commitgate.server.verify.run import Check, Report

    report = Report("charge", "safe-retry", "p.toml", CountedBy.INVOCATIONS, "invocations only")
    report.checks.append(
        Check("lost answer after success", "test", False, "ran again", Evidence(None, None, 2))
    )
    report.checks.append(Check("failure before the call", "test", True, "retried", Evidence(None, None, 1)))
    _print_report(report)
    out = capsys.readouterr().out
    assert "lost answer after success" in out and "FAIL" in out and "pass" in out
    assert "not ready: a test failed" in out


def test_at_a_terminal_it_asks_before_any_effect(
    tmp_path: Path, sandbox: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from commitgate.server.cli.main import build_parser

    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda: "n")
    args = build_parser().parse_args(["verify", "charge_card", "--arguments", CHARGE])
    assert args.func(args) == 2
    out, err = capsys.readouterr()
    assert out == ""  # the question goes to stderr: stdout is the report's
    assert "for real" in err and "Proceed? [y/N]" in err and "could not run: not confirmed; pass --yes" in err
    assert demo.count("charges") == 0


def test_a_policy_with_problems_is_could_not_run(tmp_path: Path, sandbox: Path) -> None:
    policy = tmp_path / "p.toml"
    policy.write_text(
        '[tools.charge_card]\nclass = "sometimes"\npython = "commitgate.server.demo.tools:charge_card"\n'
    )
    code, report, _ = verify(tmp_path, "charge_card", "--policy", str(policy), "--arguments", CHARGE)
    assert code == 2
    assert report["reason"].startswith("the policy has problems (tools.charge_card.class"), report
