"""Text that came from a client, made safe to print: no terminal escapes, no rich markup.

A session id or an argument can hold `ESC [ ...` sequences that recolour, retitle or clear an
operator's terminal; rich would also read `[bold]` in it as markup. Non-printable characters are
shown as Python escapes (`\\x1b`), and table cells are `Text` objects, never parsed as markup.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

# rich is imported when something is drawn on screen: output for scripts (`--json`) needs none of it.
if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text


def _escape(ch: str) -> str:
    return repr(ch)[1:-1] if ch != "\\" else "\\"


def plain(text: str) -> str:
    """`text` with every non-printable character written as an escape (`\\x1b`, `\\n`, `\\x9b`)."""
    return text if text.isprintable() else "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def cell(text: str | None) -> Text:
    """A table cell that shows `text` literally."""
    from rich.text import Text

    return Text(plain(text or ""))


def visible(text: str) -> str:
    """`text` with every character that does not show as itself but the line break (controls,
    invisible and bidirectional marks such as U+200B and U+202E) written as a \\u escape."""
    return text if text.isprintable() else "".join(_visible(ch) for ch in text)


def _visible(ch: str) -> str:
    return ch if ch.isprintable() or ch == "\n" else f"\\u{ord(ch):04x}"


def json_text(value: Any, *, indent: int | None = 2) -> str:
    """JSON for a terminal: characters JSON leaves raw (DEL, C1 controls, bidi marks...) become \\u escapes."""
    return visible(json.dumps(value, indent=indent, ensure_ascii=False, default=str))


def console() -> Console:
    from rich.console import Console

    out = Console(highlight=False)
    if not out.is_terminal:
        out.width = max(out.width, 200)  # piped output: do not fold tables at 80 columns
    return out
