"""pytest plugin `commitgate` (loaded automatically once commitgate is installed).

The `gate` fixture starts a real commitgate server over a policy, with a temporary
ledger and a fault plan, and hands the test a `Gate`:

    @pytest.mark.anyio
    async def test_one_refund(gate):
        await gate.lose_next_answer("refund")           # the agent will not hear back
        await my_agent(gate.client, session="run-7")    # an MCP client, as your agent uses
        await gate.assert_effects("refund", exactly=1, session="run-7")

Choose the policy by overriding the `commitgate_policy` fixture (a path; None serves
the bundled demo policy) or with `commitgate_policy = path` in the pytest ini file;
`commitgate_env` gives the server process extra environment variables. Tests that
use `gate` are async and run under anyio (`@pytest.mark.anyio`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from commitgate.server.verify.harness import Gate

INI_POLICY = "commitgate_policy"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(INI_POLICY, "policy file the `gate` fixture serves (relative to the rootdir)", default="")


@pytest.fixture
def commitgate_policy(request: pytest.FixtureRequest) -> Path | None:
    """The policy file `gate` serves: the ini option `commitgate_policy`, else the bundled demo policy."""
    value = str(request.config.getini(INI_POLICY) or "")
    return request.config.rootpath / value if value else None


@pytest.fixture
def commitgate_env() -> dict[str, str]:
    """Extra environment variables for the server process (e.g. where your tools' data lives)."""
    return {}


@pytest.fixture
async def gate(
    commitgate_policy: Path | None, commitgate_env: dict[str, str], tmp_path: Path
) -> AsyncIterator[Gate]:
    """A real commitgate server (its own temporary ledger) with an MCP client and a fault plan."""
    from commitgate.server.verify.harness import GateError, start_gate

    try:
        async with start_gate(commitgate_policy, tmp_path / "commitgate", env=commitgate_env) as running:
            yield running
    except GateError as exc:
        pytest.fail(f"commitgate: {exc}", pytrace=False)
