"""The official MCP conformance suite (npm `@modelcontextprotocol/conformance`), run against a URL.

`run_suite(command, url, out)` runs every server scenario of `--suite all` and returns each check's
status keyed by `(scenario, check id)`. Only the
checks that pass or fail count; the suite's warnings and its informational records are kept apart.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .node import CONFORMANCE, require_npm_binary

SUITE_TIMEOUT = 240.0
EVERYTHING_SERVER = Path(__file__).resolve().parent / "everything_server.py"

Check = tuple[str, str]  # (scenario, check id)


def suite() -> list[str]:
    """The suite's command line (skips, or fails under CI, without npm)."""
    return require_npm_binary(CONFORMANCE, "conformance")


@dataclass
class SuiteRun:
    checks: dict[Check, str]  # SUCCESS or FAILURE
    warnings: list[Check]
    messages: dict[Check, str]  # why a check failed, as the suite says
    tool_results: list[dict[str, Any]]  # every tools/call result the suite recorded
    seconds: float

    def passed(self) -> set[Check]:
        return {check for check, status in self.checks.items() if status == "SUCCESS"}

    def failed(self) -> set[Check]:
        return {check for check, status in self.checks.items() if status == "FAILURE"}

    def summary(self) -> str:
        return f"{len(self.passed())} of {len(self.checks)} checks passed"


_RESULTS = re.compile(r"^server-(?P<scenario>.+)-\d{4}-\d\d-\d\dT[\d-]+Z$")


def run_suite(command: list[str], url: str, out: Path) -> SuiteRun:
    """`conformance server --suite all` against `url`: one Node process runs every scenario in turn
    (a process per scenario would cost more in Node's start than the scenarios take)."""
    started = time.monotonic()
    done = subprocess.run(
        [*command, "server", "--url", url, "--suite", "all", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT,
    )
    run = SuiteRun({}, [], {}, [], time.monotonic() - started)
    for result in sorted(out.glob("server-*/checks.json")):
        matched = _RESULTS.match(result.parent.name)
        assert matched, f"unexpected result folder {result.parent.name}"
        for check in json.loads(result.read_text()):
            key = (matched["scenario"], check["id"])
            details = check.get("details") or {}
            recorded = details.get("result") or (details.get("body") or {}).get("result")
            if isinstance(recorded, dict) and "content" in recorded:
                run.tool_results.append(recorded)
            if check["status"] in ("SUCCESS", "FAILURE"):
                # a check reported twice counts as failed if either report failed
                if run.checks.get(key) != "FAILURE":
                    run.checks[key] = check["status"]
                if check["status"] == "FAILURE":
                    run.messages[key] = str(check.get("errorMessage") or check.get("details"))[:300]
            elif check["status"] == "WARNING":
                run.warnings.append(key)
    assert run.checks, (
        f"the suite reported no checks (exit {done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}"
    )
    return run


@contextmanager
def everything_servers(*calls: Path | None) -> Iterator[list[str]]:
    """One everything-server over streamable HTTP per item of `calls`, started at once (their
    imports overlap); yields their URLs. With a path, that server writes one line there per tool
    call it receives."""
    procs = []
    try:
        for path in calls:
            env = {"EVERYTHING_CALLS": str(path)} if path else {}
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(EVERYTHING_SERVER)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    env={**os.environ, **env},
                )
            )
        urls = []
        for proc in procs:
            assert proc.stdout is not None
            url = proc.stdout.readline().strip()
            assert url.startswith("http://"), f"the everything-server did not start (exit {proc.poll()})"
            urls.append(url)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
