"""What a hostile environment does to a running `commitgate serve` process: signals, odd files, odd paths.

Real server processes over stdio (tests/e2e_support.py); effects counted in the sandbox.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from e2e_support import Deployment, new_id, serve

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


async def test_sigterm_on_stdio_lets_the_call_in_flight_record_its_outcome(tmp_path: Path) -> None:
    dep = Deployment.create(tmp_path)
    gate, key = tmp_path / "gate", new_id("term")
    async with serve(dep) as server:

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
        from commitgate.server.policy.models import load_policy
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
