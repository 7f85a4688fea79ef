"""A durable engine's worker, killed after its tool acted and before the engine recorded it, then resumed.

    python engine_worker.py CONFIG_JSON

CONFIG keys: engine ("dbos" or "langgraph"), modes (["direct", "gate"]: the tool called in this
process, or through commitgate at `url`), kills (kill points per mode), root (the directory of
the engine's files; the record and kill files are in $COMMITGATE_ENGINES_DIR).

The process imports its engine's module (engine_dbos.py or engine_langgraph.py) once, then forks
one child per run, so each run starts warm:
1. a calibration run per mode counts the Python call events between the tool's answer and the
   engine's write of the result (the window a crash can fall in);
2. one child per kill point (all at once) runs the workflow and SIGKILLs itself at its point:
   0 = inside the tool, right after the effect is committed (through commitgate: the tool, in the
   server, kills the worker, whose answer is lost); n > 0 = the n-th call event after the answer,
   spread over the calibrated window, the last one as the engine starts writing;
3. one child per kill point (all at once) resumes the run from the engine's durable state
   (DBOS: `DBOS.launch()` recovers the workflow; LangGraph: the thread is invoked again).
It starts once a line arrives on stdin (the server it calls is ready).

Prints one JSON line: per order, its kill point, how its crash run ended and its resume's exit code.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine_common as common
from tools_e2e import engines

CONFIG: dict[str, Any] = json.loads(sys.argv[1])
ROOT = Path(CONFIG["root"])
ENGINE = importlib.import_module(f"engine_{CONFIG['engine']}")  # only this engine's imports


def child(phase: str, mode: str, order: str, point: int | None) -> int:
    kill = common.KillPoint(ROOT, order, point, inert=phase == "resume")
    common.CURRENT = common.Run(ROOT, order, mode == "gate", CONFIG.get("url", ""), kill)
    if point == 0 and phase == "crash":
        (Path(os.environ[engines.ENV_DIR]) / f"kill-{order}").write_text(str(os.getpid()))
    ENGINE.run(phase)
    return 0 if phase != "crash" else 4  # a crash run that finishes missed its kill point


CPU: dict[str, float] = {}  # CPU seconds of each phase's children


def fork_all(runs: list[tuple[str, str, str, int | None]]) -> dict[str, str]:
    """Runs each (phase, mode, order, point) in its own forked child, all at once: how each ended."""
    pids: dict[int, str] = {}
    for phase, mode, order, point in runs:
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                code = child(phase, mode, order, point)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = order
    ended: dict[str, str] = {}
    while pids:
        pid, status, usage = os.wait4(-1, 0)
        CPU[runs[0][0]] = round(CPU.get(runs[0][0], 0.0) + usage.ru_utime + usage.ru_stime, 2)
        signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        ended[pids.pop(pid)] = f"signal {signum}" if signum else f"exit {os.WEXITSTATUS(status)}"
    return ended


def spread(window: int, kills: int) -> list[int]:
    """Kill point 0 (in the tool), then kills-1 points over the window's call events, its end included."""
    steps = kills - 1
    return [0, *sorted({max(1, round(window * i / steps)) for i in range(1, steps + 1)})]


def main() -> None:
    engine, modes, kills = CONFIG["engine"], CONFIG["modes"], int(CONFIG["kills"])
    sys.stdin.readline()  # imported: wait for the commitgate server to be ready
    gc.freeze()  # the children share the imported modules' pages instead of copying them
    started = time.monotonic()
    timings: dict[str, float] = {}

    def lap(name: str) -> None:
        timings[name] = round(time.monotonic() - started, 2)

    calibration = fork_all([("calibrate", mode, f"{engine}-{mode}-calibrate", None) for mode in modes])
    lap("calibrate")
    points: dict[str, int] = {}
    runs: dict[str, str] = {}
    for mode in modes:
        window = int((ROOT / f"window-{engine}-{mode}-calibrate").read_text())
        for i, point in enumerate(spread(window, kills)):
            order = f"{engine}-{mode}-{i:02d}"
            points[order], runs[order] = point, mode
    if hasattr(ENGINE, "seed"):
        ENGINE.seed(ROOT, f"{engine}-{modes[0]}-calibrate", points)
    crash = fork_all([("crash", runs[o], o, p) for o, p in points.items()])
    lap("crash")
    resume = fork_all([("resume", runs[o], o, None) for o in points])
    lap("resume")
    killed = {
        o: json.loads(path.read_text()) if (path := ROOT / f"killed-{o}").exists() else {"where": "tool"}
        for o in points
    }
    summary = {
        "calibration": calibration,
        "windows": {m: int((ROOT / f"window-{engine}-{m}-calibrate").read_text()) for m in modes},
        "points": points,
        "modes": runs,
        "killed": killed,
        "crash": crash,
        "resume": resume,
        "seconds": timings,
        "cpu": CPU,
    }
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
