"""Bearer tokens → principals: loading `[[auth.tokens]]`, constant-time matching, and the bind rule."""

from __future__ import annotations

import hashlib
import hmac
import subprocess
import sys
from pathlib import Path

import pytest

from commitgate.server.policy import tokens
from commitgate.server.policy.models import AuthPolicy, AuthToken
from commitgate.server.serve.auth import AuthConfigError, PolicyTokenVerifier, load_tokens
from commitgate.server.serve.checking import check_policy_file
from commitgate.server.serve.http import ServeRefused, check_bind, is_loopback, security_settings

ALICE = "alice-secret-token-0123456789"
BOB = "bob-secret-token-9876543210"


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def principal_of(table: tokens.TokenTable, token: str) -> str | None:
    holder = table.holder_of(token)
    return None if holder is None else holder.principal


def policy(*tokens: AuthToken) -> AuthPolicy:
    return AuthPolicy(tokens=list(tokens))


ALICE_ENV = AuthToken(principal="alice", token_env="T_ALICE")
BOB_HASH = AuthToken(principal="bob", token_sha256=sha(BOB))


def test_tokens_from_env_and_from_digest_map_to_their_principals() -> None:
    table = load_tokens(policy(ALICE_ENV, BOB_HASH), {"T_ALICE": ALICE})
    assert principal_of(table, ALICE) == "alice"
    assert principal_of(table, BOB) == "bob"
    assert principal_of(table, "alice-secret-token-012345678") is None  # a prefix is not the token
    assert principal_of(table, "") is None


def test_no_auth_section_means_no_tokens() -> None:
    assert not load_tokens(None, {})
    assert not load_tokens(policy(), {})


def test_every_problem_is_reported_with_its_location() -> None:
    clash = AuthToken(principal="carol", token_sha256=sha(BOB))
    short = AuthToken(principal="dave", token_env="T_SHORT")
    with pytest.raises(AuthConfigError) as caught:
        load_tokens(policy(ALICE_ENV, BOB_HASH, clash, short), {"T_SHORT": "tiny"})
    problems = caught.value.problems
    assert problems[0] == "auth.tokens[0].token_env: environment variable T_ALICE is not set or empty"
    assert problems[1].startswith("auth.tokens[2]: the same token is also given to agent 'bob'")
    assert problems[2].startswith("auth.tokens[3].token_env: the token in T_SHORT is shorter than 16")
    assert len(problems) == 3
    assert "tiny" not in str(caught.value)  # the message never quotes a secret


def test_one_principal_may_hold_several_tokens_for_rotation() -> None:
    old = AuthToken(principal="alice", token_sha256=sha("alice-old-token-000000"))
    table = load_tokens(policy(ALICE_ENV, old), {"T_ALICE": ALICE})
    assert principal_of(table, ALICE) == principal_of(table, "alice-old-token-000000") == "alice"


def test_matching_compares_digests_with_every_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    table = load_tokens(policy(ALICE_ENV, BOB_HASH), {"T_ALICE": ALICE})
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tokens.hmac, "compare_digest", spy)
    assert principal_of(table, ALICE) == "alice"  # the first entry matches ...
    assert len(compared) == 2  # ... and the second is compared anyway: no early exit
    assert all(len(a) == len(b) == 32 for a, b in compared)  # SHA-256 digests, never raw tokens


@pytest.mark.anyio
async def test_the_verifier_gives_the_principal_as_client_id_and_never_keeps_the_secret() -> None:
    verifier = PolicyTokenVerifier(lambda: policy(ALICE_ENV), {"T_ALICE": ALICE})
    token = await verifier.verify_token(ALICE)
    assert token is not None
    assert token.client_id == token.subject == "alice"
    assert ALICE not in token.model_dump_json()
    assert await verifier.verify_token(BOB) is None


@pytest.mark.anyio
async def test_the_verifier_follows_a_reloaded_policy_and_keeps_the_old_tokens_on_a_bad_one() -> None:
    current = {"auth": policy(ALICE_ENV)}
    verifier = PolicyTokenVerifier(lambda: current["auth"], {"T_ALICE": ALICE})
    current["auth"] = policy(BOB_HASH)
    assert await verifier.verify_token(ALICE) is None
    assert (await verifier.verify_token(BOB)) is not None
    current["auth"] = policy(AuthToken(principal="eve", token_env="T_UNSET"))
    token = await verifier.verify_token(BOB)
    assert token is not None and token.client_id == "bob"


