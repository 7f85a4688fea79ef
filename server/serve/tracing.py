"""Turning tracing on from the standard OTEL_* variables, and what the `tools/call` span learns.

Tracing is on when the environment asks for a trace exporter
(`OTEL_TRACES_EXPORTER`, or an OTLP endpoint in `OTEL_EXPORTER_OTLP_ENDPOINT` /
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) and the OpenTelemetry SDK is installed
(`pip install 'commitgate[otel]'`); `OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none` keep it off. Everything else (endpoint, headers,
protocol, sampler, resource, batching) is read by the SDK from its own
variables. Without any of them nothing is imported and nothing is traced.

The MCP SDK opens the server span of each `tools/call` (taking its parent from
the request's `_meta`); `annotate`, one of the gateway's call observers, adds
commitgate's view of the answer to it: its code, and the operation's id, state,
replayed and attempts.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from commitgate.server.core.tracing import ATTEMPT, OPERATION_ID, REPLAYED, STATE, span_events
from commitgate.server.model import traces
from commitgate.server.model.events import CallAnswered

log = logging.getLogger("commitgate.tracing")

_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
CODE = "commitgate.code"  # the answer's code, as the call's log line and metrics sample say it


def _nothing() -> None:
    return None


def wanted(environ: Mapping[str, str]) -> list[str]:
    """The trace exporters the environment asks for (none: tracing stays off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = environ.get("OTEL_TRACES_EXPORTER")
    if named is None and not any(environ.get(name) for name in _ENDPOINTS):
        return []
    exporters = [n.strip().lower() for n in (named or "otlp").split(",") if n.strip()]
    return [n for n in exporters if n != "none"]


def configure_from_env(version: str = "", environ: Mapping[str, str] | None = None) -> Callable[[], None]:
    """Turn tracing on if OTEL_* asks for it; return what flushes and stops it at exit."""
    environ = os.environ if environ is None else environ
    names = wanted(environ)
    if not names:
        return _nothing
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning(
            "OTEL_* variables ask for traces, but the OpenTelemetry SDK is not installed: "
            "install it with `pip install 'commitgate[otel]'`. Serving without traces."
        )
        return _nothing
    exporters = [e for e in (_exporter(name, environ) for name in names) if e is not None]
    if not exporters:
        return _nothing
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "commitgate", "service.version": version}))
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # the MCP SDK's own spans (tools/call) use the global provider
    traces.turn_on(provider, version)
    log.info("tracing on: exporting to %s", ", ".join(names))

    def shutdown() -> None:
        traces.turn_off()
        try:
            provider.shutdown()  # flushes what is still batched
        except Exception as exc:
            log.warning("tracing: could not flush the last spans (%s)", type(exc).__name__)

    return shutdown


def _exporter(name: str, environ: Mapping[str, str]) -> Any:
    try:
        if name == "otlp":
            return _otlp(environ)
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            return ConsoleSpanExporter(out=sys.stderr)  # stdout carries MCP under stdio
    except ImportError:
        log.warning(
            "OTEL_TRACES_EXPORTER=%s needs a package that is not installed "
            "(`pip install 'commitgate[otel]'` brings OTLP over HTTP); no traces for it.",
            name,
        )
        return None
    except Exception as exc:  # a bad endpoint or header value: say so, serve on without it
        log.warning("tracing: the %s exporter could not be set up (%s: %s)", name, type(exc).__name__, exc)
        return None
    log.warning("OTEL_TRACES_EXPORTER=%s is not supported here (use otlp or console); ignored", name)
    return None


def _otlp(environ: Mapping[str, str]) -> Any:
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter  # pyright: ignore[reportMissingImports] (optional)

        return GrpcExporter()
    if protocol != "http/protobuf":
        raise ValueError(f"OTLP protocol {protocol!r}; use http/protobuf or grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def annotate(event: CallAnswered) -> None:
    """A `CallObserver`: the current `tools/call` span (the SDK's) gets the answer's code and the
    operation's id, state, replayed and attempts. Never a message, an argument or the principal."""
    if traces.SWITCH.tracer is None:
        return
    try:
        from opentelemetry import trace

        span = trace.get_current_span()
        if not span.is_recording():
            return
        op = event.operation
        if op is None:
            span.set_attribute(CODE, event.code)
            return
        span.set_attributes(
            {
                CODE: event.code,
                OPERATION_ID: op.operation_id,
                STATE: op.state.value,
                REPLAYED: event.replayed,
                ATTEMPT: op.attempts,
            }
        )
    except Exception:  # instrumentation must never break a call
        return


__all__ = ["annotate", "configure_from_env", "install", "span_events", "wanted"]


def install(server: Any) -> None:
    """With tracing off, no middleware at all: not even the SDK's span of each request, which would
    go nowhere."""
    if not traces.enabled():
        from mcp.server._otel import OpenTelemetryMiddleware

        server.middleware[:] = [m for m in server.middleware if not isinstance(m, OpenTelemetryMiddleware)]
