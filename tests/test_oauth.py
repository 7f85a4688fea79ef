"""`[auth.oauth]` end to end: a real OpenID provider (npm `oidc-provider`) issues the access tokens.

One provider and one `commitgate serve` over streamable HTTP for the module; effects are counted in
the demo sandbox by principal. Tokens the test signs itself appear only where the point is a token
the provider would never issue (`none`, another issuer's key, an expired one signed with the
provider's own key through its test endpoint).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from support.http_servers import TOOLS, Served, connect, error_code, free_port, running, token_entry
from support.oidc import AGENT_SCOPE, OPERATOR_SCOPE, PRINCIPALS_CLAIM, IdP, running_idp

from commitgate.server.demo import tools as demo
from commitgate.server.policy.oauth import OAuthPolicy
from commitgate.server.serve.auth import access_token
from commitgate.server.serve.checking import check_policy_file
from commitgate.server.serve.oauth import (
    KEYS_MAX_AGE,
    REFETCH_INTERVAL,
    Caller,
    OAuthVerifier,
    ProviderKeys,
    Refused,
)

pytestmark = pytest.mark.slow

MCP_ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
STATIC_TOKEN = "static-alice-token-4f1a9c2e7b"


@pytest.fixture(scope="module")
def idp() -> Iterator[IdP]:
    with running_idp() as provider:
        yield provider


@pytest.fixture(scope="module")
def served(idp: IdP, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("oauth")
    port = free_port()
    policy = root / "policy.toml"
    policy.write_text(
        f"""
[server]
name = "commitgate-oauth-test"
respond_within = "20s"

[ledger]
synchronous = "NORMAL"

