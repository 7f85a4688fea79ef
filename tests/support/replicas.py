"""Helpers for the replica tests: several `commitgate serve` processes sharing one PostgreSQL ledger.

Each replica is the real CLI (`commitgate serve --transport streamable-http
--stateless`) on its own free 127.0.0.1 port; all share the ledger URL and the
demo tools' sandbox store. Servers, clients and the round-robin balancer come
from support.http_servers.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from support.http_servers import TOOLS, Served, auth_section, free_port, server_argv, server_env, wait_ready


def write_replica_policy(
    directory: Path,
    name: str,
    *,
    lease: str = "3s",
    auto_migrate: bool = True,
    ledger_url: str | None = None,
) -> Path:
    """A policy for replicas: room for many concurrent calls of one principal, the demo tools."""
    url = f'url = "{ledger_url}"\n' if ledger_url else ""
    text = f"""
[server]
name = "commitgate-replica-test"
lease = "{lease}"
respond_within = "20s"
in_progress_wait = "10s"

[server.limits]
max_concurrent_per_principal = 64

[ledger]
{url}auto_migrate = {"true" if auto_migrate else "false"}

{auth_section()}
{TOOLS}
"""
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def launch_replica(
    workdir: Path, policy: Path, ledger_url: str, sandbox: Path, env: dict[str, str] | None = None
) -> Served:
    """Start one replica without waiting for it (several starting at once race for the migrations)."""
    port = free_port()
    argv = server_argv(
        [
            "--transport", "streamable-http", "--stateless", "--host", "127.0.0.1", "--port", str(port),
            "--policy", str(policy), "--ledger", ledger_url, "--log-level", "info",
        ]
    )  # fmt: skip
    stderr_path = workdir / f"replica-{port}.stderr"
    stderr = stderr_path.open("wb")
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, env=server_env(sandbox, env)
    )
    return Served(proc, port, "streamable-http", stderr_path, _stderr=stderr)


@contextlib.contextmanager
def replicas(
    workdir: Path,
    policy: Path,
    ledger_url: str,
    sandbox: Path,
    count: int,
    env: dict[str, str] | None = None,
) -> Iterator[list[Served]]:
    """`count` replicas started at the same moment, yielded once all answer /healthz; all stopped after."""
    started: list[Served] = []
    try:
        for _ in range(count):
            started.append(launch_replica(workdir, policy, ledger_url, sandbox, env))
        for served in started:
            wait_ready(served)
        yield started
    finally:
        for served in started:
            served.stop()


@contextlib.contextmanager
def replica(
    workdir: Path, policy: Path, ledger_url: str, sandbox: Path, env: dict[str, str] | None = None
) -> Iterator[Served]:
    with replicas(workdir, policy, ledger_url, sandbox, 1, env) as (served,):
        yield served


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`commitgate ARGS...` through the real CLI entry point."""
    return subprocess.run(
        [sys.executable, "-m", "commitgate.server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def with_password(url: str, password: str) -> tuple[str, str]:
    """(`url` with a password, that password). A URL that has one keeps it; trust auth ignores any."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None:
        return url, parts.password
    user = parts.username or "postgres"
    host = parts.hostname or "127.0.0.1"
    netloc = f"{user}:{password}@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)), password


def charge_of(result: Any) -> str:
    """The charge id of a successful charge_card answer."""
    assert not result.is_error, result
    return str(result.structured_content["charge_id"])


def ports(served: Sequence[Served]) -> list[int]:
    return [s.port for s in served]
