"""Receipts through real processes: two `commitgate serve` writers and the CLI on one ledger, calls of
every outcome, then `commitgate ops verify` whole, and each kind of tampering named by it."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from support.e2e import Deployment, serve, together
from support.postgres import fresh_url

from commitgate.server.ledger.evidence import Signer
from commitgate.server.model.receipts import receipt_hash

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

POLICY = """
[server]
name = "commitgate-receipts-test"
principal = "agent-1"
lease = "2s"
respond_within = "10s"
in_progress_wait = "1s"

[ledger]
synchronous = "FULL"

[tools.send_email]
class = "key-required"
python = "commitgate.server.demo.tools:send_email"
retry = { attempts = 2, initial = "10ms", max = "50ms" }

[tools.create_ticket]
class = "key-required"
python = "commitgate.server.demo.tools:create_ticket"
retry = { attempts = 2, initial = "10ms", max = "50ms" }

[tools.charge_card]
class = "key-required"
python = "commitgate.server.demo.tools:charge_card"
approval = { via = ["operator"], timeout = "1h" }

[tools.reserve]
class = "compensable"
python = "commitgate.server.demo.tools:reserve"
compensate = { tool = "release", arguments = { booking_id = "{result.booking_id}" } }

[tools.release]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:release"
status_check = "commitgate.server.demo.tools:find_release"
expose = false
"""

# In the first writer, the first send_email loses its answer (UNKNOWN); the first create_ticket fails for good.
FAULTS = "send_email.lose_ack=1x,create_ticket.fail_permanent=1x"


def deployment(root: Path, extra: str = "") -> Deployment:
    d = Deployment.create(root)
    d.policy.write_text(POLICY + extra, encoding="utf-8")
    return d


def state_env(root: Path) -> dict[str, str]:
    """Where the servers and the CLI keep the receipts key: the test's own state directory."""
    return {"XDG_STATE_HOME": str(root / "state")}