{token_entry("static-alice", STATIC_TOKEN)}
[auth.oauth]
issuer = "{idp.issuer}"
resource = "http://127.0.0.1:{port}/mcp"
principal_claim = "client_id"
operator_principals_claim = "{PRINCIPALS_CLAIM}"
{TOOLS}
""",
        encoding="utf-8",
    )
    with running(
        root, policy, "streamable-http", ledger=root / "ledger.db", sandbox=root / "sandbox.db", port=port
    ) as s:
        yield s


@pytest.fixture
def sandbox(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(Path(served.stderr_path).parent / "sandbox.db"))


def resource(served: Served) -> str:
    return f"{served.base}/mcp"


def call(key: str) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "create_ticket", "arguments": {"title": "x", "idempotency_key": key}},
    }


def post(served: Served, token: str | None, key: str) -> httpx2.Response:
    headers = {**MCP_ACCEPT, **({"Authorization": f"Bearer {token}"} if token else {})}
    return httpx2.post(served.endpoint, json=call(key), headers=headers, timeout=30)


def wait_logged(served: Served, text: str) -> str:
    deadline = time.monotonic() + 20
    while text not in served.stderr():
        assert time.monotonic() < deadline, f"not logged: {text}\n{served.stderr()[-3000:]}"
        time.sleep(0.05)
    return served.stderr()


# --- telling a client where to get a token ----------------------------------------------------------


def test_metadata_and_the_401_header_lead_a_client_to_the_provider(idp: IdP, served: Served) -> None:
    refused = post(served, None, "k-" + uuid.uuid4().hex)
    assert refused.status_code == 401
    header = refused.headers["www-authenticate"]
    assert header.startswith('Bearer error="invalid_token"')
    pointer = f'resource_metadata="{served.base}/.well-known/oauth-protected-resource/mcp"'
    assert pointer in header
    for path in ("/.well-known/oauth-protected-resource/mcp", "/.well-known/oauth-protected-resource"):
        metadata = httpx2.get(served.base + path).json()
        assert metadata == {
            "resource": resource(served),
            "authorization_servers": [idp.issuer],
            "scopes_supported": [AGENT_SCOPE],
            "bearer_methods_supported": ["header"],
        }
    provider = httpx2.get(idp.issuer + "/.well-known/openid-configuration").json()
    assert provider["issuer"] == idp.issuer  # the advertised server is a real one a client can use


# --- an agent's token ---------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("client", ["agent-alice", "agent-es", "agent-ed"])  # RS256, ES256, EdDSA
async def test_an_agent_token_calls_a_keyed_tool_once_and_its_retry_replays(
    idp: IdP, served: Served, sandbox: None, client: str
) -> None:
    token = idp.token(client, AGENT_SCOPE, resource(served))
    key = "k-" + uuid.uuid4().hex
    async with connect(served, headers={"Authorization": f"Bearer {token}"}) as session:
        first = await session.call_tool("create_ticket", {"title": key, "idempotency_key": key})
        again = await session.call_tool("create_ticket", {"title": key, "idempotency_key": key})
    assert not first.is_error and not again.is_error
    assert (first.meta or {})["commitgate/operation"]["replayed"] is False
    assert (again.meta or {})["commitgate/operation"]["replayed"] is True
    assert demo.count("tickets", idempotency_key=key, principal=client) == 1  # the claim is the principal
    assert demo.count("tickets", idempotency_key=key) == 1


@pytest.mark.anyio
async def test_static_tokens_keep_working_beside_the_provider(served: Served, sandbox: None) -> None:
    key = "k-" + uuid.uuid4().hex
    async with connect(served, headers={"Authorization": f"Bearer {STATIC_TOKEN}"}) as session:
        made = await session.call_tool("create_ticket", {"title": "hello", "idempotency_key": key})
    assert error_code(made) is None
    assert demo.count("tickets", idempotency_key=key, principal="static-alice") == 1


# --- tokens that are refused ------------------------------------------------------------------------------


def other_issuers_token(idp: IdP, served: Served) -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    claims = idp.claims(iss="https://idp.attacker.example", aud=resource(served), scope=AGENT_SCOPE)
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": "rs256-1"})


def forged_with_a_known_kid(idp: IdP, served: Served) -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    claims = idp.claims(aud=resource(served), scope=AGENT_SCOPE)  # the right issuer, the wrong key
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": "rs256-1"})


REFUSED = {
    "wrong-audience": (
        lambda idp, s: idp.token("agent-alice", AGENT_SCOPE, "http://127.0.0.1:9/mcp"),
        "issued for another audience",
    ),
    "expired": (
        lambda idp, s: idp.sign(idp.claims(aud=resource(s), scope=AGENT_SCOPE, exp=int(time.time()) - 120)),
        "expired",
    ),
    "not-yet-valid": (
        lambda idp, s: idp.sign(idp.claims(aud=resource(s), scope=AGENT_SCOPE, nbf=int(time.time()) + 600)),
        "not valid yet",
    ),
    "other-issuer": (other_issuers_token, "bad signature"),
    "forged": (forged_with_a_known_kid, "bad signature"),
    "none": (
        lambda idp, s: jwt.encode(idp.claims(aud=resource(s), scope=AGENT_SCOPE), "", algorithm="none"),
        "signed with 'none'",
    ),
    "hs256": (lambda idp, s: idp.token("agent-hs", AGENT_SCOPE, resource(s)), "signed with 'HS256'"),
    "oversized": (
        lambda idp, s: idp.sign(idp.claims(aud=resource(s), scope=AGENT_SCOPE, pad="x" * 9000)),
        "token longer than",
    ),
    "malformed": (lambda idp, s: "bm90LWEtaGVhZGVy.bWFsZm9ybWVkLXBheWxvYWQ.c2lnbmF0dXJl", "not a JWT"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_token_the_server_must_not_trust_is_refused_with_no_effect(
    idp: IdP, served: Served, sandbox: None, case: str
) -> None:
    make, reason = REFUSED[case]
    token = make(idp, served)
    key = "k-" + uuid.uuid4().hex
    refused = post(served, token, key)
    assert refused.status_code == 401, refused.text
    assert "resource_metadata=" in refused.headers["www-authenticate"]
    logged = wait_logged(served, f"refused an access token: {reason}")
    assert token not in logged and token.split(".")[1] not in logged  # the token never reaches the log
    assert demo.count("tickets", idempotency_key=key) == 0
    assert httpx2.get(served.base + "/healthz").status_code == 200


def test_a_valid_token_without_the_agent_scope_gets_403_insufficient_scope(
    idp: IdP, served: Served, sandbox: None
) -> None:
    token = idp.token("plain-client", "profile:read", resource(served))
    key = "k-" + uuid.uuid4().hex
    refused = post(served, token, key)
    assert refused.status_code == 403
    header = refused.headers["www-authenticate"]
    assert 'error="insufficient_scope"' in header and f'scope="{AGENT_SCOPE}"' in header
    assert demo.count("tickets", idempotency_key=key) == 0


# --- operators ---------------------------------------------------------------------------------------------


def test_an_operator_token_reads_metrics_and_is_refused_on_mcp(
    idp: IdP, served: Served, sandbox: None
) -> None:
    operator = idp.token("ops-carol", OPERATOR_SCOPE, resource(served))
    agent = idp.token("agent-alice", AGENT_SCOPE, resource(served))
    key = "k-" + uuid.uuid4().hex
    refused = post(served, operator, key)
    assert refused.status_code == 403 and "operator's token" in refused.json()["error_description"]
    assert demo.count("tickets", idempotency_key=key) == 0
    metrics = httpx2.get(served.base + "/metrics", headers={"Authorization": f"Bearer {operator}"})
    assert metrics.status_code == 200 and "commitgate_" in metrics.text
    as_agent = httpx2.get(served.base + "/metrics", headers={"Authorization": f"Bearer {agent}"})
    assert as_agent.status_code == 403 and "agent's token" in as_agent.json()["error_description"]
    scopeless = idp.token("plain-client", "profile:read", resource(served))
    bare = httpx2.get(served.base + "/metrics", headers={"Authorization": f"Bearer {scopeless}"})
    assert bare.status_code == 403 and f'scope="{OPERATOR_SCOPE}"' in bare.headers["www-authenticate"]


# --- keys that change ---------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_key_rotation_at_the_provider_is_accepted_without_a_restart(
    idp: IdP, served: Served, sandbox: None
) -> None:
    before = idp.token("agent-bob", AGENT_SCOPE, resource(served))
    kids = idp.rotate("roll")  # the published next key signs from now on
    after = idp.token("agent-bob", AGENT_SCOPE, resource(served))
    assert jwt.get_unverified_header(after)["kid"] != jwt.get_unverified_header(before)["kid"]
    assert jwt.get_unverified_header(after)["kid"] in kids
    keys = ["k-" + uuid.uuid4().hex, "k-" + uuid.uuid4().hex]
    for token, key in zip((before, after), keys, strict=True):
        async with connect(served, headers={"Authorization": f"Bearer {token}"}) as session:
            made = await session.call_tool("create_ticket", {"title": key, "idempotency_key": key})
        assert error_code(made) is None
    assert [demo.count("tickets", idempotency_key=k, principal="agent-bob") for k in keys] == [1, 1]


# --- policy check ---------------------------------------------------------------------------------------------


def test_policy_check_says_what_is_wrong_with_auth_oauth(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(
        """
