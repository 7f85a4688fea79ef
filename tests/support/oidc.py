"""A real OpenID provider for the OAuth tests: the npm `oidc-provider` package, run by Node.

The package is installed once with npm into build/ (git-ignored, kept between runs) and started by
tests/support/oidc_provider.mjs, copied beside it. Without npm the tests skip with the reason,
except under CI (`CI=true`), where they fail: CI must run them (`.ci/run` installs nodejs and npm).
"""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest

from support.browser import in_ci

PACKAGE = "oidc-provider@9.13.3"
ROOT = Path(__file__).resolve().parents[2]
INSTALL_DIR = ROOT / "build" / PACKAGE.replace("@", "-")
SCRIPT = Path(__file__).with_name("oidc_provider.mjs")
MIN_NODE = (20, 19)
START_TIMEOUT = 30.0
INSTALL_TIMEOUT = 300.0

AGENT_SCOPE, OPERATOR_SCOPE = "mcp", "commitgate:operator"
PRINCIPALS_CLAIM = "commitgate_principals"


def require_node() -> None:
    """Skip (fail under CI) when Node or npm is missing, or Node is older than the package needs."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    problem = None
    if missing:
        problem = f"{' and '.join(missing)} not found: apt-get install nodejs npm (the OAuth tests run a real OpenID provider)"
    else:
        version = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
        numbers = tuple(int(n) for n in version.lstrip("v").split(".")[:2] if n.isdigit())
        if numbers < MIN_NODE:
            problem = f"{PACKAGE} needs Node >= {'.'.join(map(str, MIN_NODE))}, this is {version}"
    if problem is None:
        return
    if in_ci():
        pytest.fail(f"the OAuth tests must run under CI: {problem}")
    pytest.skip(problem)


def installed() -> Path:
    """The folder with `oidc-provider` installed and the provider script beside it (installed once)."""
    require_node()
    INSTALL_DIR.mkdir(parents=True, exist_ok=True)
    with open(INSTALL_DIR / ".lock", "w") as lock:  # several test workers may start at once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (INSTALL_DIR / "node_modules" / "oidc-provider" / "package.json").is_file():
            (INSTALL_DIR / "package.json").write_text('{"private": true, "type": "module"}\n')
            done = subprocess.run(
                ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", PACKAGE],
                cwd=INSTALL_DIR,
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT,
            )
            if done.returncode != 0:
                pytest.fail(f"npm install {PACKAGE} failed:\n{done.stderr[-3000:]}")
        shutil.copyfile(SCRIPT, INSTALL_DIR / SCRIPT.name)
    return INSTALL_DIR


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
    folder = installed()
    process = subprocess.Popen(
        ["node", SCRIPT.name],
        cwd=folder,
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
