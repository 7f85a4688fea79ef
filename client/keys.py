"""Session and step for a call an agent framework or a durable engine makes.

The session is the run's durable id. The step names one action of the run; the server takes it as
the operation's key, so a step sent in `_meta` replaces the model's `idempotency_key` argument
(the server refuses a call where the two differ). `by_arguments` is a step for runs whose every
action is distinct: the same tool with the same arguments in the same run is the same action,
so a re-issue after a lost answer gets the first outcome back.

`step_key` makes a key from a durable engine's own ids (a DBOS step id, a model's tool call id
such as `call_Jx9…` kept in a LangGraph checkpoint). A key is 1-255 characters of
`[A-Za-z0-9._:@/+=-]` (docs/contract.md) and those ids do not always fit, so it joins the parts
with `:` and escapes any other character as `=XX` (its UTF-8 bytes in hex): the same parts always
give the same key, different parts different keys, and a key that would be too long keeps its
start and ends in a digest of the whole.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from commitgate.client.gate import SESSION_META, STEP_META

KEY_ARGUMENT = "idempotency_key"
CONFIRM_ARGUMENT = "confirm_duplicate"
MAX_KEY = 255
_PLAIN = re.compile(r"[A-Za-z0-9.@/+-]")  # key characters except the separator ':' and the escape '='
_DIGEST = 32  # hex characters of SHA-256 kept at the end of an over-long key

# (tool name, the model's arguments) -> the step, or None to keep the model's own key.
StepFunction = Callable[[str, Mapping[str, Any]], str | None]


def by_arguments(tool: str, arguments: Mapping[str, Any]) -> str:
    """`tool-<digest of the arguments>`: the model's key and confirm flag left out, key order ignored."""
    action = {k: v for k, v in arguments.items() if k not in (KEY_ARGUMENT, CONFIRM_ARGUMENT)}
    canonical = json.dumps(action, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return f"{tool}-{hashlib.sha256(canonical.encode()).hexdigest()[:24]}"


def step_key(*parts: str | int) -> str:
    """The key naming one action: `parts` (e.g. an engine's step id and a tool name) escaped and joined."""
    key = ":".join(_escape(str(part)) for part in parts)
    if not key:
        raise ValueError("step_key needs a non-empty part, e.g. the model's tool call id")
    if len(key) <= MAX_KEY:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()[:_DIGEST]
    return f"{key[: MAX_KEY - _DIGEST - 1]}={digest}"


def _escape(part: str) -> str:
    return "".join(ch if _PLAIN.fullmatch(ch) else "".join(f"={b:02X}" for b in ch.encode()) for ch in part)


def prepare(
    tool: str, arguments: Mapping[str, Any], run_id: str, step: StepFunction | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arguments to send and the `_meta` to send with them."""
    args = dict(arguments)
    meta: dict[str, Any] = {SESSION_META: run_id}
    name = step(tool, arguments) if step is not None else None
    if name is not None:
        args.pop(KEY_ARGUMENT, None)
        meta[STEP_META] = name
    return args, meta
