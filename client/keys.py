"""Session and step for a call an agent framework makes: what goes in `_meta`, and what stays an argument.

The session is the run's durable id. The step names one action of the run; the server takes it as
the operation's key, so a step sent in `_meta` replaces the model's `idempotency_key` argument
(the server refuses a call where the two differ). `by_arguments` is a step for runs whose every
action is distinct: the same tool with the same arguments in the same run is the same action,
so a re-issue after a lost answer gets the first outcome back.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from commitgate.client.gate import SESSION_META, STEP_META

KEY_ARGUMENT = "idempotency_key"
CONFIRM_ARGUMENT = "confirm_duplicate"

# (tool name, the model's arguments) -> the step, or None to keep the model's own key.
StepFunction = Callable[[str, Mapping[str, Any]], str | None]


def by_arguments(tool: str, arguments: Mapping[str, Any]) -> str:
    """`tool-<digest of the arguments>`: the model's key and confirm flag left out, key order ignored."""
    action = {k: v for k, v in arguments.items() if k not in (KEY_ARGUMENT, CONFIRM_ARGUMENT)}
    canonical = json.dumps(action, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return f"{tool}-{hashlib.sha256(canonical.encode()).hexdigest()[:24]}"


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
