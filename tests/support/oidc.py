"""A real OpenID provider for the OAuth tests: the npm `oidc-provider` package, run by Node.

The package is installed with the tests' other npm packages into build/node22 (support/node.py) and
started by tests/support/oidc_provider.mjs, copied beside it. Without npm the tests skip with the
reason, except under CI (`CI=true`), where they fail: CI must run them (`.ci/run` installs npm).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2

from support.node import OIDC_PROVIDER, beside_packages, require_node

SCRIPT = Path(__file__).with_name("oidc_provider.mjs")
START_TIMEOUT = 30.0

AGENT_SCOPE, OPERATOR_SCOPE = "mcp", "commitgate:operator"
PRINCIPALS_CLAIM = "commitgate_principals"


def installed() -> tuple[str, Path]:
    """Node 22 and the provider script, copied beside the installed `oidc-provider`."""
    return require_node(OIDC_PROVIDER), beside_packages(SCRIPT)


@dataclass
class IdP:
    """A running provider: its issuer URL, and the test-only endpoints of the script."""

    issuer: str
    process: subprocess.Popen[str]

    def token(self, client: str, scope: str, resource: str) -> str:
        """An access token by the client-credentials grant (each client's secret is `ID-secret`)."""
        answer = httpx2.post(
            f"{self.issuer}/token",
            data={"grant_type": "client_credentials", "scope": scope, "resource": resource},
            auth=(client, f"{client}-secret"),
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        return str(answer.json()["access_token"])

    def sign(self, claims: dict[str, Any], alg: str = "RS256") -> str:
        """Claims signed with the provider's own current key (for tokens only the clock makes wrong)."""
        return str(self._admin("sign", {"claims": claims, "alg": alg})["token"])

    def rotate(self, mode: str = "roll") -> list[str]:
        return list(self._admin("rotate", {"mode": mode})["kids"])

    def allow_redirects(self, *uris: str) -> None:
        self._admin("clients", {"redirect_uris": list(uris)})

    def claims(self, **extra: Any) -> dict[str, Any]:
        now = int(time.time())
        return {"iss": self.issuer, "sub": "agent-alice", "iat": now, "exp": now + 300, **extra}

    def _admin(self, what: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = httpx2.post(f"{self.issuer}/__test/{what}", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())


@contextmanager
def running_idp() -> Iterator[IdP]:
    executable, script = installed()
    process = subprocess.Popen(
        [executable, script.name],
        cwd=script.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OIDC_PORT": "0"},
    )
    try:
        yield IdP(_issuer(process), process)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _issuer(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if selector.select(timeout=0.2):
            line = process.stdout.readline()
            if line.startswith("{"):
                return str(json.loads(line)["issuer"])
        if process.poll() is not None:
            break
    err = process.stderr.read() if process.stderr is not None and process.poll() is not None else ""
    raise AssertionError(f"the OpenID provider did not start within {START_TIMEOUT}s: {err[-2000:]}")
