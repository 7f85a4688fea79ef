"""Argument types the commands share (argparse `type=` callables that say what is wrong)."""

from __future__ import annotations

import argparse


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number: use 0-65535 (0 picks a free one)")
    return port
