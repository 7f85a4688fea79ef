"""Notifications through real processes: a webhook receiver in the test checks every signature, sees the
same event id on retries, and gets an event that happened while it was down and the server was
SIGKILLed; Slack bodies; masked arguments; a hanging receiver never slows a call."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from support.e2e import Deployment, serve
from support.http_servers import free_port

from commitgate.server.ledger import open_ledger
from commitgate.server.ledger.evidence import Evidenced, OutboxItem
from commitgate.server.policy.loading import analyse_data, load_policy
from commitgate.server.serve.evidence import target
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.reload import PolicyReloader, ReloadStatus

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SECRET = "hook-secret-for-tests"
CARD = "4242424242424242"


def policy(port: int) -> str:
    return f"""
[server]
name = "commitgate-notify-test"
principal = "agent-1"

[tools.charge_card]
class = "key-required"
python = "commitgate.server.demo.tools:charge_card"
approval = {{ via = ["operator"], timeout = "1h", prompt = "Charge {{arguments.amount_cents}} cents?" }}

[console]
public_url = "https://console.example/"

[[notify]]
url = "http://127.0.0.1:{port}/json"
events = ["approval_waiting", "unknown"]
secret = "${{HOOK_SECRET}}"

[[notify]]
url = "http://127.0.0.1:{port}/slack"
events = ["approval_waiting"]
secret = "${{HOOK_SECRET}}"
format = "slack"
"""


class Receiver:
    """A webhook receiver: answers each path from a script of statuses (then 200); never answers on `hang`."""

    def __init__(
        self, port: int, script: dict[str, list[int]] | None = None, hang: str | None = None
    ) -> None:
        self.port, self.script, self.hang = port, script or {}, hang
        self.seen: list[tuple[str, dict[str, str], bytes]] = []
        self.lock = threading.Lock()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.lock:
                    receiver.seen.append((self.path, dict(self.headers.items()), body))
                    statuses = receiver.script.get(self.path, [])
                    status = statuses.pop(0) if statuses else 200
                if self.path == receiver.hang:
                    time.sleep(30)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    @contextmanager
    def running(self) -> Iterator[Receiver]:
        server = ThreadingHTTPServer(("127.0.0.1", self.port), self.handler())
        server.daemon_threads = True
        server.block_on_close = False  # a hanging handler must not hold the test up
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()

    def requests(self, path: str) -> list[tuple[dict[str, str], bytes]]:
        with self.lock:
            return [(headers, body) for p, headers, body in self.seen if p == path]


def signed(headers: dict[str, str], body: bytes) -> bool:
    stamp = headers["Commitgate-Timestamp"].encode()
    expected = "sha256=" + hmac.new(SECRET.encode(), stamp + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, headers["Commitgate-Signature"])


async def until(condition: Callable[[], bool | Awaitable[bool]], within: float = 30.0) -> None:
    with anyio.fail_after(within):
        while True:
            met = condition()
            if await met if isinstance(met, Awaitable) else met:
                return
            await anyio.sleep(0.05)


def deployment(root: Path, port: int) -> Deployment:
    d = Deployment.create(root)
    d.policy.write_text(policy(port), encoding="utf-8")
    return d


def env(root: Path) -> dict[str, str]:
    return {"HOOK_SECRET": SECRET, "XDG_STATE_HOME": str(root / "state")}


def notifications(root: Path, d: Deployment) -> list[dict[str, Any]]:
    run = subprocess.run(
        [sys.executable, "-m", "commitgate.server.cli", "ops", "notifications", "--json", "--policy", str(d.policy),
         "--ledger", f"sqlite:///{d.ledger}"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env(root)}, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return list(json.loads(run.stdout)["notifications"])


async def undelivered(d: Deployment) -> list[OutboxItem]:
    """What `ops notifications` lists, read in this process: cheap enough to poll, where each CLI run
    would start a Python process."""
    ledger = await open_ledger(f"sqlite:///{d.ledger}", read_only=True)
    try:
        return await cast(Evidenced, ledger).undelivered()
    finally:
        await ledger.close()


def charge(key: str, amount: int = 2500) -> dict[str, Any]:
    return {"card": CARD, "amount_cents": amount, "idempotency_key": key}


async def _none_left(d: Deployment) -> bool:
    return await undelivered(d) == []


async def _tried(d: Deployment) -> bool:
    return any(item.attempts >= 1 for item in await undelivered(d))


async def test_events_are_signed_retried_under_one_id_masked_and_shaped_for_slack(tmp_path: Path) -> None:
    port = free_port()
    d = deployment(tmp_path, port)
    with Receiver(port, {"/json": [500, 302]}).running() as receiver:
        async with serve(d, env=env(tmp_path)) as server:
            waiting = await server.call("charge_card", charge("big"), session="s")
            assert waiting.structured_content is not None
            op = waiting.structured_content["error"]["operation"]["operation_id"]
            await until(
                lambda: len(receiver.requests("/json")) >= 3 and len(receiver.requests("/slack")) >= 1
            )
            await until(lambda: _none_left(d))  # every delivery recorded as done
            assert notifications(tmp_path, d) == []
        tries = receiver.requests("/json")
        assert len(tries) == 3  # 500, then a redirect (not followed), then 200: each a retry of one event
        ids = {headers["Commitgate-Event-Id"] for headers, _ in tries}
        assert len(ids) == 1
        for headers, body in [*tries, *receiver.requests("/slack")]:
            assert headers["Content-Type"] == "application/json"
            assert signed(headers, body)
            assert CARD.encode() not in body  # the card number is masked as on every screen
        event = json.loads(tries[0][1])
        assert event["id"] == ids.pop() and event["event"] == "approval_waiting"
        assert event["operation"]["operation_id"] == op and event["operation"]["tool"] == "charge_card"
        assert event["operation"]["principal"] == "agent-1" and event["operation"]["session"] == "s"
        assert event["operation"]["arguments"]["card"] == "•••• 4242"
        assert event["operation"]["question"].startswith("Charge 2500 cents?")
        assert event["console_url"] == f"https://console.example/operations/{op}"
        (slack,) = receiver.requests("/slack")
        text = json.loads(slack[1])
        assert list(text) == ["text"]
        assert (
            "Charge 2500 cents?" in text["text"]
            and f"https://console.example/operations/{op}" in text["text"]
        )


async def test_an_event_from_while_the_receiver_was_down_arrives_after_a_sigkill(tmp_path: Path) -> None:
    port = free_port()
    d = deployment(tmp_path, port)
    async with serve(d, env=env(tmp_path)) as server:
        await server.call("charge_card", charge("while-down"), session="s")
        await until(lambda: _tried(d))
        server.kill9()
    pending = notifications(tmp_path, d)
    assert {n["status"] for n in pending} == {"pending"} and len(pending) == 2  # json and slack: kept
    with Receiver(port).running() as receiver:
        async with serve(d, env=env(tmp_path)):
            await until(  # each waits out the backoff its failed attempts earned, longer on a busy machine
                lambda: len(receiver.requests("/json")) >= 1 and len(receiver.requests("/slack")) >= 1,
                within=120.0,
            )
        headers, body = receiver.requests("/json")[0]
        assert signed(headers, body)
        wanted = {n["event_id"] for n in pending}
        assert headers["Commitgate-Event-Id"] in wanted
        assert json.loads(body)["id"] == headers["Commitgate-Event-Id"]


async def test_a_hanging_receiver_never_slows_a_call_nor_another_receiver_and_loses_nothing(
    tmp_path: Path,
) -> None:
    port = free_port()
    d = deployment(tmp_path, port)
    with Receiver(port, hang="/json").running() as receiver:
        async with serve(d, env=env(tmp_path)) as server:
            await server.call("charge_card", charge("first"), session="s")
            await until(lambda: len(receiver.requests("/json")) >= 1)  # its delivery now hangs
            for n in range(3):
                started = time.monotonic()
                answered = await server.call("charge_card", charge(f"next-{n}", 2501 + n), session="s")
                assert answered.structured_content is not None
                assert answered.structured_content["error"]["code"] == "approval_pending"
                assert time.monotonic() - started < 2.0
            # The other receiver hears of every event meanwhile, well before a hanging POST times out.
            await until(lambda: len(receiver.requests("/slack")) == 4, within=8.0)
    pending = notifications(tmp_path, d)
    assert len(pending) == 4 and {n["event"] for n in pending} == {"approval_waiting"}  # /json's: kept


def test_policy_check_refuses_a_literal_secret_and_an_unknown_event() -> None:
    report = analyse_data(
        {
            "notify": [
                {"url": "https://hooks.example/a", "events": ["approval_waiting"], "secret": "literal"},
                {"url": "https://hooks.example/b", "events": ["approved_soon"], "secret": "${HOME}"},
            ]
        }
    )
    problems = {str(p) for p in report.problems}
    assert any(p.startswith("notify[0].secret: write the secret as ${NAME}") for p in problems), problems
    assert any("notify[1].events" in p for p in problems), problems


async def test_a_notify_entry_added_by_a_reload_hears_the_next_changes(
    tmp_path: Path, sandbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOOK_SECRET", SECRET)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    path = tmp_path / "policy.toml"
    whole = policy(free_port()).replace(
        "[server]", f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n\n[server]'
    )
    path.write_text(whole.split("[[notify]]")[0], encoding="utf-8")
    gateway = await Gateway.open(load_policy(path), path)
    try:
        reloader = PolicyReloader(gateway, path, lambda: anyio.sleep(0), quiet=0.0)
        await reloader.prime()
        outbox = cast(Evidenced, gateway.ledger)
        await gateway.call_tool("charge_card", charge("before"), None, None)
        assert await outbox.undelivered() == []  # nobody listens yet
        path.write_text(whole, encoding="utf-8")
        result = await reloader.reload()
        if result.status is ReloadStatus.WAITING:
            result = await reloader.reload()
        assert result.status is ReloadStatus.APPLIED
        await gateway.call_tool("charge_card", charge("after", 2600), None, None)
        assert sorted(e.target for e in await outbox.undelivered()) == sorted(
            target(e) for e in gateway.policy.notify
        )
    finally:
        await gateway.close()
