"""The sandbox payments API on its own: idempotency, lookups, faults, auth (one process, real HTTP)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from commitgate.server.demo.payments_api import SandboxProcess

TOKEN = "sk_test_sandbox"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxProcess]:
    db = tmp_path_factory.mktemp("sandbox-api") / "store.db"
    with SandboxProcess(db, "--token-env", "SANDBOX_TOKEN", env={"SANDBOX_TOKEN": TOKEN}) as process:
        yield process


@pytest.fixture
def http(api: SandboxProcess) -> Iterator[httpx2.Client]:
    api.configure()
    with httpx2.Client(base_url=api.url, headers=AUTH, timeout=10.0) as client:
        yield client


def post(http: httpx2.Client, path: str, body: dict[str, Any], key: str | None) -> httpx2.Response:
    return http.post(path, json=body, headers={"Idempotency-Key": key} if key else {})


def test_same_key_same_body_replays_and_other_body_conflicts(
    http: httpx2.Client, api: SandboxProcess
) -> None:
    body = {"amount_cents": 500, "card": "4242424242424242"}
    first = post(http, "/v1/charges", body, "idem-1")
    again = post(http, "/v1/charges", body, "idem-1")
    other = post(http, "/v1/charges", {**body, "amount_cents": 501}, "idem-1")
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert other.status_code == 409 and other.json()["error"]["type"] == "idempotency_error"
    assert api.count("charges", idempotency_key="idem-1") == 1


def test_without_idempotency_every_post_acts(http: httpx2.Client, api: SandboxProcess) -> None:
    api.configure(idempotency=False)
    body = {"amount_cents": 500, "card": "4242424242424242"}
    assert post(http, "/v1/charges", body, "dup-1").status_code == 200
    assert post(http, "/v1/charges", body, "dup-1").status_code == 200
    assert api.count("charges", idempotency_key="dup-1") == 2


def test_lookups_by_key_and_id(http: httpx2.Client) -> None:
    charge = post(http, "/v1/charges", {"amount_cents": 800, "card": "4242"}, "look-1").json()
    refund = post(http, "/v1/refunds", {"charge": charge["id"], "amount_cents": 300}, "look-r1").json()
    assert http.get("/v1/charges", params={"idempotency_key": "look-1"}).json()["id"] == charge["id"]
    assert http.get(f"/v1/charges/{charge['id']}").json()["refunded_cents"] == 300
    assert http.get("/v1/refunds", params={"idempotency_key": "look-r1"}).json()["id"] == refund["id"]
    assert http.get("/v1/charges", params={"idempotency_key": "nobody"}).status_code == 404
    assert http.get("/v1/refunds", params={"idempotency_key": "nobody"}).status_code == 404
    assert http.get("/v1/charges/ch_missing").status_code == 404
    nested = post(http, f"/v1/charges/{charge['id']}/refunds", {"amount_cents": 100}, "look-r2")
    assert nested.status_code == 200 and nested.json()["charge"] == charge["id"]
    assert http.get(f"/v1/charges/{charge['id']}").json()["refunded_cents"] == 400


def test_business_rejections_are_remembered_but_malformed_requests_are_not(
    http: httpx2.Client, api: SandboxProcess
) -> None:
    declined = post(http, "/v1/charges", {"amount_cents": 100, "card": "4000000000000002"}, "rej-1")
    assert declined.status_code == 402 and declined.json()["error"]["code"] == "card_declined"
    assert post(http, "/v1/charges", {"amount_cents": 100, "card": "4000000000000002"}, "rej-1").headers.get(
        "Idempotent-Replayed"
    )
    charge = post(http, "/v1/charges", {"amount_cents": 100, "card": "4242"}, "rej-2").json()
    too_much = post(http, "/v1/refunds", {"charge": charge["id"], "amount_cents": 101}, "rej-3")
    assert too_much.status_code == 400 and "100 cents" in too_much.json()["error"]["message"]
    malformed = post(http, "/v1/charges", {"amount_cents": -1, "card": "4242"}, "rej-4")
    fixed = post(http, "/v1/charges", {"amount_cents": 1, "card": "4242"}, "rej-4")
    assert malformed.status_code == 400 and fixed.status_code == 200  # the key was not used up
    assert api.count("charges") >= 2 and api.count("refunds", idempotency_key="rej-3") == 0


def test_a_missing_or_wrong_token_is_refused(api: SandboxProcess) -> None:
    api.configure()
    body = {"amount_cents": 100, "card": "4242"}
    with httpx2.Client(base_url=api.url, timeout=10.0) as anonymous:
        assert anonymous.post("/v1/charges", json=body).status_code == 401
        assert (
            anonymous.post("/v1/charges", json=body, headers={"Authorization": "Bearer x"}).status_code == 401
        )


def test_faults_follow_their_budget(http: httpx2.Client, api: SandboxProcess) -> None:
    api.configure(fail_5xx=1.0, fault_budget=1)
    body = {"amount_cents": 100, "card": "4242"}
    assert post(http, "/v1/charges", body, "fault-1").status_code == 500  # nothing committed
    assert post(http, "/v1/charges", body, "fault-1").status_code == 200
    api.configure(rate_limit=1.0, retry_after=2.5, fault_budget=1)
    limited = post(http, "/v1/charges", body, "fault-2")
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "2.5"
    api.configure(lose_response=1.0, fault_budget=1)
    with pytest.raises(httpx2.RemoteProtocolError):
        post(http, "/v1/charges", body, "fault-3")
    assert api.count("charges", idempotency_key="fault-3") == 1  # committed, then the answer was lost
    assert post(http, "/v1/charges", body, "fault-3").headers["Idempotent-Replayed"] == "true"
    assert (
        api.count("charges", idempotency_key="fault-1") == 1
        and api.count("charges", idempotency_key="fault-2") == 0
    )
    faults = [
        r["fault"] for r in api.rows("requests") if r["idempotency_key"] in ("fault-1", "fault-2", "fault-3")
    ]
    assert faults == ["fail_5xx", None, "rate_limit", "lose_response", None]


def test_hang_mode_holds_the_answer_past_the_client_timeout(http: httpx2.Client, api: SandboxProcess) -> None:
    api.configure(lose_response=1.0, lose_mode="hang", hang=2.0, fault_budget=1)
    with pytest.raises(httpx2.ReadTimeout):
        http.post(
            "/v1/charges",
            json={"amount_cents": 100, "card": "4242"},
            headers={"Idempotency-Key": "hang-1"},
            timeout=0.3,
        )
    assert api.count("charges", idempotency_key="hang-1") == 1


def test_the_command_line_starts_it_with_faults(tmp_path: Path) -> None:
    with SandboxProcess(
        tmp_path / "cli.db", "--rate-limit", "1", "--retry-after", "4", "--no-idempotency"
    ) as api:
        settings = httpx2.get(f"{api.url}/_sandbox/config").json()
        assert (
            settings["rate_limit"] == 1.0
            and settings["retry_after"] == 4.0
            and settings["idempotency"] is False
        )
        answer = httpx2.post(f"{api.url}/v1/charges", json={"amount_cents": 1, "card": "4242"})
        assert answer.status_code == 429 and answer.headers["Retry-After"] == "4"
        assert api.count("charges") == 0
