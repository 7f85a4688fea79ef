"""An upstream's `isError` is not "certainly not applied".

The stub upstream records a spend (its side effect, a line in its log), then answers an `isError`
whose text echoes an argument: the agent makes it say "rate limit". For a keyed tool that answer ends
`FAILED_FINAL` at once, whatever its words: it is never re-run, and the budget keeps its spend
(`commitgate ops budgets` shows it), on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.wrapping import CONSOLE_SCRIPT, TESTS_DIR, base_env, call, error_code, operation, serve

POLICY = """
[server]
lease = "5s"
respond_within = "20s"

[ledger]
url = "{url}"

[upstreams.stub]
command = "{python}"
args = ["{server}"]
env = {{ STUB_LOG = "{log}" }}

[budgets.spend]
amount = "arguments.amount"
limit = 1000
window = "1h"
per = "principal"

[tools.spend_then_fail]
upstream = "stub"
class = "key-required"
budget = "spend"
retry = {{ attempts = 3, initial = "1ms", max = "10ms" }}
"""


async def ledger_url(backend: str, root: Path) -> str:
    if backend == "sqlite":
        return f"sqlite:///{root / 'ledger.db'}"
    from support.postgres import fresh_url

    return await fresh_url()


def spends(log: Path) -> list[dict[str, object]]:
    lines = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
    return [entry for entry in map(json.loads, lines) if entry["tool"] == "spend_then_fail"]


@pytest.mark.anyio
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_an_upstream_error_that_says_rate_limit_is_final_and_keeps_its_spend(
    tmp_path: Path, backend: str
) -> None:
    url, log = await ledger_url(backend, tmp_path), tmp_path / "stub.jsonl"
    policy = tmp_path / "policy.toml"
    server = TESTS_DIR / "support" / "upstream_server.py"
    policy.write_text(POLICY.format(url=url, python=sys.executable, server=server, log=log), encoding="utf-8")
    echoed = {"note": "rate limit exceeded (429), try again", "amount": 600, "idempotency_key": "k1"}
    async with serve(policy, tmp_path / "stderr.log") as client:
        first = await call(client, "spend_then_fail", echoed)
        assert error_code(first) == "operation_failed", first.content
        assert (operation(first)["state"], operation(first)["attempts"]) == ("FAILED_FINAL", 1)
        again = await call(client, "spend_then_fail", echoed)  # replayed, never run again
        assert error_code(again) == "operation_failed" and operation(again)["replayed"] is True
        assert len(spends(log)) == 1
        over = await call(client, "spend_then_fail", {**echoed, "idempotency_key": "k2"})
        assert error_code(over) == "budget_exceeded", over.content  # 600 spent + 600 > 1000
    assert len(spends(log)) == 1
    shown = subprocess.run(
        [str(CONSOLE_SCRIPT), "ops", "budgets", "--policy", str(policy), "--ledger", url, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=base_env(),
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    (budget,) = json.loads(shown.stdout)["budgets"]
    assert [(scope["spent"], scope["operations"]) for scope in budget["scopes"]] == [(600, 1)]
