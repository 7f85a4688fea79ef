"""Argument types the commands share (argparse `type=` callables that say what is wrong)."""

from __future__ import annotations

import argparse
import ipaddress
import re

# A DNS name as RFC 1123 allows: dot-separated labels of letters, digits and inner hyphens.
_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number: use 0-65535 (0 picks a free one)")
    return port


def host_address(text: str) -> str:
    """An argparse type: an IP address (IPv6 with or without brackets) or a host name to listen on."""
    try:
        ipaddress.ip_address(text.strip("[]"))
        return text
    except ValueError:
        pass
    if len(text) <= 253 and _HOST_NAME.fullmatch(text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a host: give an IP address such as 127.0.0.1 or 0.0.0.0, or a host name"
    )