def cli(root: Path, d: Deployment, ledger: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **state_env(root), "COMMITGATE_SANDBOX": str(d.sandbox)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "commitgate.server.cli",
            "ops",
            *args,
            "--policy",
            str(d.policy),
            "--ledger",
            ledger,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def error(result: Any) -> dict[str, Any]:
    assert result.is_error, result.content
    return dict(result.structured_content["error"])


def operation_id(result: Any) -> str:
    assert result.meta is not None
    return str(result.meta["commitgate/operation"]["operation_id"])


async def every_outcome(root: Path, d: Deployment, ledger: str) -> dict[str, str]:
    """Success, replay, failure, approval, resolution and compensation over two writers and the CLI."""
    email = {"to": "a@example.com", "subject": "hi", "body": "x"}
    env = state_env(root)
    async with together(
        serve(d, faults=FAULTS, env=env, ledger=ledger), serve(d, env=env, ledger=ledger)
    ) as (a, b):
        lost = {**email, "subject": "lost", "idempotency_key": "lost"}
        unknown = error(await a.call("send_email", lost, session="s"))
        assert unknown["code"] == "operation_outcome_unknown"
        ok = await b.call("send_email", {**email, "idempotency_key": "ok"}, session="s")
        assert not ok.is_error
        replay = await a.call("send_email", {**email, "idempotency_key": "ok"}, session="s")
        assert replay.meta is not None and replay.meta["commitgate/operation"]["replayed"] is True
        failed = error(await a.call("create_ticket", {"title": "t", "idempotency_key": "bad"}, session="s"))
        assert failed["code"] == "operation_failed"
        charge = {"card": "4242424242424242", "amount_cents": 5000, "idempotency_key": "pay"}
        waiting = error(await a.call("charge_card", charge, session="s"))
        assert waiting["code"] == "approval_pending"
        approved = cli(root, d, ledger, "approve", waiting["operation"]["operation_id"], "--by", "ann")
        assert approved.returncode == 0, approved.stderr
        assert not (await b.call("charge_card", charge, session="s")).is_error
        resolved = cli(
            root,
            d,
            ledger,
            "resolve",
            unknown["operation"]["operation_id"],
            "--failed",
            "--reason",
            "not sent",
        )
        assert resolved.returncode == 0, resolved.stderr
        booked = await b.call(
            "reserve", {"resource": "room", "customer": "c", "idempotency_key": "r1"}, session="s"
        )
        assert not booked.is_error
        undone = await a.call("compensate_session", {}, session="s")
        assert not undone.is_error, undone.content
        assert undone.structured_content is not None
        assert [c["state"] for c in undone.structured_content["compensations"]] == ["COMPENSATED"]
    # Each effect happened exactly once in the system of record.
    assert d.count("emails", idempotency_key="ok") == 1
    assert d.count("charges", idempotency_key="pay") == 1
    assert d.count("tickets", idempotency_key="bad") == 0
    return {"ok": operation_id(ok), "pay": waiting["operation"]["operation_id"]}


_KEYS: dict[tuple[Path, Path], str] = {}


def public_key(root: Path, d: Deployment, ledger: str) -> str:
    """What `ops receipts --public-key` prints. The key is the policy's and the state directory's, the
    same for every ledger, so a test asks the CLI once, not before each verify."""
    if (root, d.policy) not in _KEYS:
        shown = cli(root, d, ledger, "receipts", "--public-key")
        assert shown.returncode == 0, shown.stderr
        _KEYS[root, d.policy] = shown.stdout.strip()
    return _KEYS[root, d.policy]


def verify(root: Path, d: Deployment, ledger: str, *args: str) -> subprocess.CompletedProcess[str]:
    return cli(root, d, ledger, "verify", "--public-key", public_key(root, d, ledger), *args)


def whole(run: subprocess.CompletedProcess[str]) -> int:
    assert run.returncode == 0, run.stderr
    return int(run.stdout.split("ok: ")[1].split(" ")[0])


def sqlite_counts(path: Path) -> tuple[int, int, set[str]]:
    """(audit entries, receipts, writers) of a SQLite ledger."""
    with sqlite3.connect(path) as conn:
        audits = conn.execute("SELECT count(*) FROM audit").fetchone()[0]
        writers = {row[0] for row in conn.execute("SELECT DISTINCT writer_id FROM receipts")}
        receipts = conn.execute("SELECT count(*) FROM receipts").fetchone()[0]
    return audits, receipts, writers


async def test_every_outcome_on_sqlite_verifies_and_each_tampering_is_named(tmp_path: Path) -> None:
    d = deployment(tmp_path)
    url = f"sqlite:///{d.ledger}"
    ops = await every_outcome(tmp_path, d, url)
    audits, receipts, writers = sqlite_counts(d.ledger)
    assert receipts == audits  # one receipt per recorded change, none left out
    assert len(writers) >= 4  # two servers and two CLI runs, each its own chain
    assert whole(verify(tmp_path, d, url)) == receipts

    def tampered(name: str, *statements: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        copy = tmp_path / f"{name}.db"
        with sqlite3.connect(d.ledger) as source, sqlite3.connect(copy) as target:
            source.backup(target)
            for statement in statements:
                target.execute(statement)
        return f"sqlite:///{copy}", verify(tmp_path, d, f"sqlite:///{copy}")

    with sqlite3.connect(d.ledger) as conn:
        writer_id, writer, third_op = conn.execute(
            "SELECT r.writer_id, w.writer, r.operation_id FROM receipts r JOIN receipt_writers w ON w.id = r.writer_id"
            " WHERE r.seq = 3 ORDER BY w.writer LIMIT 1"
        ).fetchone()

    # An edited result, named by its operation.
    _, run = tampered(
        "result",
        f"UPDATE operations SET result = replace(result, '\":', '\": ') WHERE operation_id = '{ops['ok']}'",
    )
    assert run.returncode == 1 and f"operation {ops['ok']}" in run.stderr and "result" in run.stderr, (
        run.stderr
    )
    # A receipt deleted: the gap is named, with the operation of the receipt after it.
    _, run = tampered("deleted", f"DELETE FROM receipts WHERE writer_id = {writer_id} AND seq = 2")
    assert run.returncode == 1 and "receipt 2 of writer" in run.stderr and "removed" in run.stderr, run.stderr
    assert f"operation {third_op}" in run.stderr
    # Two receipts swapped in the chain.
    _, run = tampered(
        "swapped",
        f"UPDATE receipts SET seq = -2 WHERE writer_id = {writer_id} AND seq = 2",
        f"UPDATE receipts SET seq = 2 WHERE writer_id = {writer_id} AND seq = 3",
        f"UPDATE receipts SET seq = 3 WHERE writer_id = {writer_id} AND seq = -2",
    )
    assert run.returncode == 1 and f"receipt 2 of writer {writer}" in run.stderr, run.stderr
    assert f"operation {third_op}" in run.stderr

    # An export verifies offline; a line removed from it, or two swapped, is named.
    export = tmp_path / "receipts.jsonl"
    exported = cli(tmp_path, d, url, "export", "--receipts", str(export))
    assert exported.returncode == 0, exported.stderr
    lines = export.read_text(encoding="utf-8").splitlines()
    assert len(lines) == receipts
    assert whole(verify(tmp_path, d, url, "--from", str(export))) == receipts
    first = [i for i, line in enumerate(lines) if json.loads(line)["writer"] == writer]
    gone = tmp_path / "gone.jsonl"
    gone.write_text("\n".join(lines[: first[1]] + lines[first[1] + 1 :]) + "\n", encoding="utf-8")
    run = verify(tmp_path, d, url, "--from", str(gone))
    assert run.returncode == 1 and "receipt 2 of writer" in run.stderr and "removed" in run.stderr, run.stderr
    swapped = list(lines)
    swapped[first[1]], swapped[first[2]] = swapped[first[2]], swapped[first[1]]
    (tmp_path / "swapped.jsonl").write_text("\n".join(swapped) + "\n", encoding="utf-8")
    run = verify(tmp_path, d, url, "--from", str(tmp_path / "swapped.jsonl"))
    assert run.returncode == 1 and "receipt 3 of writer" in run.stderr, run.stderr

    # A receipt forged with another key is refused when the real key is given.
    forger = Signer.load(tmp_path / "forger.pem", create=True)
    fake = json.loads(lines[-1]) | {"writer": f"{forger.public_hex}.x", "seq": 1, "prev": "0" * 64}
    fake["hash"] = receipt_hash(fake)
    fake["sig"] = forger.sign(fake["hash"])
    (tmp_path / "forged.jsonl").write_text("\n".join([*lines, json.dumps(fake)]) + "\n", encoding="utf-8")
    run = verify(tmp_path, d, url, "--from", str(tmp_path / "forged.jsonl"))
    assert run.returncode == 1 and "not among the public keys" in run.stderr, run.stderr


@pytest.mark.postgres
async def test_every_outcome_on_postgresql_with_two_writers_verifies(tmp_path: Path) -> None:
    url = await fresh_url()
    d = deployment(tmp_path)
    ops = await every_outcome(tmp_path, d, url)
    conn = await asyncpg.connect(url)
    try:
        audits = await conn.fetchval("SELECT count(*) FROM commitgate_audit")
        receipts = await conn.fetchval("SELECT count(*) FROM commitgate_receipts")
        writers = await conn.fetchval(
            "SELECT count(DISTINCT split_part(writer, '-', 1)) FROM commitgate_receipts"
        )
        assert receipts == audits and writers >= 4
        assert whole(verify(tmp_path, d, url)) == receipts
        await conn.execute(
            "UPDATE commitgate_operations SET result = replace(result, '\":', '\": ') WHERE operation_id = $1",
            ops["pay"],
        )
    finally:
        await conn.close()
    run = verify(tmp_path, d, url)
    assert run.returncode == 1 and f"operation {ops['pay']}" in run.stderr, run.stderr


async def test_a_key_file_that_is_missing_stops_the_start(tmp_path: Path) -> None:
    d = deployment(tmp_path, f'\n[receipts]\nkey_file = "{tmp_path / "nowhere.pem"}"\n')
    started = subprocess.run(
        [
            sys.executable,
            "-m",
            "commitgate.server.cli",
            "serve",
            "--policy",
            str(d.policy),
            "--ledger",
            f"sqlite:///{d.ledger}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert started.returncode == 1
    assert "receipts key file" in started.stderr and "nowhere.pem" in started.stderr, started.stderr
    assert "Traceback" not in started.stderr
    assert not d.ledger.exists() or sqlite_counts(d.ledger)[1] == 0  # nothing was recorded unsigned


async def test_verify_on_a_ledger_without_receipts_says_so(tmp_path: Path) -> None:
    d = deployment(tmp_path, "\n[receipts]\nenabled = false\n")
    url = f"sqlite:///{d.ledger}"
    async with serve(d, env=state_env(tmp_path), ledger=url) as server:
        email = {"to": "a@example.com", "subject": "hi", "body": "x", "idempotency_key": "k"}
        assert not (await server.call("send_email", email, session="s")).is_error
    audits, receipts, _ = sqlite_counts(d.ledger)
    assert audits == 2 and receipts == 0
    run = verify(tmp_path, d, url)
    assert run.returncode == 1 and "holds no receipts" in run.stderr, run.stderr
