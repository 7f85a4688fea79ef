"""One commitgate process for the multi-process tests: a boundary on a shared ledger file.

    python worker.py CONFIG_JSON

CONFIG keys: mode ("call" or "open"), ledger, record (system of record file), cls,
key, script / status / default (ScriptedTool), copies (concurrent calls in this
process), server (ServerPolicy overrides), running (serve inside
`boundary.running()`, as a restarted server does), ready / go (marker files: this
process touches `ready` once it is set up, then waits for `go` to exist),
entered / effect (marker files touched when the tool starts / applies its effect),
durability ("full" or "claim", the ledger's).

Prints one JSON line per answer: {code, state, replayed, effect, attempts, fence}.
In mode "open" it opens the ledger (racing the others on a new file), claims a key
of its own and prints {"claimed": KIND}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.boundary import (
    ScriptedTool,
    SystemOfRecord,
    call_request,
    effect_of,
    guarded,
    make_boundary,
)

from commitgate.server.core.requests import Answer
from commitgate.server.ledger.base import ClaimRequest
from commitgate.server.ledger.sqlite import SQLiteLedger
from commitgate.server.model.facts import IdempotencyClass


def touch(path: str | None) -> None:
    if path:
        Path(path).touch()


async def barrier(config: dict[str, Any]) -> None:
    touch(config.get("ready"))
    go = config.get("go")
    deadline = time.monotonic() + 60
    while go and not Path(go).exists():
        if time.monotonic() > deadline:
            raise SystemExit("the go marker never appeared")
        await asyncio.sleep(0.002)


def describe(answer: Answer) -> dict[str, Any]:
    op = answer.operation
    return {
        "code": answer.error.code.value if answer.error else None,
        "state": op.state.value if op else None,
        "replayed": answer.replayed,
        "effect": effect_of(answer.result),
        "attempts": op.attempts if op else None,
        "fence": op.fence if op else None,
    }


async def call(config: dict[str, Any]) -> None:
    ledger = await SQLiteLedger.open(config["ledger"], durability=config.get("durability", "full"))
    try:
        source = ScriptedTool(
            SystemOfRecord(Path(config["record"])),
            config.get("script"),
            config.get("status"),
            default=config.get("default", "ok"),
            on_enter=lambda: touch(config.get("entered")),
            on_effect=lambda: touch(config.get("effect")),
        )
        tool = guarded("charge", config["cls"], source)
        boundary = make_boundary(ledger, [tool], **config.get("server", {}))
        await barrier(config)
        serving = boundary.running() if config.get("running") else contextlib.nullcontext()
        async with serving:
            requests = [call_request(tool, config["key"]) for _ in range(config.get("copies", 1))]
            answers = await asyncio.gather(*(boundary.call(r) for r in requests))
        for answer in answers:
            print(json.dumps(describe(answer)), flush=True)
    finally:
        await ledger.close()


async def open_and_claim(config: dict[str, Any]) -> None:
    await barrier(config)
    ledger = await SQLiteLedger.open(config["ledger"])
    try:
        request = ClaimRequest(
            "alice", "s1", f"k-{os.getpid()}", "charge", IdempotencyClass.KEY_REQUIRED, "fp", "{}",
            f"worker:{os.getpid()}:x", 10.0, 3600.0,
        )  # fmt: skip
        claim = await ledger.claim(request, time.time())
        print(json.dumps({"claimed": claim.kind.value}), flush=True)
    finally:
        await ledger.close()


def main() -> None:
    config = json.loads(sys.argv[1])
    asyncio.run(call(config) if config.get("mode", "call") == "call" else open_and_claim(config))


if __name__ == "__main__":
    main()
