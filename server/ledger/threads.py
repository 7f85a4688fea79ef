"""OS-level names for commitgate's own threads, so `top -H`, `ps -L` and /proc tell them apart.

Python 3.11 keeps a thread's name to itself: the kernel sees every thread as "python". Each of
commitgate's threads calls `name_os_thread()` first thing in its run; the kernel allows 15 bytes,
so "commitgate-" becomes "cg-" and the rest is cut: "commitgate-ledger-writer" -> "cg-ledger-write".
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import sys
import threading
from typing import Any

_PR_SET_NAME = 15  # prctl(2)
_LIMIT = 15  # bytes, not counting the terminating NUL


def os_thread_name(name: str) -> str:
    """The name the kernel shows for a thread of commitgate named `name` in Python."""
    if name.startswith("commitgate-"):
        name = "cg-" + name.removeprefix("commitgate-")
    return name.encode()[:_LIMIT].decode(errors="ignore")


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def name_os_thread() -> None:
    """Give the calling thread its Python name at OS level (Linux only; elsewhere nothing happens)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):  # no libc to load: the thread keeps the process's name
        _libc().prctl(_PR_SET_NAME, os_thread_name(threading.current_thread().name).encode(), 0, 0, 0)
