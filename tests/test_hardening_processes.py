"""What a hostile environment does to a running `commitgate serve` process: signals, odd files, odd paths.

Real server processes over stdio (tests/e2e_support.py); effects counted in the sandbox.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest
from support.e2e import Deployment, new_id, serve

from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.model.facts import State
from commitgate.server.serve.gateway import local_principal

pytestmark = pytest.mark.anyio


def _exited(pid: int) -> bool:
    """Gone, or a zombie waiting for its parent (the client) to reap it."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return True
    return fields[0] in ("Z", "X")


async def _wait_until(predicate: object, within: float, what: str) -> None:
    with anyio.move_on_after(within):
        while not predicate():  # type: ignore[operator]
            await anyio.sleep(0.05)
        return
    raise AssertionError(f"not within {within}s: {what}")


@pytest.mark.parametrize("stdio", ["fast", "sdk"])
async def test_sigterm_on_stdio_lets_the_call_in_flight_record_its_outcome(
    tmp_path: Path, stdio: str
) -> None:
    """Drains, then exits without waiting for stdin to close (the client keeps it open)."""
    dep = Deployment.create(tmp_path)
    gate, key = tmp_path / "gate", new_id("term")
    async with serve(dep, stdio=stdio) as server:

        async def call() -> None:
            with contextlib.suppress(Exception):  # the connection closes under it
                await server.call("gated_task", {"gate": str(gate), "idempotency_key": key}, session="s")

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(call)
            await server.wait_for_state("s", key, {"RUNNING"})
            pid = server.pid
            os.kill(pid, signal.SIGTERM)
            await anyio.sleep(0.3)  # the signal is handled before the effect may happen
            gate.touch()
            await _wait_until(lambda: _exited(pid), 20, "the server exits after SIGTERM")
            tasks.cancel_scope.cancel()
    ledger = await SQLiteLedger.open(dep.ledger)
    try:
        op = await ledger.get(local_principal(), "s", key)
    finally:
        await ledger.close()
    assert op is not None and op.state is State.SUCCEEDED, op
    assert dep.count("tasks", idempotency_key=key) == 1


async def test_a_policy_replaced_by_a_fifo_is_refused_and_the_server_keeps_answering(tmp_path: Path) -> None:
    dep = Deployment.create(tmp_path)
    params = dep.params()
    started = subprocess.run(  # end of input at once: it starts, says what it says, and stops
        [params.command, *params.args, "--log-level", "info"],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
        env=params.env,
    )
    lines = [json.loads(line) for line in started.stderr.splitlines() if line.startswith("{")]
    ledger = [(r["level"], r["msg"]) for r in lines if r.get("msg", "").startswith("ledger ")]
    assert ledger == [("info", f"ledger sqlite:///{dep.ledger} (from --ledger)")]
    async with serve(dep, read_timeout=15) as server:
        dep.policy.unlink()
        os.mkfifo(dep.policy)
        await _wait_until(
            lambda: "not a regular file" in server.stderr.read_text(encoding="utf-8"),
            15,
            "the reload refuses the FIFO and says so",
        )
        answer = await server.call("get_balance", {"card": "4242"})
        assert not answer.is_error, answer.content
        said = [json.loads(line) for line in server.stderr.read_text(encoding="utf-8").splitlines()]
        # the ledger line is info: quiet at the default level, where a client shows warnings to its user
        assert [r["msg"] for r in said if r.get("msg", "").startswith("ledger ")] == []


def test_a_module_beside_the_policy_never_shadows_the_standard_library(tmp_path: Path) -> None:
    """`colorsys.py` next to the policy must not replace the standard library's, once tools are built."""
    marker = tmp_path / "shadowed"
    (tmp_path / "colorsys.py").write_text(f"open({str(marker)!r}, 'w').close()\n", encoding="utf-8")
    (tmp_path / "mytools.py").write_text("def hello(name: str) -> dict:\n    return {'hi': name}\n")
    policy = tmp_path / "policy.toml"
    policy.write_text('[tools.hello]\nclass = "safe-retry"\npython = "mytools:hello"\n', encoding="utf-8")
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from commitgate.server.policy.loading import load_policy
        from commitgate.server.serve.registry import build_tools
        served = build_tools(load_policy({str(policy)!r}), Path({str(tmp_path)!r}))
        assert "hello" in served  # a tool beside the policy still imports
        import colorsys
        print(colorsys.__file__)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", timeout=60)
    assert done.returncode == 0, done.stderr
    assert not marker.exists(), f"the policy directory's colorsys.py ran: {done.stdout}"
    assert str(tmp_path) not in done.stdout


# --- the HTTP transports ------------------------------------------------------------------------------


