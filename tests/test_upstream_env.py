"""The environment a stdio upstream gets: the MCP SDK's safe defaults, its `env`, and `inherit_env`.

A real `commitgate serve`, started with a proxy setting, a CA bundle and a variable nobody asked for,
wraps one server (tests/support/env_server.py) three times, and each copy reports the environment it
was started with.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import certifi
import pytest
from mcp.client.stdio import get_default_environment
from support.wrapping import TESTS_DIR, call, serve, text

from commitgate.server.policy.loading import loads_policy
from commitgate.server.policy.problems import PolicyError

SERVER = TESTS_DIR / "support" / "env_server.py"
# serve itself reads SSL_CERT_FILE (its HTTP client does): a bundle that exists
SERVES = {"HTTPS_PROXY": "http://proxy.invalid:3128", "SSL_CERT_FILE": certifi.where(), "UNASKED": "secret"}
# What Python itself may add to its own environment when it starts (PEP 538's locale coercion).
PYTHON_OWN = {"LC_CTYPE"}


def policy(root: Path) -> Path:
    upstreams = {
        "plain": "",
        "chosen": 'inherit_env = ["HTTPS_PROXY", "SSL_CERT_FILE", "NOT_SET_ANYWHERE"]',
        "everything": 'inherit_env = "*"',
    }
    text = f'[ledger]\nurl = "sqlite:///{root / "ledger.db"}"\n'
    for name, inherit in upstreams.items():
        text += f"""
[upstreams.{name}]
command = "{sys.executable}"
args = ["{SERVER}"]
env = {{ OWN = "{name}", SSL_CERT_FILE = "/own/ca.pem" }}
{inherit}

[tools.{name}_environment]
upstream = "{name}"
upstream_tool = "environment"
class = "safe-retry"
"""
    path = root / "policy.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.anyio
async def test_an_upstream_gets_the_sdk_defaults_its_env_and_what_it_inherits(tmp_path: Path) -> None:
    seen: dict[str, dict[str, Any]] = {}
    async with serve(policy(tmp_path), tmp_path / "serve.log", env=SERVES) as client:
        for name in ("plain", "chosen", "everything"):
            result = await call(client, f"{name}_environment")
            assert not result.is_error, text(result)
            assert result.structured_content is not None
            seen[name] = dict(result.structured_content)
    defaults = set(get_default_environment())
    assert set(seen["plain"]) - PYTHON_OWN == defaults | {"OWN", "SSL_CERT_FILE"}
    assert seen["plain"]["OWN"] == "plain" and seen["plain"]["SSL_CERT_FILE"] == "/own/ca.pem"
    chosen = seen["chosen"]
    assert set(chosen) - PYTHON_OWN == defaults | {"OWN", "SSL_CERT_FILE", "HTTPS_PROXY"}
    assert chosen["HTTPS_PROXY"] == SERVES["HTTPS_PROXY"]
    assert chosen["SSL_CERT_FILE"] == "/own/ca.pem"  # its own `env` wins over what it inherits
    everything = seen["everything"]
    assert everything["UNASKED"] == "secret" and everything["HTTPS_PROXY"] == SERVES["HTTPS_PROXY"]
    assert everything["OWN"] == "everything"


def test_inherit_env_on_an_http_upstream_is_a_problem_said_where() -> None:
    text = '[upstreams.crm]\nurl = "http://127.0.0.1:9/mcp"\ninherit_env = ["HTTPS_PROXY"]\n'
    with pytest.raises(PolicyError) as raised:
        loads_policy(text)
    assert "upstreams.crm" in str(raised.value) and "inherit_env" in str(raised.value)
