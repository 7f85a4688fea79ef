"""Budgets: what each budget of the console's policy has spent, per scope, against its limit, and a
chart of the spending over its window.

The figures come from core/budgets.py's `budget_report`, the one `commitgate ops budgets` prints, so
both always agree. A principal's sign-in sees only its own scopes; of a budget shared by everyone
(`per = "all"`) it sees the total against the limit (what its agent is told in `budget_exceeded`
anyway) but only its own share in the chart and the operation count: when others spent is theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from commitgate.server.console.pages.base import Page, identity_of, ledger_of, now, policy_of
from commitgate.server.console.rendering import render
from commitgate.server.core.budgets import budget_report, span_for, spending_over_window
from commitgate.server.ledger.base import Ledger, SpentIn
from commitgate.server.model.amounts import ZERO, decimal_of, grouped, number
from commitgate.server.model.durations import format_duration
from commitgate.server.policy.budgets import BudgetPolicy

SHOWN = 20  # scopes per budget, highest spent first; `commitgate ops budgets` lists them all
CHART_HEIGHT = 40.0  # the chart's drawing units: each span is one unit wide plus a gap
BAR_WIDTH = 8.0
BAR_STEP = 10.0


@dataclass(frozen=True, slots=True)
class Bar:
    """One span of a chart, placed in the SVG's own units, and what it says in words."""

    x: float
    y: float
    height: float
    spent: int | float
    operations: int
    label: str


@dataclass(frozen=True, slots=True)
class Chart:
    bars: list[Bar]
    width: float
    height: float
    span: str  # "hour", "day", "15 min": what one bar covers
    summary: str  # the chart in one sentence, for screen readers and as its caption


@dataclass(frozen=True, slots=True)
class ScopeView:
    scope: str
    spent: int | float  # against the limit: for a principal's view of an "all" budget, everyone's
    left: int | float
    operations: int | None  # None: not this sign-in's to see (other principals' operations)
    percent: float  # of the limit, for the bar (capped at 100; the text says the rest)
    over: bool
    own: int | float | None  # a principal's share of an "all" budget; None otherwise
    chart: Chart


def figure(value: Decimal | int | float, unit: str | None = None) -> str:
    """An amount as people read it: thousands separated, exact, with the budget's unit."""
    return grouped(value, unit)


def share(percent: float, over: bool) -> str:
    """A share of the limit in words: never "0 %" for something spent, never past 100 unless over."""
    if over:
        return "over 100 %"
    if 0 < percent < 1:
        return "under 1 %"
    return f"{percent:.0f} %"


def span_name(seconds: float) -> str:
    for unit, name in ((7 * 86400, "week"), (86400, "day"), (3600, "hour"), (60, "minute")):
        if seconds % unit == 0:
            count = int(seconds // unit)
            return name if count == 1 else f"{count} {name}s"
    return format_duration(seconds)


def span_label(start: float, seconds: float) -> str:
    at = datetime.fromtimestamp(start, UTC)
    return at.strftime("%Y-%m-%d" if seconds >= 86400 else "%Y-%m-%d %H:%M") + " UTC"


def chart_of(spans: list[SpentIn], span: float, whose: str, unit: str | None = None) -> Chart:
    """Bars scaled to the busiest span (not the limit: small spending must still show)."""
    top = float(max((s.spent for s in spans), default=ZERO))  # drawing units: a float is exact enough
    bars = []
    for i, s in enumerate(spans):
        height = 0.0 if top <= 0 else max(CHART_HEIGHT * float(s.spent) / top, 1.0 if s.spent > 0 else 0.0)
        label = span_label(s.start, span)
        bars.append(Bar(i * BAR_STEP, CHART_HEIGHT - height, height, number(s.spent), s.operations, label))
    name = span_name(span)
    busiest = max(spans, key=lambda s: s.spent, default=None)
    if busiest is None or busiest.spent <= 0:
        summary = f"{whose} per {name}: nothing spent within the window."
    else:
        summary = (
            f"{whose} per {name} over the window, {len(spans)} bars; the most, "
            f"{figure(busiest.spent, unit)}, in the {name} from {span_label(busiest.start, span)}."
        )
    return Chart(
        bars, max(len(spans) * BAR_STEP - (BAR_STEP - BAR_WIDTH), BAR_WIDTH), CHART_HEIGHT, name, summary
    )


async def scope_view(
    ledger: Ledger,
    name: str,
    budget: BudgetPolicy,
    row: dict[str, Any],
    viewer: frozenset[str] | None,
    at: float,
) -> ScopeView:
    """One scope's figures and chart. `viewer`: the principals signed in for (None: every principal)."""
    span = span_for(budget.window)
    own = None
    if budget.per == "all" and viewer is not None:
        spans = await own_spending(ledger, name, budget, viewer, at)
        own = number(sum((s.spent for s in spans), ZERO))
        operations, whose = None, "Your spending"
    else:
        spans = await spending_over_window(ledger, name, budget, row["principal"], row["session"], at)
        operations, whose = row["operations"], "Spending"
    spent, limit = decimal_of(row["spent"]), budget.limit
    return ScopeView(
        scope=row["scope"],
        spent=row["spent"],
        left=row["left"],
        operations=operations,
        percent=100.0 if limit <= 0 else min(100.0, float(100 * spent / limit)),
        over=spent > limit,
        own=own,
        chart=chart_of(spans, span, whose, budget.unit),
    )


async def own_spending(
    ledger: Ledger, name: str, budget: BudgetPolicy, viewer: frozenset[str], at: float
) -> list[SpentIn]:
    """What the viewer's principals spent of a shared budget, span by span (their spans coincide)."""
    each = [await spending_over_window(ledger, name, budget, p, None, at) for p in sorted(viewer)]
    return [
        SpentIn(spans[0].start, sum((s.spent for s in spans), ZERO), sum(s.operations for s in spans))
        for spans in zip(*each, strict=True)
    ]


def visible(rows: list[dict[str, Any]], per: str, viewer: frozenset[str] | None) -> list[dict[str, Any]]:
    """The scopes this sign-in may see: all of them, or its principals' (and the "all" total)."""
    if viewer is None or per == "all":
        return rows
    return [row for row in rows if row["principal"] in viewer]


async def budgets_page(request: Request) -> Response:
    policy = policy_of(request)
    if policy is None or not policy.budgets:
        return render(request, "budgets.html", title="Budgets", budgets=[], has_policy=policy is not None)
    ledger, viewer, at = ledger_of(request), identity_of(request).principals, now()
    shown = []
    for entry in await budget_report(ledger, policy, at):
        budget = policy.budgets[entry["name"]]
        rows = visible(entry["scopes"], budget.per, viewer)
        if budget.per == "all" and not rows:  # one scope shared by everyone: shown even at zero
            rows = [
                {
                    "scope": "all",
                    "principal": None,
                    "session": None,
                    "spent": 0,
                    "left": entry["limit"],
                    "operations": 0,
                }
            ]
        scopes = [await scope_view(ledger, entry["name"], budget, row, viewer, at) for row in rows[:SHOWN]]
        shown.append({**entry, "shown": scopes, "hidden": len(rows) - len(scopes)})
    return render(
        request,
        "budgets.html",
        title="Budgets",
        budgets=shown,
        has_policy=True,
        shown_at_most=SHOWN,
        figure=figure,
        share=share,
        bar_width=BAR_WIDTH,
        all_principals=viewer is None,
    )


PAGE = Page(label="Budgets", path="/budgets", routes=[Route("/budgets", budgets_page, methods=["GET"])])
