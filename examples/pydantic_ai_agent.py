"""A pydantic-ai agent that charges a card twice after losing an answer, and what commitgate does about it.

The model is scripted (pydantic-ai's `FunctionModel`), so no LLM or API key is needed:

1. it calls `charge_card` with an idempotency key of its own choosing;
2. the answer is "lost" (a timeout, a truncated context), so it calls `charge_card` again with
   the same arguments, a NEW key and a new tool-call id, as models and framework retry loops do;
3. it answers in text.

Three runs show the difference (charges are counted in the demo tools' sandbox database):

- plain MCP server, no commitgate: two charges;
- through commitgate (duplicate detection is on by default): one charge; the second call gets
  `possible_duplicate`, which the model reads as commitgate's message, as that call's result;
- through commitgate with keys from durable state: the toolset sends the workflow's run id as the
  session and a step named after the action as the key, so the re-issue and a whole restarted run
  replay the first charge instead of running again.

Run it from a checkout, after `pip install ./client '.[test]'` (or `make .venv/.installed`):

    python examples/pydantic_ai_agent.py

`commitgate_toolset` (commitgate.client.pydantic_ai) is an `MCPToolset` set up for commitgate; what it
changes and why is in docs/frameworks.md. The stdio child gets a minimal environment, so pass what
the server needs in `env`.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fastmcp.client.transports import StdioTransport
from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from commitgate.client.keys import StepFunction
from commitgate.client.pydantic_ai import commitgate_toolset

HERE = Path(__file__).resolve().parent
CHARGE = {"card": "4242", "amount_cents": 1299, "description": "order 42"}

POLICY = """
[server]
name = "agent-example"

[tools.charge_card]
class = "key-and-status-check"
python = "commitgate.server.demo.tools:charge_card"
status_check = "commitgate.server.demo.tools:find_charge"
"""


@dataclass
class Transcript:
    """What the scripted model saw as each tool result: (outcome, text), in order."""

    results: list[tuple[str, str]] = field(default_factory=list)


def scripted_model(transcript: Transcript, calls: int = 2) -> FunctionModel:
    """Charge, lose the answer, charge again under a new key (`calls` in all), then answer."""

    def turn(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        made = [
            p
            for m in messages
            if isinstance(m, ModelResponse)
            for p in m.parts
            if isinstance(p, ToolCallPart)
        ]
        last = messages[-1]
        if isinstance(last, ModelRequest):
            for part in last.parts:
                if isinstance(part, ToolReturnPart):
                    transcript.results.append((str(part.outcome), part.model_response_str()))
        if len(made) < calls:
            key = f"order-42-{uuid.uuid4().hex[:8]}"  # a new key each time: the model lost track
            arguments = {**CHARGE, "idempotency_key": key}
            return ModelResponse(
                parts=[ToolCallPart("charge_card", arguments, tool_call_id=f"call_{len(made) + 1}")]
            )
        return ModelResponse(parts=[TextPart("Done.")])

    return FunctionModel(turn)


def order_step(tool: str, arguments: object) -> str:
    """Keys from durable state: one charge per order in this workflow, so that is the step."""
    return f"{tool}-order-42"


@dataclass
class Sandbox:
    """A directory with the system of record (the demo tools' sandbox), a policy and a ledger."""

    root: Path

    @property
    def env(self) -> dict[str, str]:
        return {
            "COMMITGATE_SANDBOX": str(self.root / "sandbox.db"),
            "PATH": os.environ.get("PATH", ""),
            "HOME": os.environ.get("HOME", str(self.root)),
        }

    def charges(self) -> int:
        path = self.root / "sandbox.db"
        if not path.exists():
            return 0
        with sqlite3.connect(path) as conn:
            return int(conn.execute("SELECT count(*) FROM charges").fetchone()[0])

    def commitgate(self) -> StdioTransport:
        policy = self.root / "policy.toml"
        policy.write_text(POLICY, encoding="utf-8")
        ledger = f"sqlite:///{self.root / 'ledger.db'}"
        args = ["-m", "commitgate.server.cli", "serve", "--policy", str(policy), "--ledger", ledger]
        return self._transport(args)

    def plain(self) -> StdioTransport:
        return self._transport([str(HERE / "plain_charge_server.py")])

    def _transport(self, args: list[str]) -> StdioTransport:
        log = (self.root / "server.log").open("a", encoding="utf-8")
        return StdioTransport(sys.executable, args, env=self.env, keep_alive=False, log_file=log)


async def run_agent(
    transport: StdioTransport, run_id: str | None = None, step: StepFunction | None = None, calls: int = 2
) -> Transcript:
    """One run of the scripted agent: through commitgate when a run id is given, else the plain toolset."""
    transcript = Transcript()
    # A server process may take a few seconds to start on a busy machine: more than the 5 s that
    # pydantic-ai waits for the handshake by default.
    if run_id is None:
        toolset = MCPToolset(transport, tool_error_behavior="failed", init_timeout=30)
    else:
        toolset = commitgate_toolset(transport, run_id=run_id, step=step, init_timeout=30)
    agent = Agent(scripted_model(transcript, calls), toolsets=[toolset])
    await agent.run("Charge order 42 for $12.99")
    return transcript


async def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="commitgate-agent-"))
    plain, guarded, durable = (Sandbox(root / name) for name in ("plain", "guarded", "durable"))
    for sandbox in (plain, guarded, durable):
        sandbox.root.mkdir()

    await run_agent(plain.plain())
    print(f"without commitgate:            {plain.charges()} charges")

    seen = await run_agent(guarded.commitgate(), "run-1")
    print(f"through commitgate:            {guarded.charges()} charge; the model was told:")
    print(f"    {seen.results[-1][1][:400]}...")

    first = await run_agent(durable.commitgate(), "run-1", order_step)
    restarted = await run_agent(durable.commitgate(), "run-1", order_step)  # a new process, same run id
    calls = len(first.results) + len(restarted.results)
    print(
        f"with keys from run id + step:  {durable.charges()} charge for {calls} calls, a restarted run included"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