[auth.oauth]
issuer = "idp.example.com"
resource = "https://mcp.example.com/mcp"
agent_scope = ""
operator_scope = "ops scope"
jwks_url = "ftp://idp.example.com/jwks"
""",
        encoding="utf-8",
    )
    said = "\n".join(str(p) for p in check_policy_file(path))
    assert "auth.oauth.issuer: must be an http(s) URL such as https://idp.example.com/realms/team" in said
    assert "auth.oauth.agent_scope: a scope name must not be empty" in said
    assert "auth.oauth.operator_scope: 'ops scope' is not a scope name" in said
    assert "auth.oauth.jwks_url: must be an http(s) URL" in said
    path.write_text(
        '[auth.oauth]\nissuer = "https://idp.example.com"\nagent_scope = "x"\noperator_scope = "x"\n'
    )
    said = "\n".join(str(p) for p in check_policy_file(path))
    assert "agent_scope and operator_scope are both 'x'" in said


# --- the provider's keys, in process (a provider of their own: its keys change here) -------------------------

UNIT_AUDIENCE = "http://127.0.0.1:1/unit"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def unit_verifier(issuer: str, clock: Clock, **policy: Any) -> OAuthVerifier:
    oauth = OAuthPolicy(issuer=issuer, audience=UNIT_AUDIENCE, **policy)
    return OAuthVerifier(oauth, ProviderKeys(issuer, oauth.jwks_url, clock=clock))


@pytest.fixture(scope="module")
def spare() -> Iterator[IdP]:
    """A provider whose keys the tests replace (the server's provider keeps its own)."""
    with running_idp() as provider:
        yield provider


@pytest.mark.anyio
async def test_an_unknown_key_id_fetches_the_keys_again_at_most_once_a_minute(spare: IdP) -> None:
    clock = Clock()
    provider = spare
    verifier = unit_verifier(provider.issuer, clock)
    first = await verifier.verify(provider.token("agent-alice", AGENT_SCOPE, UNIT_AUDIENCE))
    assert first.principal == "agent-alice" and first.role == "agent" and verifier.keys.fetches == 1
    provider.rotate("replace")  # keys nobody has seen yet
    rotated = provider.token("agent-alice", AGENT_SCOPE, UNIT_AUDIENCE)
    junk = [forged(provider, kid=f"junk-{i}") for i in range(20)]
    clock.now += 10
    with pytest.raises(Refused, match="no key"):  # fetched 10 s ago: not again yet
        await verifier.verify(rotated)
    for token in junk:
        with pytest.raises(Refused):
            await verifier.verify(token)
    assert verifier.keys.fetches == 1  # junk key ids never flood the provider
    clock.now += REFETCH_INTERVAL
    caller = await verifier.verify(rotated)
    assert caller.principal == "agent-alice" and verifier.keys.fetches == 2


@pytest.mark.anyio
async def test_a_key_the_provider_withdrew_stops_being_trusted_once_the_set_is_old(spare: IdP) -> None:
    clock = Clock()
    verifier = unit_verifier(spare.issuer, clock)
    old = spare.token("agent-alice", AGENT_SCOPE, UNIT_AUDIENCE)
    await verifier.verify(old)
    spare.rotate("replace")  # the keys that signed `old` are no longer published
    clock.now += KEYS_MAX_AGE / 2
    await verifier.verify(old)  # the set is recent: no fetch
    assert verifier.keys.fetches == 1
    clock.now += KEYS_MAX_AGE
    assert (
        await verifier.verify(old)
    ).principal == "agent-alice"  # served at once, the set renewed beside it
    with anyio.fail_after(20):
        while verifier.keys.fetches < 2:
            await anyio.sleep(0.01)
    with pytest.raises(Refused, match="no key"):
        await verifier.verify(old)


@pytest.mark.anyio
async def test_concurrent_calls_with_a_new_key_share_one_fetch(spare: IdP) -> None:
    provider = spare
    verifier = unit_verifier(provider.issuer, Clock())
    token = provider.token("agent-es", AGENT_SCOPE, UNIT_AUDIENCE)
    callers: list[Any] = []

    async def one() -> None:
        callers.append(await verifier.verify(token))

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(one)
    assert len(callers) == 20 and verifier.keys.fetches == 1


@pytest.mark.anyio
async def test_a_provider_that_is_down_lets_nobody_in_and_raises_nothing_else(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    with running_idp() as provider:
        verifier = unit_verifier(provider.issuer, clock, operator_principals_claim=PRINCIPALS_CLAIM)
        known = provider.token("ops-carol", OPERATOR_SCOPE, UNIT_AUDIENCE)
        caller = await verifier.verify(known)
        assert caller.role == "operator" and caller.sees == frozenset({"alice"})
        unknown = forged(provider, kid="rs256-new")  # a key id the verifier has not seen
    # The provider is gone: a token whose key is known still checks out, any other is refused.
    assert (await verifier.verify(known)).principal == "ops-carol"
    clock.now += REFETCH_INTERVAL
    with caplog.at_level("WARNING", logger="commitgate.auth"), pytest.raises(Refused, match="no key"):
        await verifier.verify(unknown)
    assert "cannot fetch the issuer's keys" in caplog.text and "cannot reach" in caplog.text
    assert unknown not in caplog.text


@pytest.mark.anyio
async def test_a_provider_that_hangs_up_mid_answer_refuses_the_token_in_flight() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def hang_up() -> None:
            for _ in range(2):  # the two discovery documents
                conn, _ = listener.accept()
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{")
                conn.close()

        thread = threading.Thread(target=hang_up, daemon=True)
        thread.start()
        verifier = unit_verifier(f"http://127.0.0.1:{port}", Clock())
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        token = jwt.encode({"sub": "x"}, key, algorithm="RS256", headers={"kid": "k"})
        with pytest.raises(Refused, match="no key"):
            await verifier.verify(token)
        thread.join(10)


FORGER = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def forged(provider: IdP, kid: str) -> str:
    key = FORGER
    claims = provider.claims(aud=UNIT_AUDIENCE, scope=AGENT_SCOPE)
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": kid})


def test_the_identity_handed_on_never_holds_the_token() -> None:
    token = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJhIn0.c2lnbmF0dXJlLW9mLWEtdG9rZW4"
    issued = access_token(token, Caller("alice", "agent"))
    assert token not in issued.model_dump_json() and issued.client_id == "alice"


# --- starting up, and a provider that cannot be reached -------------------------------------------------------


def oauth_policy(root: Path, oauth: str) -> Path:
    policy = root / "policy.toml"
    policy.write_text(f'[ledger]\nsynchronous = "NORMAL"\n\n[auth.oauth]\n{oauth}\n{TOOLS}', encoding="utf-8")
    return policy


def test_a_public_bind_needs_the_resource_url(tmp_path: Path) -> None:
    policy = oauth_policy(tmp_path, 'issuer = "https://idp.example.com"')
    argv = [
        sys.executable, "-m", "commitgate.server.cli", "serve", "--transport", "streamable-http",
        "--host", "0.0.0.0", "--port", str(free_port()), "--policy", str(policy),
        "--ledger", f"sqlite:///{tmp_path / 'refused.db'}",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 1
    assert "[auth.oauth] needs `resource` to listen on '0.0.0.0'" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_provider_that_cannot_be_reached_lets_nobody_in_and_the_server_stays_up(
    idp: IdP, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    policy = oauth_policy(tmp_path, f'issuer = "{gone}"')
    sandbox = tmp_path / "sandbox.db"
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(sandbox))
    with running(tmp_path, policy, "streamable-http", ledger=tmp_path / "l.db", sandbox=sandbox) as server:
        metadata = httpx2.get(server.base + "/.well-known/oauth-protected-resource/mcp").json()
        assert metadata["resource"] == f"{server.base}/mcp"  # on loopback: the URL the request named
        token = forged_with_a_known_kid(idp, server)
        keys = ["k-" + uuid.uuid4().hex for _ in range(3)]
        answers = [post(server, token, key).status_code for key in keys]
        assert answers == [401, 401, 401]
        logged = wait_logged(server, "cannot fetch the issuer's keys: cannot discover the issuer's keys")
        assert token not in logged
        assert httpx2.get(server.base + "/healthz").status_code == 200
        assert [demo.count("tickets", idempotency_key=k) for k in keys] == [0, 0, 0]


@pytest.mark.anyio
async def test_the_sse_transport_takes_the_same_tokens(
    idp: IdP, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = oauth_policy(tmp_path, f'issuer = "{idp.issuer}"\nprincipal_claim = "client_id"')
    sandbox = tmp_path / "sandbox.db"
    monkeypatch.setenv("COMMITGATE_SANDBOX", str(sandbox))
    with running(tmp_path, policy, "sse", ledger=tmp_path / "l.db", sandbox=sandbox) as server:
        refused = httpx2.get(server.endpoint)
        assert refused.status_code == 401
        assert (
            f'resource_metadata="{server.base}/.well-known/oauth-protected-resource/sse"'
            in refused.headers["www-authenticate"]
        )
        token = idp.token("agent-alice", AGENT_SCOPE, f"{server.base}/sse")  # loopback: the URL named
        key = "k-" + uuid.uuid4().hex
        async with connect(server, headers={"Authorization": f"Bearer {token}"}) as session:
            made = await session.call_tool("create_ticket", {"title": key, "idempotency_key": key})
        assert error_code(made) is None
        assert demo.count("tickets", idempotency_key=key, principal="agent-alice") == 1