def test_a_verifier_whose_tokens_cannot_load_is_refused_at_start() -> None:
    with pytest.raises(AuthConfigError, match="T_ALICE"):
        PolicyTokenVerifier(lambda: policy(ALICE_ENV), {})


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)
    check_bind(host, authenticated=False)  # allowed without auth


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "10.0.0.1", "example.com", ""])
def test_public_binds_need_authentication(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ServeRefused, match=r"without authentication.*\[\[auth\.tokens\]\]"):
        check_bind(host, authenticated=False)
    check_bind(host, authenticated=True)


def test_loopback_binds_check_the_host_header_public_ones_only_when_told() -> None:
    loopback = security_settings("127.0.0.1")
    assert loopback.enable_dns_rebinding_protection
    assert "127.0.0.1:*" in loopback.allowed_hosts and "http://localhost:*" in loopback.allowed_origins
    assert not security_settings("0.0.0.0").enable_dns_rebinding_protection
    named = security_settings("0.0.0.0", ["mcp.example.com"])
    assert named.enable_dns_rebinding_protection
    assert named.allowed_hosts == ["mcp.example.com"]
    assert "https://mcp.example.com" in named.allowed_origins


def test_policy_check_keeps_operators_apart_from_agents(tmp_path: Path) -> None:
    digest = sha(ALICE)
    text = f"""
[[auth.tokens]]
principal = "alice"
token_sha256 = "{sha(BOB)}"

[[auth.tokens]]
principal = "alice"
role = "operator"
principals = ["alice", "mallory", "*"]
token_sha256 = "{digest}"

[[auth.tokens]]
principal = "carol"
principals = ["alice"]
token_env = "T_CAROL"
"""
    path = tmp_path / "policy.toml"
    path.write_text(text)
    said = [str(p) for p in check_policy_file(path)]
    assert said == [
        "auth.tokens[1].principal: 'alice' is also an agent's principal; an operator's name must differ from"
        " every agent principal, so that a decision never names the agent it was about (line 7)",
        "auth.tokens[1].principals: 'mallory' is no agent's principal (agents: alice, carol); name agent principals"
        ' or "*" for every principal (line 9)',
        'auth.tokens[2]: `principals` is for operator tokens only (add role = "operator") (line 12)',
    ]
    done = subprocess.run(
        [sys.executable, "-m", "commitgate.server.cli", "policy", "check", str(path)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and "'mallory' is no agent's principal" in done.stdout


def test_tokens_without_a_role_are_agents() -> None:
    table = load_tokens(policy(ALICE_ENV), {"T_ALICE": ALICE})
    holder = table.holder_of(ALICE)
    assert holder is not None and holder.role == "agent" and not table.has("operator")


def test_one_digest_in_two_cases_is_one_token_for_policy_check_and_serve(tmp_path: Path) -> None:
    """Hex digits name the same digest in either case: `policy check` says so, as `serve` does."""
    path = tmp_path / "policy.toml"
    path.write_text(
        f'[[auth.tokens]]\nprincipal = "alice"\ntoken_sha256 = "{sha(ALICE).upper()}"\n\n'
        f'[[auth.tokens]]\nprincipal = "ops"\nrole = "operator"\ntoken_sha256 = "{sha(ALICE)}"\n'
    )
    said = "auth.tokens[1]: the same token is also given to agent 'alice' (line 5)"
    cli = [sys.executable, "-m", "commitgate.server.cli"]
    checked = subprocess.run([*cli, "policy", "check", str(path)], capture_output=True, text=True)
    assert (checked.returncode, said in checked.stdout) == (1, True), checked.stdout
    served = subprocess.run(
        [*cli, "serve", "--transport", "streamable-http", "--port", "0", "--policy", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert served.returncode != 0 and said in served.stderr, served.stderr
    assert "Traceback" not in served.stderr
