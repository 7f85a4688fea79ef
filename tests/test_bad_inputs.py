"""Every command on a corpus of bad inputs, as real processes: a one-line reason, no traceback, no hang.

Each case is something a user or their environment gets wrong: a tool that does not build, a
port in use or out of range, a malformed ledger URL, a hostile policy file, absurd durations and
limits, a store that is a directory, a metrics URL that is an event stream. The answer is always
the same shape: exit non-zero, no Python traceback, and the last line of stderr says what is wrong.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

CONSOLE_SCRIPT = Path(sys.executable).parent / "commitgate"
TIMEOUT = 60

MODULES = {
    "goodmod.py": "def ok(x: int) -> dict:\n    return {'x': x}\n",
    "raisemod.py": "raise ValueError('boom at import')\n",
    "syntaxmod.py": "def f(:\n",
    "exitmod.py": "import sys\nsys.exit(3)\n",
    "ncmod.py": "notcallable = 3\n",
}

# name -> (class, python reference, extra lines)
TOOLS = {
    "module_missing": ("key-required", "nosuchmod:f", "", "cannot import module 'nosuchmod'"),
    "attribute_missing": ("key-required", "goodmod:nope", "", "has no attribute 'nope'"),
    "import_raises": ("key-required", "raisemod:f", "", "raised ValueError: boom at import"),
    "syntax_error": ("key-required", "syntaxmod:f", "", "syntax error"),
    "sys_exit_at_import": ("key-required", "exitmod:f", "", "called sys.exit(3)"),
    "not_callable": ("key-required", "ncmod:notcallable", "", "is not callable"),
    "bad_reference": ("key-required", "goodmod", "", "is not of the form"),
    "status_check_missing": (
        "key-and-status-check",
        "goodmod:ok",
        'status_check = "nosuchmod:f"',
        "cannot import module 'nosuchmod'",
    ),
}


@dataclass(frozen=True)
class Case:
    name: str
    argv: list[str]
    reason: str  # a part of the last line of stderr
    env: tuple[tuple[str, str], ...] = ()


def write_corpus(tmp: Path) -> None:
    for name, (cls, ref, extra, _) in TOOLS.items():
        (tmp / f"{name}.toml").write_text(
            f'[ledger]\nurl = "sqlite:///{tmp}/{name}.db"\n[tools.t]\nclass = "{cls}"\npython = "{ref}"\n{extra}\n'
        )
    for file, text in MODULES.items():
        (tmp / file).write_text(text)
    (tmp / "demo.toml").write_text(
        f'[ledger]\nurl = "sqlite:///{tmp}/demo.db"\n'
        '[tools.charge_card]\nclass = "key-and-status-check"\npython = "commitgate.server.demo.tools:charge_card"\n'
        'status_check = "commitgate.server.demo.tools:find_charge"\n'
    )
    (tmp / "nested.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    good_tool = '[tools.t]\nclass = "key-required"\npython = "goodmod:ok"\n'
    ledger = f'[ledger]\nurl = "sqlite:///{tmp}/absurd.db"\n'
    (tmp / "retention.toml").write_text(f'[server]\nretention = "99999999999999999999d"\n{ledger}{good_tool}')
    (tmp / "bare_duration.toml").write_text(f"{ledger}{good_tool}timeout = 10\n")
    (tmp / "spaced_duration.toml").write_text(f'{ledger}{good_tool}timeout = "10 s"\n')
    (tmp / "list_limit.toml").write_text(
        f"[server.limits]\nlist_limit = 99999999999999999999\n{ledger}{good_tool}"
    )


def cases(tmp: Path, busy_port: int) -> list[Case]:
    found: list[Case] = []
    for name, (*_, reason) in TOOLS.items():
        policy = str(tmp / f"{name}.toml")
        found.append(Case(f"serve/{name}", ["serve", "--policy", policy], reason))
        found.append(
            Case(
                f"serve-http/{name}",
                ["serve", "--transport", "streamable-http", "--port", "0", "--policy", policy],
                reason,
            )
        )
        found.append(Case(f"policy-check/{name}", ["policy", "check", policy], reason))
    ledger = f"sqlite:///{tmp}/serve.db"
    for transport in ("streamable-http", "sse"):
        serve = ["serve", "--transport", transport, "--ledger", ledger]
        found += [
            Case(f"{transport}/port-in-use", [*serve, "--port", str(busy_port)], "in use"),
            Case(f"{transport}/port-99999", [*serve, "--port", "99999"], "not a port number"),
            Case(f"{transport}/port--1", [*serve, "--port=-1"], "not a port number"),
        ]
    for url, reason in (
        ("postgresql://u@localhost:abc/db", "not a port number"),
        ("postgresql://u@[::1/db", "malformed ledger URL"),
    ):
        found += [
            Case(f"serve/pg-url {url}", ["serve", "--ledger", url], reason),
            Case(f"ops-list/pg-url {url}", ["ops", "list", "--ledger", url], reason),
            Case(f"stats/pg-url {url}", ["stats", "--ledger", url], reason),
        ]
    found.append(
        Case(
            "ops-list/limit", ["ops", "list", "--ledger", ledger, "--limit", "99999999999999999999"], "range"
        )
    )
    nested = str(tmp / "nested.toml")
    found += [
        Case("policy-check/nested", ["policy", "check", nested], "nested too deeply"),
        Case("policy-show/nested", ["policy", "show", nested], "nested too deeply"),
        Case("serve/nested", ["serve", "--policy", nested], "nested too deeply"),
        Case("ops-list/nested", ["ops", "list", "--policy", nested], "nested too deeply"),
    ]
    for name, reason in (
        ("retention", "too long"),
        ("bare_duration", "rather than 10"),
        ("spaced_duration", "invalid duration '10 s'"),
        ("list_limit", "must be <= 10000"),
    ):
        policy = str(tmp / f"{name}.toml")
        found += [
            Case(f"policy-check/{name}", ["policy", "check", policy], reason),
            Case(f"serve/{name}", ["serve", "--policy", policy], reason),
        ]
    store = str(tmp / "sandbox.db")
    found += [
        Case("sandbox/port-in-use", ["sandbox", "--db", store, "--port", str(busy_port)], "in use"),
        Case("sandbox/port-99999", ["sandbox", "--db", store, "--port", "99999"], "not a port number"),
        Case("sandbox/db-directory", ["sandbox", "--db", str(tmp), "--port", "0"], "is a directory"),
        Case("sandbox/lose-response", ["sandbox", "--lose-response", "50"], "between 0 and 1"),
    ]
    for spec, reason in (
        ("charge_card.explode=1x", "unknown kind 'explode'"),
        ("charge_card.lose_ack=1", "a count like '1x'"),
    ):
        faults = (("COMMITGATE_SANDBOX_FAULTS", spec),)
        found += [
            Case(f"serve/faults {spec}", ["serve", "--ledger", ledger], reason, faults),
            Case(f"policy-check/faults {spec}", ["policy", "check", str(tmp / "demo.toml")], reason, faults),
        ]
    return found


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    tmp = tmp_path_factory.mktemp("bad-inputs")
    write_corpus(tmp)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        yield tmp, busy.getsockname()[1]
    finally:
        busy.close()


def environment(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMITGATE_")}
    env["COMMITGATE_SANDBOX"] = str(tmp / "demo-store.db")
    env["XDG_STATE_HOME"] = str(tmp / "state")
    return env


CASE_NAMES = [c.name for c in cases(Path("/corpus"), 1)]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_a_bad_input_gets_one_line_and_no_traceback(corpus: tuple[Path, int], name: str) -> None:
    tmp, busy_port = corpus
    case = next(c for c in cases(tmp, busy_port) if c.name == name)
    done = subprocess.run(
        [str(CONSOLE_SCRIPT), *case.argv],
        cwd=tmp,
        env={**environment(tmp), **dict(case.env)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    output = done.stdout + done.stderr
    assert "Traceback" not in output, output
    assert done.returncode != 0, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines, "no reason given"
    assert any(case.reason in line for line in lines[-3:]), output


def test_stats_metrics_pointed_at_an_event_stream_answers_at_once(tmp_path: Path) -> None:
    """`serve` prints the URL it serves on; `stats --metrics` given that SSE URL says so, never hangs."""
    env = environment(tmp_path)
    ledger = f"sqlite:///{tmp_path}/ledger.db"
    server = subprocess.Popen(
        [str(CONSOLE_SCRIPT), "serve", "--transport", "sse", "--port", "0", "--ledger", ledger],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,  # the URL, for a person; stderr stays JSON log lines
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        match = re.search(r"serving MCP \(sse\) at (http://127\.0\.0\.1:\d+/sse)$", line.strip())
        assert match, line
        done = subprocess.run(
            [str(CONSOLE_SCRIPT), "stats", "--ledger", ledger, "--metrics", match.group(1)],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    finally:
        server.terminate()
        server.wait(timeout=TIMEOUT)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "event stream" in done.stderr.strip().splitlines()[-1]


def test_a_module_that_exits_at_import_is_a_build_problem_not_an_exit(tmp_path: Path) -> None:
    """A reload that imports such a module must not end the running server."""
    from commitgate.tools.python import SourceLoadError, load_callable

    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(SourceLoadError, match=r"called sys\.exit\(0\)"):
            load_callable("exits_on_import:f")
    finally:
        sys.path.remove(str(tmp_path))
