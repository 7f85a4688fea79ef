"""`commitgate bench --only tracing`: what tracing costs a guarded call.

The same guarded no-op through three servers, calls interleaved one by one as in the overhead
suite: tracing off (no OTEL_* variables, the SDK installed), OTEL_* set but the SDK not installed
(the import blocked: the server warns and serves untraced), and tracing on, exporting every span
over OTLP/HTTP with the default batch processor to a sink in this process that accepts and drops.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mcp import StdioServerParameters

from commitgate.server.bench.overhead import NO_FSYNC_POLICY, _paired, _round, _Variant, keyed_arguments
from commitgate.server.bench.stats import spread
from commitgate.server.bench.workspace import Bench, BenchError, cpu_seconds

# A server whose `import opentelemetry.sdk` fails, as on an install without the `otel` extra.
_WITHOUT_SDK = (
    "import sys; sys.modules['opentelemetry.sdk'] = None; "
    "from commitgate.server.cli.main import main; sys.exit(main())"
)


@contextlib.contextmanager
def otlp_sink() -> Iterator[dict[str, int]]:
    """An OTLP/HTTP endpoint that answers 200 to every export and counts requests and bytes."""
    seen = {"requests": 0, "bytes": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            size = int(self.headers.get("Content-Length", "0"))
            self.rfile.read(size)
            seen["requests"] += 1
            seen["bytes"] += size
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    seen["port"] = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield seen
    finally:
        server.shutdown()
        server.server_close()


def _sdk_installed() -> bool:
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        return False
    return True


async def tracing_cost(bench: Bench) -> dict[str, Any]:
    scale = bench.scale
    if not _sdk_installed():
        return {"skipped": "the OpenTelemetry SDK is not installed: pip install 'commitgate[otel]'"}
    tick = bench.task("tracing cost", scale.rounds)
    # No fsync per commit: what tracing adds is CPU work, which a durable commit's sync would hide.
    policy = bench.policy("tracing", NO_FSYNC_POLICY)
    with otlp_sink() as sink:
        otel = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink['port']}",
            "OTEL_SERVICE_NAME": "bench",
        }
        off = bench.serve(policy, bench.ledger("tracing-off"))
        on = bench.serve(policy, bench.ledger("tracing-on"), env=otel)
        missing = bench.serve(policy, bench.ledger("tracing-no-sdk"), env=otel)
        missing = StdioServerParameters(
            command=sys.executable, args=["-c", _WITHOUT_SDK, *missing.args[2:]], env=missing.env
        )
        servers = {"off": off, "sdk_not_installed": missing, "on": on}
        ledgers = {"off": "tracing-off", "sdk_not_installed": "tracing-no-sdk", "on": "tracing-on"}
        async with bench.connect_all(servers) as clients:
            run = uuid.uuid4().hex[:8]
            variants = [
                _Variant(name, client, "noop_keyed", keyed_arguments(f"{run}-{name}"), False)
                for name, client in clients.items()
            ]
            for variant in variants:
                for i in range(scale.warm_up_calls):
                    await variant.client.call_tool(variant.tool, variant.arguments(-1, i))
            pids = {name: bench.server_pid(bench.ledger(ledger)) for name, ledger in ledgers.items()}
            cpu_before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
            for round_no in range(scale.rounds):
                await _round(variants, round_no, scale.calls_per_round)
                tick(1)
            calls = scale.rounds * scale.calls_per_round
            cpu_us = {n: round((_cpu_seconds(p) - cpu_before[n]) / calls * 1e6, 1) for n, p in pids.items()}
        exported = dict(sink)
    by_name = {v.name: v for v in variants}
    return {
        "rounds": scale.rounds,
        "calls_per_round": scale.calls_per_round,
        "call": "a guarded no-op (key-required, a new key each time, SQLite ledger with synchronous=NORMAL)",
        "per_call_us": {n: spread([statistics.median(r) for r in v.samples], 1) for n, v in by_name.items()},
        "server_cpu_us_per_call": cpu_us,
        "ratios": {
            "on_over_off": _paired(by_name["on"], by_name["off"]),
            "sdk_not_installed_over_off": _paired(by_name["sdk_not_installed"], by_name["off"]),
        },
        "exported": {"requests": exported["requests"], "bytes": exported["bytes"]},
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a server (its threads included: the span exporter's too)."""
    seconds = cpu_seconds(pid)
    if seconds is None:
        raise BenchError(f"server process {pid} is gone: its CPU time cannot be read")
    return seconds
