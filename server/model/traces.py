"""The trace switch, shared by every layer: off (None) unless tracing was configured.

Instrumented code reads `SWITCH.tracer` and does nothing more when it is None,
so a server without OpenTelemetry configured pays one attribute read per
instrumented step. The OpenTelemetry API is imported only once tracing is on.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any


class _Switch:
    __slots__ = ("tracer",)

    def __init__(self) -> None:
        self.tracer: Any = None  # an opentelemetry Tracer while tracing is on


SWITCH = _Switch()
TRACER_NAME = "commitgate"


def turn_on(provider: Any, version: str = "") -> None:
    """Trace with `provider` (an OpenTelemetry TracerProvider) from now on."""
    SWITCH.tracer = provider.get_tracer(TRACER_NAME, version or None)


def turn_off() -> None:
    SWITCH.tracer = None


def enabled() -> bool:
    return SWITCH.tracer is not None


def inject(carrier: MutableMapping[str, Any]) -> None:
    """Add the current trace context (`traceparent`, `tracestate`) to outgoing headers or `_meta`."""
    if SWITCH.tracer is None:
        return
    from opentelemetry.propagate import inject as otel_inject

    otel_inject(carrier)
