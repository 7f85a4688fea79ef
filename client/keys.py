"""Idempotency keys from a framework's or engine's own durable identity.

A key must be 1-255 characters of `[A-Za-z0-9._:@/+=-]` (docs/contract.md). The ids that
frameworks and durable engines hand out (a model's tool call id such as `call_Jx9…`, a DBOS step
number, a LangGraph thread id) do not always fit, so `step_key` joins them with `:` and escapes
any other character as `=XX` (its UTF-8 bytes in hex). The same parts always give the same key,
and different parts never give the same key; a key that would be too long keeps its start and
ends in a digest of the whole.
"""

from __future__ import annotations

import hashlib
import re

MAX_KEY = 255
_PLAIN = re.compile(r"[A-Za-z0-9.@/+-]")  # key characters except the separator ':' and the escape '='
_DIGEST = 32  # hex characters of SHA-256 kept at the end of an over-long key


def step_key(*parts: str | int) -> str:
    """The key naming one action: `parts` (e.g. an engine's step id and a tool name) escaped and joined."""
    key = ":".join(_escape(str(part)) for part in parts)
    if not key:
        raise ValueError("step_key needs a non-empty part, e.g. the model's tool call id")
    if len(key) <= MAX_KEY:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()[:_DIGEST]
    return f"{key[: MAX_KEY - _DIGEST - 1]}={digest}"


def _escape(part: str) -> str:
    return "".join(ch if _PLAIN.fullmatch(ch) else "".join(f"={b:02X}" for b in ch.encode()) for ch in part)
