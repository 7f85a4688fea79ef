"""OpenAI Agents SDK end to end: a scripted model, MCP over stdio, charges counted in the system of record.

The model re-issues a charge under a new key after a lost answer: two charges through a plain MCP
server, one through commitgate, and the model reads commitgate's message as plain text. The SDK is
imported inside the tests (tests/support/openai_agents.py): every pytest worker collects this module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.agents import AgentSandbox

pytestmark = pytest.mark.slow


@pytest.mark.anyio
async def test_without_commitgate_the_re_issue_charges_twice(tmp_path: Path) -> None:
    from support.openai_agents import run_agent

    box = AgentSandbox.create(tmp_path / "plain")
    model = await run_agent(box.plain, box.env, calls=2)
    assert len(model.read) == 2 and all("charge_id" in text for text in model.read)
    assert box.charges() == 2


@pytest.mark.anyio
async def test_through_commitgate_it_charges_once_and_the_model_reads_why(tmp_path: Path) -> None:
    from support.openai_agents import run_agent

    from commitgate.client.openai_agents import commitgate_options

    box = AgentSandbox.create(tmp_path / "guarded")
    model = await run_agent(box.commitgate, box.env, calls=3, **commitgate_options("run-1"))
    assert box.charges() == 1
    first, *refusals = model.read
    assert len(refusals) == 2
    for text in refusals:
        assert text.startswith("[possible_duplicate] Possible duplicate: nothing was executed now.")
        assert "in session 'run-1'" in text  # the run id reached commitgate in _meta
        assert json.loads(first)["charge_id"] in text
        assert '\\"' not in text and '{"error' not in text  # plain text, no JSON wrapped around it


def test_a_lost_answer_is_told_as_maybe_done_not_as_try_again() -> None:
    """What the SDK's default says when a call raises, and what the adapter says instead."""
    from agents import RunContextWrapper
    from agents.tool import default_tool_error_function

    from commitgate.client.openai_agents import failure_error_function

    context: RunContextWrapper[None] = RunContextWrapper(context=None)
    timeout = TimeoutError("Timed out while waiting for response to ClientRequest. Waited 30.0 seconds.")
    default = default_tool_error_function(context, timeout)
    assert default == "An error occurred while running the tool. Please try again."
    said = failure_error_function(context, timeout)
    assert said.startswith("No answer came back from the tool (Timed out while waiting")
    assert "The call may have run" in said and "the same idempotency_key" in said
