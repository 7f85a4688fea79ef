"""Tiny tools for `commitgate bench`.

* `noop` does nothing: the overhead benchmark serves it twice, as a `safe-retry`
  tool and as a `key-required` tool, so the two differ only by the guard.
* `overloaded_service` is a downstream with limited capacity (experiment 5): a
  request holds one of `COMMITGATE_BENCH_CAPACITY` slots for a lognormal time
  (~200 ms median, ~2 s p99 by default); when every slot is taken it answers at
  once with a retryable "503 overloaded" (certainly not applied).
* `service_load` reports what the service saw: attempts, rejections, peak
  concurrent load and peak attempts per second. Counters live in the server
  process, so every benchmark arm starts a fresh process.

Annotations are evaluated (no `from __future__ import annotations`), like the
demo tools, so the Python tool source sees real types.
"""

import asyncio
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from commitgate.server.model.outcomes import RetryableError

ENV_CAPACITY = "COMMITGATE_BENCH_CAPACITY"
DEFAULT_CAPACITY = 10
_Z99 = 2.3263478740  # the standard normal's 99th percentile
_WINDOW = 0.1  # seconds per bucket of the attempts-per-second peak


async def noop(n: int) -> dict[str, int]:
    """Do nothing and return `n` (the overhead benchmark's tool)."""
    return {"n": n}


@dataclass
class _Load:
    capacity: int
    slots: asyncio.Semaphore
    attempts: int = 0
    rejected: int = 0
    served: int = 0
    in_service: int = 0
    peak_in_service: int = 0
    first_at: float | None = None
    last_at: float | None = None
    per_window: dict[int, int] = field(default_factory=dict)

    def arrive(self) -> None:
        now = time.monotonic()
        self.attempts += 1
        self.first_at = self.first_at if self.first_at is not None else now
        self.last_at = now
        bucket = int(now / _WINDOW)
        self.per_window[bucket] = self.per_window.get(bucket, 0) + 1


_load: _Load | None = None


def _service() -> _Load:
    global _load
    if _load is None:
        capacity = int(os.environ.get(ENV_CAPACITY, DEFAULT_CAPACITY))
        if capacity < 1:
            raise ValueError(f"{ENV_CAPACITY} must be at least 1, got {capacity}")
        _load = _Load(capacity, asyncio.Semaphore(capacity))
    return _load


def lognormal_seconds(median_ms: float, p99_ms: float, rng: random.Random | None = None) -> float:
    """A service time from the lognormal whose median and 99th percentile are the given ones."""
    if not 0 < median_ms <= p99_ms:
        raise ValueError("need 0 < median_ms <= p99_ms")
    sigma = math.log(p99_ms / median_ms) / _Z99
    return (rng or random).lognormvariate(math.log(median_ms / 1000.0), sigma)


async def overloaded_service(job: str, median_ms: float = 200.0, p99_ms: float = 2000.0) -> dict[str, Any]:
    """Do `job` on a service with limited capacity; it answers 503 (retryable) when every slot is busy."""
    load = _service()
    load.arrive()
    if load.slots.locked():
        load.rejected += 1
        raise RetryableError("503 overloaded: every slot is busy, try again later", detail={"status": 503})
    async with load.slots:
        load.in_service += 1
        load.peak_in_service = max(load.peak_in_service, load.in_service)
        try:
            await asyncio.sleep(lognormal_seconds(median_ms, p99_ms))
        finally:
            load.in_service -= 1
    load.served += 1
    return {"job": job, "status": "done"}


def service_load() -> dict[str, Any]:
    """What overloaded_service saw in this process: attempts, rejections, peak load (read-only)."""
    load = _service()
    span = (load.last_at - load.first_at) if load.first_at is not None and load.last_at is not None else 0.0
    peak_window = max(load.per_window.values(), default=0)
    return {
        "capacity": load.capacity,
        "attempts": load.attempts,
        "rejected": load.rejected,
        "served": load.served,
        "in_service": load.in_service,
        "peak_in_service": load.peak_in_service,
        "peak_attempts_per_s": round(peak_window / _WINDOW, 1),
        "mean_attempts_per_s": round(load.attempts / span, 1) if span > 0 else float(load.attempts),
        "seconds": round(span, 3),
    }
