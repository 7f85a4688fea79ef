"""Prometheus metrics: the boundary's events, calls, ledger latency, and operations by state.

`Metrics` observes a gateway's events: the boundary's (`__call__`, an `Observer`) and
each answered call's (`answered`, a `CallObserver`); `attach` chains both onto a gateway. Per event it does one dict lookup
and one `inc()` on a pre-resolved labelled child: no locks beyond
prometheus_client's own, no I/O. Operations by state are not counted as they
happen (several processes may share one ledger): they are read from
`ledger.counts()` when `/metrics` is scraped.

Label values are bounded and never carry what a client chose: tools and budgets
come from the policy, classes, codes, states, outcomes and verdicts from fixed
sets, principals from the policy's tokens (at most MAX_BUDGET_PRINCIPALS per
budget, the biggest spenders). No label carries a session id, a key or an
argument value (docs/policy.md#budgets): a `per = "session"` budget exports its
limit and how many sessions are near it, not what each spent. A call to a tool
the policy does not serve is counted as `tool="(unknown)"` so clients cannot
grow the series.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from decimal import Decimal
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from commitgate.server.core.boundary import CommitBoundary
from commitgate.server.ledger.base import (
    Ledger,
)
from commitgate.server.model.events import BoundaryEvent, CallAnswered, CallObserver, Event
from commitgate.server.policy.budgets import BudgetPolicy

log = logging.getLogger("commitgate.metrics")
T = TypeVar("T")

CONTENT_TYPE = CONTENT_TYPE_LATEST
CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
LEDGER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_TC = ("tool", "idempotency_class")
MAX_BUDGET_PRINCIPALS = 100  # spent series per budget: the principals who spent most
SPENT_METRIC = "commitgate_budget_spent"
NEAR_LIMIT = Decimal("0.9")  # a session "near" its budget's limit has spent this share of it (the alert's)

# `*_created` timestamps double the exposition for nothing a scraper needs (process-wide setting).
disable_created_metrics()


class Observed(Protocol):
    """What metrics attach to (a gateway): its boundary, its call observers, its calls in flight."""

    boundary: CommitBoundary
    call_observers: list[CallObserver]
    answering: int


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.calls = Counter(
            "commitgate_calls", "tools/call requests by answer code", [*_TC, "code"], registry=r
        )
        self.call_seconds = Histogram(
            "commitgate_call_seconds", "Time to answer a tools/call", _TC, buckets=CALL_BUCKETS, registry=r
        )
        self.in_progress = Gauge(
            "commitgate_calls_in_progress", "tools/call requests being answered", registry=r
        )
        counter = self._event_counter
        # event kind -> (counter, what its extra label reads from the event, or None)
        self._by_event: dict[Event, tuple[Counter, Callable[[BoundaryEvent], StrEnum | None] | None]] = {
            Event.REPLAY: (counter("replays", "Answers replayed from the ledger"), None),
            Event.CONFLICT: (counter("conflicts", "Keys reused with another tool or other arguments"), None),
            Event.RETRY: (counter("retries", "Automatic retries after a failed attempt"), None),
            Event.ATTEMPT: (counter("attempts", "Executions by outcome", "outcome"), lambda e: e.outcome),
            Event.RECONCILIATION: (
                counter("reconciliations", "Status checks by verdict", "verdict"),
                lambda e: e.verdict,
            ),
            Event.LEASE_EXPIRED: (counter("lease_expiries", "RUNNING operations whose owner stopped"), None),
            Event.COMPLETED: (
                counter("completions", "Operations recorded by final state", "state"),
                lambda e: e.state,
            ),
            Event.LEDGER_UNAVAILABLE: (
                counter("ledger_unavailable", "Calls refused: ledger not writable"),
                None,
            ),
            Event.RESULT_TOO_LARGE: (
                counter("results_too_large", "Results over the ledger's size limit, recorded as failures"),
                None,
            ),
            Event.POSSIBLE_DUPLICATE: (
                counter("duplicates_rejected", "Fresh-key repeats answered possible_duplicate"),
                None,
            ),
            Event.DUPLICATE_ALLOWED: (
                counter("duplicates_allowed", "Fresh-key repeats let through (allow, or confirmed)"),
                None,
            ),
            Event.APPROVAL_REQUESTED: (
                counter("approvals_requested", "Calls recorded to wait for a person's approval"),
                None,
            ),
            Event.APPROVAL_EXPIRED: (
                counter("approvals_expired", "Waits for approval that ran out before anyone decided"),
                None,
            ),
            Event.BUDGET_SPENT: (counter("budget_claims", "Calls that spent from a budget"), None),
            Event.BUDGET_EXCEEDED: (
                counter("budget_exceeded", "Calls past their budget's limit: refused, or sent to a person"),
                None,
            ),
        }
        self.operation_seconds = Histogram(
            "commitgate_operation_seconds",
            "Time from claim to the recorded outcome (time spent RUNNING)",
            [*_TC, "state"],
            buckets=CALL_BUCKETS,
            registry=r,
        )
        self.ledger_seconds = Histogram(
            "commitgate_ledger_seconds", "Ledger step latency", ["method"], buckets=LEDGER_BUCKETS, registry=r
        )
        self.operations = Gauge(
            "commitgate_operations", "Operations in the ledger by state", ["state"], registry=r
        )
        self.ledger_events = Gauge(
            "commitgate_ledger_events", "Audit trail entries by event (all processes)", ["event"], registry=r
        )
        self.ledger_up = Gauge(
            "commitgate_ledger_up", "1 when the last scrape could read the ledger", registry=r
        )
        self.budget_spent = Gauge(
            SPENT_METRIC,
            "What a budget spent within the window, read from the ledger at scrape time: per principal"
            ' for per = "principal" budgets, principal="" for per = "all" ones',
            ["budget", "principal"],
            registry=r,
        )
        self.budget_limit = Gauge(
            "commitgate_budget_limit", "A budget's limit, for each of its scopes", ["budget"], registry=r
        )
        self.budget_sessions_near = Gauge(
            "commitgate_budget_sessions_near_limit",
            f'Sessions of a per = "session" budget that spent at least {float(NEAR_LIMIT):.0%} of its limit',
            ["budget"],
            registry=r,
        )
        # budget -> the principal labels exported for it at the last scrape (to drop the stale ones)
        self._spent_labels: dict[str, set[str]] = {}
        self._limits: set[str] = set()
        self._children: dict[tuple[Any, ...], Any] = {}
        # (tool, class, code) -> its calls counter and its call_seconds histogram: one lookup per call
        self._answered: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def _event_counter(self, name: str, doc: str, extra: str | None = None) -> Counter:
        labels = [*_TC, extra] if extra else list(_TC)
        return Counter(f"commitgate_{name}", doc, labels, registry=self.registry)

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # --- the Observer hook -------------------------------------------------------------------

    def __call__(self, event: BoundaryEvent) -> None:
        try:
            spec = self._by_event.get(event.kind)
            if spec is None:
                return
            counter, extra = spec
            tool, cls = event.tool, event.cls.value
            labels = (tool, cls, str(extra(event) or "")) if extra else (tool, cls)
            self._child(counter, *labels).inc()
            seconds = event.seconds
            if event.kind is Event.COMPLETED and isinstance(seconds, int | float):
                self._child(self.operation_seconds, *labels).observe(seconds)
        except Exception:  # instrumentation must never break a call
            log.debug("metrics observer failed for %s", event.kind, exc_info=True)

    # --- the CallObserver hook ----------------------------------------------------------------

    def answered(self, event: CallAnswered) -> None:
        try:
            labels = (event.tool, event.cls, event.code)
            children = self._answered.get(labels)
            if children is None:
                children = self._answered[labels] = (
                    self._child(self.calls, *labels),
                    self._child(self.call_seconds, *labels[:2]),
                )
            counted, timed = children
            counted.inc()
            timed.observe(event.seconds)
        except Exception:  # instrumentation must never break a call
            log.debug("metrics observer failed for a call to %s", event.tool, exc_info=True)

    def ledger_step(self, method: str, seconds: float) -> None:
        self._child(self.ledger_seconds, method).observe(seconds)

    # --- exposition --------------------------------------------------------------------------

    async def exposition(
        self,
        ledger: Ledger,
        budgets: Mapping[str, BudgetPolicy] | None = None,
        sees: frozenset[str] | None = None,
    ) -> bytes:
        """The Prometheus text format, with operations by state and what budgets spent read from the ledger now.
        `sees`: the principals an operator's token sees (None: every one); what other principals spent is
        left out, as the console leaves it out."""
        try:
            counts = await ledger.counts()
            await self._refresh_budgets(ledger, budgets or {})
        except Exception:
            log.warning("metrics: could not read operation counts or budgets from the ledger")
            self.ledger_up.set(0)
        else:
            self.ledger_up.set(1)
            for state, value in counts.states.items():
                self._child(self.operations, state).set(value)
            for event, value in counts.events.items():
                self._child(self.ledger_events, event).set(value)
        return generate_latest(self.registry if sees is None else _SeenBy(self.registry, sees))

    async def _refresh_budgets(self, ledger: Ledger, budgets: Mapping[str, BudgetPolicy]) -> None:
        """Each declared budget's limit and what it spent: per principal, in total, or (per session)
        how many sessions are near the limit. Series of a budget no longer declared, or of a principal
        whose spending has left the window, are dropped."""
        now = time.time()
        for name in [n for n in self._spent_labels if n not in budgets]:
            self._set_spent(name, {})
        for name in list(self._limits - set(budgets)):
            self._limits.discard(name)
            for metric in (self.budget_limit, self.budget_sessions_near):
                self._children.pop((id(metric), name), None)
                with contextlib.suppress(KeyError):
                    metric.remove(name)
        for name, budget in budgets.items():
            self._child(self.budget_limit, name).set(float(budget.limit))
            self._limits.add(name)
            spent = await ledger.budget_spent(name, budget.per, now - budget.window, now)
            if budget.per == "session":
                near = len([s for s in spent if s.spent >= NEAR_LIMIT * budget.limit])
                self._child(self.budget_sessions_near, name).set(near)
                continue
            biggest = sorted((s for s in spent if s.spent > 0), key=lambda s: s.spent, reverse=True)
            self._set_spent(
                name, {s.principal or "": float(s.spent) for s in biggest[:MAX_BUDGET_PRINCIPALS]}
            )

    def _set_spent(self, budget: str, spent: Mapping[str, float]) -> None:
        for principal in self._spent_labels.pop(budget, set()) - set(spent):
            self._children.pop((id(self.budget_spent), budget, principal), None)
            with contextlib.suppress(KeyError):
                self.budget_spent.remove(budget, principal)
        for principal, value in spent.items():
            self._child(self.budget_spent, budget, principal).set(value)
        if spent:
            self._spent_labels[budget] = set(spent)

    def attach(self, gateway: Observed) -> None:
        """Observe a gateway that was opened without these metrics, and time its ledger's steps."""
        if self not in gateway.boundary.observers:
            gateway.boundary.observers.append(self)
        if self.answered not in gateway.call_observers:
            gateway.call_observers.append(self.answered)
        self.in_progress.set_function(lambda: gateway.answering)
        if gateway.boundary.ledger.timer is None:
            gateway.boundary.ledger.timer = self.ledger_step


class _SeenBy(Collector):
    """The registry as an operator of some principals sees it: the spending of a `per = "principal"`
    budget only for its own principals; a budget shared by all (principal "") shows its total, as
    its agents are told in `budget_exceeded` anyway."""

    def __init__(self, registry: CollectorRegistry, sees: frozenset[str]) -> None:
        self.registry, self.sees = registry, sees

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            if metric.name == SPENT_METRIC:
                seen = Metric(metric.name, metric.documentation, metric.type, metric.unit)
                seen.samples = [
                    s for s in metric.samples if s.labels.get("principal", "") in self.sees | {""}
                ]
                metric = seen
            yield metric
