"""How `commitgate bench` reads what bounds a missed load figure: pure functions on sample figures."""

from __future__ import annotations

from typing import Any

import pytest

from commitgate.server.bench import report
from commitgate.server.bench.bounds import level_bound, untimed_reading
from commitgate.server.bench.procstat import Sample, Tally
from commitgate.server.bench.profile import ROOMS, room_of, shares
from commitgate.server.bench.syscalls import per_call, summary_counts

# --- the profile, by room ---------------------------------------------------------------------------------------

_LOOP = "_run_module_as_main (<frozen runpy>:198);BaseEventLoop._run_once (asyncio/base_events.py:1922)"
_HTTP = f"{_LOOP};RequestResponseCycle.run_asgi (uvicorn/protocols/http/h11_impl.py:404)"
_SURFACE = f"{_HTTP};LeanCalls.__call__ (server/serve/http_calls.py:135)"
_CORE = f"{_SURFACE};Boundary.call (server/core/boundary.py:88)"
_WRITER = "Thread._bootstrap (threading.py:1002);Writer.run (server/ledger/sqlite/_writer.py:199)"


@pytest.mark.parametrize(
    ("file", "room"),
    [
        ("starlette/applications.py", "http_transport"),
        ("/venv/lib/python3.11/site-packages/mcp/server/streamable_http.py", "http_transport"),
        ("mcp/server/lowlevel/server.py", "http_transport"),
        ("server/serve/http.py", "mcp_surface"),
        ("commitgate/server/core/boundary.py", "commit_boundary"),
        ("/venv/lib/python3.11/site-packages/commitgate/server/ledger/sqlite/_writes.py", "ledger"),
        ("server/ledger/evidence.py", "receipts"),
        ("server/model/receipts.py", "receipts"),
        ("json/encoder.py", None),  # a library: counts for its caller
        ("server/model/canonical.py", None),
    ],
)
def test_each_source_file_has_its_room(file: str, room: str | None) -> None:
    assert room_of(file) == room


def test_the_profile_gives_each_sample_to_the_innermost_room_on_its_stack() -> None:
    raw = [
        f"{_HTTP};dumps (json/__init__.py:231) 10",  # json called by the transport: the transport's
        f"{_SURFACE};validate_python (pydantic/type_adapter.py:410) 20",
        f"{_CORE};to_thread (anyio/to_thread.py:50) 15",  # the boundary's call into anyio stays the boundary's
        f"{_WRITER};run_writes (server/ledger/sqlite/_writes.py:40);execute (sqlite3:0) 30",
        f"{_WRITER};seal_sqlite (server/ledger/evidence.py:120) 5",
        f"{_LOOP};CancelScope._deliver_cancellation (anyio/_backends/_asyncio.py:638) 10",  # no room above
        "Thread._bootstrap (threading.py:1002);Thread.run (threading.py:975) 10",  # nothing known at all
        f"{_LOOP};_find_and_load (<frozen importlib._bootstrap>:1176);<module> (server/core/x.py:1) 99",  # start-up
        "not a line",
    ]
    figures = shares(raw)
    assert figures["samples"] == 100
    assert figures["rooms"] == {
        "http_transport": 0.1,
        "mcp_surface": 0.2,
        "commit_boundary": 0.15,
        "ledger": 0.3,
        "receipts": 0.05,
        "event_loop": 0.1,
        "other": 0.1,
    }


def test_an_empty_profile_has_no_shares() -> None:
    assert shares([]) == {"samples": 0, "rooms": dict.fromkeys(ROOMS, 0.0)}


# --- system calls and /proc counters ----------------------------------------------------------------------------

_STRACE_TABLE = """\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 61.20    0.120000         600       200           fdatasync
 20.00    0.040000          10      4000       120 futex
  8.00    0.016000           4      4000           sendto
  5.00    0.010000           2      5000       900 recvfrom
  3.00    0.006000           3      2000           epoll_wait
  2.00    0.004000           2      2000           pwrite64
  0.80    0.001600           1      1000           read
------ ----------- ----------- --------- --------- ----------------
100.00    0.197600                 18200      1020 total
"""


def test_strace_table_is_read_into_kinds_per_call() -> None:
    counts = summary_counts(_STRACE_TABLE)
    assert counts["fdatasync"] == 200 and counts["futex"] == 4000 and "total" not in counts
    assert per_call(counts, 100) == {
        "disk_syncs": 2.0,
        "reads": 60.0,  # recvfrom and read
        "writes": 60.0,  # sendto and pwrite64
        "epoll_waits": 20.0,
        "futex": 40.0,
        "all": 182.0,
    }


def test_tally_sums_each_blocks_difference_by_thread() -> None:
    tally = Tally()
    before = Sample({"event loop": 1.0, "ledger writer": 0.5}, 100, 10, 20, machine_busy_s=100.0)
    after = Sample({"event loop": 1.8, "ledger writer": 0.7, "other threads": 0.1}, 300, 30, 60, 103.0)
    tally.add(before, after)
    tally.add(before, after)
    figures = tally.figures(wall_s=2.0, calls=40)
    assert figures["thread_cpu_cores"] == {
        "event loop": 0.8,
        "ledger writer": 0.2,
        "checkpointer": 0.0,
        "other threads": 0.1,
    }
    assert figures["machine_cpu_cores"] == 3.0  # 2 × 3 s of the machine's CPU in 2 s
    assert figures["context_switches_per_call"] == 10.0
    assert (figures["read_syscalls_per_call"], figures["write_syscalls_per_call"]) == (1.0, 2.0)


