"""Small things a new user tripped over, each checked the way they met it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from commitgate.server.policy.models import load_policy
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.reload import PolicyReloader, ReloadStatus

pytestmark = pytest.mark.anyio

TOOL = '[tools.send_email]\nclass = "key-required"\npython = "commitgate.tools.demo:send_email"\n'


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_an_applied_policy_is_routine_news_logged_at_info(
    tmp_path: Path, sandbox: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "policy.toml"
    ledger = f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n'
    write(path, ledger + TOOL)
    gateway = await Gateway.open(load_policy(path), path)

    async def on_applied() -> None:
        return None

    try:
        reloader = PolicyReloader(gateway, path, on_applied)
        reloader.prime()
        write(path, ledger + TOOL + 'timeout = "20s"\n')
        with caplog.at_level(logging.DEBUG, logger="commitgate"):
            assert (await reloader.reload()).status is ReloadStatus.APPLIED
    finally:
        await gateway.close()
    applied = [r for r in caplog.records if "applied" in r.getMessage()]
    assert applied and all(r.levelno == logging.INFO for r in applied)
