"""Python function calls per guarded call, stage by stage: a profile that does not depend on the clock.

    python -m commitgate.server.bench.calls [--calls N] [--json]

Opens the bench's overhead policy in this process (a gateway, a fresh SQLite ledger; no MCP
transport, so the SDK's share is left out) and makes N guarded calls of the no-op with new keys,
counting every Python and builtin function call made inside each stage under `sys.setprofile`.
Timings of a stage move with the machine's load and the disk; these counts do not, so two
versions of the code can be compared on a busy machine. A call is counted in every stage on
the stack (the claim is inside the boundary, which is inside the whole call). The work of an
operation runs in a task of its own, so it is its own stage, not part of `boundary.call`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

from commitgate.server.bench.overhead import OVERHEAD_POLICY
from commitgate.server.policy.loading import loads_policy
from commitgate.server.serve.gateway import Gateway

# (file, function) -> stage; the file is matched on the end of its path.
STAGES: dict[tuple[str, str], str] = {
    ("serve/gateway.py", "call_tool"): "the whole call (gateway.call_tool)",
    ("serve/gateway.py", "_request"): "arguments: key, validation, encoding",
    ("core/boundary.py", "call"): "boundary.call: the caller's side",
    ("ledger/sqlite/__init__.py", "claim"): "ledger claim",
    ("core/runs.py", "_execute"): "the operation's work task",
    ("tools/python.py", "call"): "running the tool",
    ("ledger/sqlite/__init__.py", "update"): "ledger outcome",
    ("serve/gateway.py", "render"): "rendering the answer",
}


class StageCounter:
    """A `sys.setprofile` hook: each call event is added to every stage whose frame is on the stack.

    A coroutine that suspends returns (its frames leave the stack) and re-enters when resumed, so
    the stack stays true across the event loop's task switches.
    """

    def __init__(self) -> None:
        self.counts = dict.fromkeys(STAGES.values(), 0)
        self._open: list[tuple[FrameType, str]] = []
        self._stage_of: dict[Any, str | None] = {}

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            for _, holding in self._open:
                self.counts[holding] += 1
        if event == "call":
            stage = self._stage(frame)
            if stage is not None:
                self._open.append((frame, stage))
        elif event == "return" and self._open and self._open[-1][0] is frame:
            self._open.pop()

    def _stage(self, frame: FrameType) -> str | None:
        code = frame.f_code
        if code not in self._stage_of:
            path = code.co_filename.replace("\\", "/")
            found = [s for (f, name), s in STAGES.items() if name == code.co_name and path.endswith(f)]
            self._stage_of[code] = found[0] if found else None
        return self._stage_of[code]


async def count_calls(calls: int, warm_up: int = 50) -> dict[str, float]:
    """Function calls per guarded call, by stage, over `calls` calls after `warm_up` others."""
    with tempfile.TemporaryDirectory(prefix="commitgate-calls-") as tmp:
        text = OVERHEAD_POLICY.replace(
            "[ledger]", f'[ledger]\nurl = "sqlite:///{Path(tmp) / "ledger.db"}"', 1
        )
        gateway = await Gateway.open(loads_policy(text), None)
        try:
            for i in range(warm_up):
                await gateway.call_tool("noop_keyed", {"n": i, "idempotency_key": f"warm-{i}"}, {}, "bench")
            counter = StageCounter()
            sys.setprofile(counter)
            try:
                for i in range(calls):
                    arguments = {"n": 1_000_000 + i, "idempotency_key": f"call-{i}"}
                    result = await gateway.call_tool("noop_keyed", arguments, {}, "bench")
            finally:
                sys.setprofile(None)
            if result.is_error:
                raise RuntimeError(f"the guarded no-op failed: {result.content}")
        finally:
            await gateway.close()
    return {stage: count / calls for stage, count in counter.counts.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m commitgate.server.bench.calls", description=__doc__)
    parser.add_argument("--calls", type=int, default=500, help="guarded calls counted (default 500)")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = parser.parse_args(argv)
    counts = asyncio.run(count_calls(args.calls))
    if args.json:
        print(json.dumps(counts, indent=2))
        return
    print(f"Python function calls per guarded call, by stage (means of {args.calls}):")
    for stage, count in counts.items():
        print(f"  {stage:40s} {count:8.1f}")


if __name__ == "__main__":
    main()