# --- the sentences ------------------------------------------------------------------------------------------------


def _server(
    calls: float, p99: float, server: float, client: float, loop: float, writer: float
) -> dict[str, Any]:
    return {
        "calls_per_s": calls,
        "p99_ms": p99,
        "server_cpu_cores": server,
        "client_cpu_cores": client,
        "server_cpu_us_per_call": server / calls * 1e6,
        "context_switches_per_call": 3.0,
        "thread_cpu_cores": {
            "event loop": loop,
            "ledger writer": writer,
            "checkpointer": 0.0,
            "other threads": 0.0,
        },
    }


def _level(ratio: float, guarded: dict[str, Any], sessions: int = 64) -> dict[str, Any]:
    plain = _server(1000.0, 40.0, 0.9, 0.6, 0.9, 0.0)
    return {
        "sessions": sessions,
        "guarded_over_plain": {"median": ratio},
        "per_server": {"plain_sdk": plain, "guarded": guarded},
    }


def test_a_missed_level_says_by_how_much() -> None:
    sentence = level_bound(_level(0.6, _server(600.0, 60.0, 0.95, 0.5, 0.85, 0.1)), cpus=4)
    assert "made 0.60 × the plain server's calls per second (40% short: 600 against 1000)" in sentence
    assert "its p99 was 60.0 ms against 40.0 ms (50% longer)" in sentence
    assert "1583 µs of CPU per call against the plain server's 900 µs" in sentence


@pytest.mark.parametrize(
    ("guarded", "cpus", "bound"),
    [
        (_server(600.0, 40.0, 0.95, 0.5, 0.85, 0.1), 4, "the event loop's thread is near a whole core"),
        (_server(600.0, 40.0, 0.6, 0.9, 0.5, 0.1), 4, "the client is the busier process"),
        (_server(600.0, 40.0, 0.3, 0.2, 0.25, 0.05), 4, "neither process kept half a core busy"),
        (_server(600.0, 40.0, 1.1, 0.8, 0.7, 0.4), 2, "together they filled the machine's 2 cores"),
        (
            {**_server(600.0, 40.0, 0.3, 0.2, 0.25, 0.05), "machine_cpu_cores": 1.9},
            2,
            "and other processes 1.40: the machine's 2 cores were full, so its other work bounds",
        ),
        (_server(600.0, 40.0, 0.7, 0.4, 0.3, 0.4), 4, "the ledger writer (the busier of the two)"),
    ],
)
def test_a_missed_level_names_what_bounds_it(guarded: dict[str, Any], cpus: int, bound: str) -> None:
    assert bound in level_bound(_level(0.6, guarded), cpus)


def test_a_level_missed_only_by_its_tail_says_only_that() -> None:
    sentence = level_bound(_level(1.2, _server(1200.0, 50.0, 0.95, 0.5, 0.85, 0.1)), cpus=4)
    assert "short" not in sentence and "(25% longer)" in sentence


def test_the_untimed_block_is_read_room_by_room_and_syscall_by_syscall() -> None:
    bounds = {
        "sessions": 64,
        "profile": {
            "plain_sdk": shares(
                ["starlette/applications.py (starlette/applications.py:1) 9", "x (x.py:1) 1"]
            ),
            "guarded": {
                "samples": 500,
                "rooms": {"http_transport": 0.4, "commit_boundary": 0.3, "ledger": 0.27, "other": 0.03},
            },
        },
        "syscalls_per_call": {
            "plain_sdk": {"reads": 1.0, "writes": 2.0, "epoll_waits": 2.5},
            "guarded": {"disk_syncs": 0.3, "reads": 3.0, "writes": 5.0, "epoll_waits": 4.0, "futex": 9.0},
        },
    }
    text = untimed_reading(bounds)
    assert text.startswith("Measured untimed at 64 sessions")
    assert "40% HTTP transport, 30% commit boundary, 27% ledger (500 samples)" in text  # 3 % left out
    assert "90% HTTP transport, 10% other (10 samples)" in text
    assert "0.3 disk syncs, 3.0 reads, 5.0 writes, 4.0 epoll waits, 9.0 futex calls (strace)" in text
    bounds["profile"] = {"note": "no profile: py-spy is not installed (pip install py-spy)"}
    bounds["syscalls_per_call"] = {"note": "system calls not counted: strace is not installed"}
    text = untimed_reading(bounds)
    assert "py-spy is not installed" in text and "strace is not installed" in text


def test_the_missed_load_target_is_explained_with_every_level_missed_and_in_the_json() -> None:
    load = {
        "levels": [
            _level(1.1, _server(1100.0, 30.0, 0.9, 0.6, 0.8, 0.1), sessions=8),
            _level(0.7, _server(700.0, 80.0, 0.95, 0.5, 0.85, 0.1), sessions=64),
        ],
        "bounds": {
            "sessions": 64,
            "profile": {"note": "no profile"},
            "syscalls_per_call": {"note": "no strace"},
        },
    }
    results: dict[str, Any] = {"meta": {"cpus": 4}, "load": load}
    results["goals"] = report.goals(results)
    judged = results["goals"]["cost_under_load"]
    assert "bounded_by" not in judged["levels"][0]
    assert judged["levels"][1]["bounded_by"].startswith("at 64 sessions")
    assert judged["what_bounds_it"] == "Measured untimed at 64 sessions: no profile; no strace."
    [note] = report.missed_notes(results)
    assert "At 64 sessions the guarded server made 0.70 ×" in note and "At 8 sessions" not in note
    assert note.endswith("no profile; no strace.")
