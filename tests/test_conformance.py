"""The official MCP conformance suite, run against a server and against commitgate wrapping it.

The suite (npm `@modelcontextprotocol/conformance`, server mode, `--suite all`) was written by the
protocol's maintainers, not here. It runs against the project's everything-server
(tests/support/everything_server.py) directly, where every check must pass, and through a real
`commitgate serve` over streamable HTTP that wraps it as an upstream:

* every tool `safe-retry`: every check that passes directly passes through commitgate;
* every tool `key-required`, the suite's calls carrying no key: every tool call is refused with
  `idempotency_key_required` and none reaches the upstream (it counts the calls it receives).

The three runs go at once, each one Node process running the scenarios in turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from support.conformance import SuiteRun, everything_server, run_suite, suite
from support.everything_server import TOOLS
from support.http_servers import Served, running
from support.wrapping import error_code, upstream_listed

# A first run installs Node 22 and the suite from npm (a minute or more) before the suite runs.
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(400)]


def wrapping_policy(directory: Path, name: str, url: str, cls: str) -> Path:
    """A policy serving every tool of the everything-server at `url` with class `cls`."""
    tools = "".join(
        f'\n[tools.{tool}]\nupstream = "everything"\nclass = "{cls}"\ntimeout = "20s"\n' for tool in TOOLS
    )
    text = f'[server]\nname = "conformance-{cls}"\n\n[upstreams.everything]\nurl = "{url}"\n{tools}'
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


async def _connected(served: Served) -> None:
    """Wait until commitgate lists the upstream's own definitions (its upstream connected)."""
    async with Client(streamable_http_client(served.endpoint), mode="legacy") as client:
        await upstream_listed(client, "test_sampling")


class Runs:
    def __init__(
        self, direct: SuiteRun, safe: SuiteRun, keyed: SuiteRun, keyed_url: str, calls: Path
    ) -> None:
        self.direct, self.safe, self.keyed = direct, safe, keyed
        self.keyed_url, self.calls = keyed_url, calls

    def upstream_calls(self) -> list[str]:
        return self.calls.read_text().split() if self.calls.exists() else []


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    command = suite()
    root = tmp_path_factory.mktemp("conformance")
    calls = root / "keyed-upstream-calls.txt"
    with ExitStack() as stack:
        direct_url = stack.enter_context(everything_server())
        keyed_upstream = stack.enter_context(everything_server(calls))
        served = {}
        for cls, url in (("safe-retry", direct_url), ("key-required", keyed_upstream)):
            policy = wrapping_policy(root, f"{cls}.toml", url, cls)
            served[cls] = stack.enter_context(
                running(
                    root,
                    policy,
                    "streamable-http",
                    ledger=root / f"{cls}.db",
                    sandbox=root / f"{cls}-sandbox.db",
                )
            )
            anyio.run(_connected, served[cls])
        targets = {
            "direct": direct_url,
            "safe": served["safe-retry"].endpoint,
            "keyed": served["key-required"].endpoint,
        }
        with ThreadPoolExecutor(len(targets)) as pool:
            done = dict(
                zip(
                    targets,
                    pool.map(lambda item: run_suite(command, item[1], root / item[0]), targets.items()),
                    strict=True,
                )
            )
        summary = {k: (run.summary(), f"{run.seconds:.1f}s", len(run.warnings)) for k, run in done.items()}
        print(f"\nconformance: {json.dumps(summary)}")
        yield Runs(done["direct"], done["safe"], done["keyed"], targets["keyed"], calls)


# Checks that may still fail through commitgate, each with why; any other lost check fails the test.
# resources/subscribe: commitgate speaks 2026-07-28 to an HTTP upstream, an era without that method
# (a subscription there is a `subscriptions/listen` stream), and forwards a handshake-era client's
# subscribe as it is, so the upstream answers "method not found".
SUBSCRIBE = ("resources-subscribe", "resources-subscribe")
STILL_LOST = {SUBSCRIBE: "a subscribe is not yet carried over to the upstream's era"}


def _failures(run: SuiteRun, checks: set[tuple[str, str]]) -> str:
    return "\n".join(
        f"  {scenario} / {check}: {run.messages.get((scenario, check), 'not run')}"
        for scenario, check in sorted(checks)
    )


def test_every_check_passes_against_the_everything_server(runs: Runs) -> None:
    assert len(runs.direct.checks) >= 40, f"the suite ran too few checks: {runs.direct.summary()}"
    assert not runs.direct.failed(), (
        f"{runs.direct.summary()} directly; failed:\n{_failures(runs.direct, runs.direct.failed())}"
    )


def test_every_check_that_passes_directly_passes_through_commitgate(runs: Runs) -> None:
    lost = runs.direct.passed() - runs.safe.passed()
    said = f"through commitgate {runs.safe.summary()} (directly {runs.direct.summary()}); lost:\n{_failures(runs.safe, lost)}"
    assert not lost - STILL_LOST.keys(), said
    if lost:
        why = "; ".join(f"{check}: {STILL_LOST[(scenario, check)]}" for scenario, check in sorted(lost))
        pytest.xfail(f"{why} ({said})")


def _refused_without_key(result: dict[str, Any]) -> bool:
    error = (result.get("structuredContent") or {}).get("error") or {}
    return result.get("isError") is True and error.get("code") == "idempotency_key_required"


async def test_keyed_tools_refuse_the_suites_calls_and_nothing_reaches_the_upstream(runs: Runs) -> None:
    # Every tool call the suite made (and recorded) was refused, and the upstream received none.
    assert len(runs.keyed.tool_results) >= 5, runs.keyed.tool_results
    assert all(_refused_without_key(result) for result in runs.keyed.tool_results), runs.keyed.tool_results
    assert runs.upstream_calls() == [], "a call without a key reached the upstream"
    # The same for every tool, asked the way the suite asks: no key.
    async with Client(streamable_http_client(runs.keyed_url), mode="legacy") as client:
        for tool in TOOLS:
            result = await client.call_tool(tool, {})
            assert error_code(result) == "idempotency_key_required", (tool, result)
    assert runs.upstream_calls() == []
