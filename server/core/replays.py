"""Operations whose outcome is final, kept in memory so that a replay costs no ledger read.

An operation that SUCCEEDED or FAILED_FINAL, and is not compensable, cannot change in any
ledger until its retention ends: `ops resolve` moves only UNKNOWN operations, compensation only
compensable ones, purge only expired ones. So any process may answer a replay of it from memory,
until its `expires_at`, exactly as a read of the ledger would, even while other processes share
that ledger. Everything else (running, uncertain, compensable) is always read from the ledger.

Bounded in entries and in the size of each: a replay of an evicted or large operation simply
reads the ledger again.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from commitgate.server.model.facts import IdempotencyClass, State
from commitgate.server.model.records import Operation

_FINAL = frozenset({State.SUCCEEDED, State.FAILED_FINAL})

Key = tuple[str, str, str]  # principal, session, step


class FinalOutcomes:
    def __init__(self, capacity: int = 1024, max_chars: int = 16_384) -> None:
        self._capacity = capacity
        self._max_chars = max_chars  # of arguments and result as JSON: the cache stays under ~16 MiB
        self._entries: OrderedDict[Key, Operation] = OrderedDict()

    def get(self, principal: str, session: str, step: str, now: float) -> Operation | None:
        key = (principal, session, step)
        op = self._entries.get(key)
        if op is None:
            return None
        if op.expires_at is not None and op.expires_at <= now:  # as the ledger: past retention is gone
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return op

    def remember(self, op: Operation) -> None:
        if not self._keeps(op):
            return
        key = (op.principal, op.session, op.step)
        self._entries[key] = op
        self._entries.move_to_end(key)
        if len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def _keeps(self, op: Operation) -> bool:
        if op.state not in _FINAL or op.idempotency_class is IdempotencyClass.COMPENSABLE:
            return False
        encoded = op.arguments_json  # as claimed or read: no second encoding per call
        size = len(
            encoded if encoded is not None else json.dumps(op.arguments, separators=(",", ":"), default=str)
        )
        if op.result is not None:
            size += len(op.result.to_json())
        return size <= self._max_chars

    def __len__(self) -> int:
        return len(self._entries)