def _raw(port: int, request: bytes, timeout: float = 10.0) -> bytes:
    """Send `request` as is (with `Connection: close`) and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        return answer


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


# The server's HEADER_TIMEOUT (10 s) and BODY_TIMEOUT (30 s), shortened in its process: the test waits
# them out for a connection that never finishes its headers, and one that trickles its body.
SHORT_HEADER_TIMEOUT = (
    "import commitgate.server.serve.http as http\nhttp.HEADER_TIMEOUT = 1\nhttp.BODY_TIMEOUT = 2"
)


def _trickled_body_held_for(port: int, give_up: float) -> float:
    """Send a POST's headers, then its body one byte every 0.2 s; the seconds until the server closes
    the connection (or `give_up`, when it never does)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=give_up) as conn:
        conn.sendall(
            b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Accept: application/json, text/event-stream\r\nContent-Length: 100000\r\n\r\n{"
        )
        conn.settimeout(0.2)
        while time.monotonic() - started < give_up:
            try:
                if conn.recv(1024) == b"":
                    break
            except TimeoutError:
                pass
            except ConnectionError:
                break
            try:
                conn.sendall(b" ")
            except OSError:
                break
    return time.monotonic() - started


def test_http_host_checks_headers_and_health(tmp_path: Path) -> None:
    from support.http_servers import running, write_policy

    policy, ledger = write_policy(tmp_path, auth=False), tmp_path / "ledger.db"
    with running(
        tmp_path, policy, "streamable-http", ledger=ledger, sandbox=tmp_path / "sandbox.db",
        preamble=SHORT_HEADER_TIMEOUT,
    ) as served:  # fmt: skip
        port = served.port

        def healthz(host: str) -> int:
            return _status(
                _raw(port, f"GET /healthz HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            )

        assert healthz("127.0.0.1") == 200  # port 80 clients send no port
        assert healthz(f"LOCALHOST:{port}") == 200  # host names are case-insensitive
        assert healthz(f"evil.example:{port}") != 200  # DNS rebinding still refused

        initialize = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "raw", "version": "0"},
                },
            }
        ).encode()
        answer = _raw(
            port,
            b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Accept: application/json, text/event-stream\r\nConnection: close\r\n"
            + f"Content-Length: {len(initialize)}\r\n\r\n".encode()
            + initialize,
        )
        data = [
            line[5:] for line in answer.split(b"\r\n\r\n", 1)[1].splitlines() if line.startswith(b"data:")
        ]
        result = json.loads(data[0] if data else answer.split(b"\r\n\r\n", 1)[1])["result"]
        assert result["capabilities"]["tools"]["listChanged"] is True  # it does send the notification

        with socket.create_connection(("127.0.0.1", port), timeout=20) as slow:
            slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the end of it
            try:
                closed = slow.recv(1024) == b""
            except TimeoutError:
                closed = False
            assert closed, "a connection that never finished its headers was kept open"

        held = _trickled_body_held_for(port, give_up=12.0)  # a byte at a time: never idle, never done
        assert held < 8.0, f"a body trickled a byte at a time held its connection for {held:.1f} s"

        for suffix in ("", "-wal", "-shm"):
            Path(f"{ledger}{suffix}").unlink(missing_ok=True)
        assert healthz("127.0.0.1") == 503  # a ledger gone from its path is not healthy


async def test_a_truncated_shared_memory_file_is_not_a_silent_death(tmp_path: Path) -> None:
    """SQLite maps `-shm`; truncating it under a server is a SIGBUS no Python code can catch.
    The least the server owes its operator is a line saying what killed it."""
    dep = Deployment.create(tmp_path)
    email = {"to": "a@example.com", "subject": "s", "body": "b"}
    with contextlib.suppress(Exception):
        async with serve(dep, read_timeout=10) as server:
            assert not (await server.call("send_email", {**email, "idempotency_key": new_id("a")})).is_error
            os.truncate(f"{dep.ledger}-shm", 0)
            await server.call("send_email", {**email, "idempotency_key": new_id("b")})
    (log,) = tmp_path.glob("server-*.stderr")
    assert "Fatal Python error: Bus error" in log.read_text(encoding="utf-8")


def test_a_hung_stdio_upstream_and_its_child_end_with_the_server(tmp_path: Path) -> None:
    """A client closes stdin, then sends SIGTERM while the server still waits for a hung upstream to
    stop: the upstream and the child it started must not outlive the server."""
    hung = Path(__file__).resolve().parent / "support" / "hung_server.py"
    pids_file = tmp_path / "pids"
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n\n'
        f'[upstreams.hung]\ncommand = "{sys.executable}"\nargs = ["{hung}"]\n'
        f'env = {{ HUNG_PIDS = "{pids_file}" }}\n\n[tools.x]\nupstream = "hung"\nclass = "key-required"\n'
    )
    argv = [sys.executable, "-m", "commitgate.server.cli", "serve", "--policy", str(policy)]
    server = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not (pids_file.exists() and len(pids_file.read_text().split()) == 2):
            assert time.monotonic() < deadline and server.poll() is None, "the upstream never started"
            time.sleep(0.05)
        pids = [int(pid) for pid in pids_file.read_text().split()]
        time.sleep(0.5)  # it is connecting: the upstream never answers
        assert server.stdin is not None
        server.stdin.close()  # the client is done...
        time.sleep(0.5)
        server.send_signal(signal.SIGTERM)  # ...and stops the server before the SDK's 2 s grace is over
        server.wait(30)
        deadline = time.monotonic() + 10
        while not all(_exited(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in pids if not _exited(pid)] == [], "the upstream outlived the server"
    finally:
        if server.poll() is None:
            server.kill()
        if pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pids[0], signal.SIGKILL)  # the group this test's upstream started
