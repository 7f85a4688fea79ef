"""JSON with comments (JSONC), as VS Code writes its `mcp.json` and `settings.json`.

`//` and `/* */` comments and a trailing comma before `}` or `]` are allowed; inside a string they are
text (`"http://host//path"` stays as it is). The reader blanks them out and hands the rest to `json`,
so an error still points at the line and column of the original text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Jsonc:
    """A parsed document, and whether its text had comments (a rewrite as JSON drops them)."""

    value: Any
    had_comments: bool


def loads(text: str) -> Jsonc:
    """Parse JSONC; raises `json.JSONDecodeError` (line and column as in `text`)."""
    plain, had_comments = strip(text)
    return Jsonc(json.loads(plain), had_comments)


def strip(text: str) -> tuple[str, bool]:
    """`text` as plain JSON of the same length and lines: comments and trailing commas become blanks."""
    out = list(text)
    had_comments = False
    last_comma: int | None = None  # a comma after a value, with only blanks and comments after it so far
    previous = ""  # the last character outside strings and comments that is not a blank
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i = _string_end(text, i)
            last_comma, previous = None, c
            continue
        if text.startswith("//", i) or text.startswith("/*", i):
            end = _comment_end(text, i)
            _blank(out, i, end)
            had_comments, i = True, end
            continue
        if c in "}]" and last_comma is not None:
            out[last_comma] = " "
        if not c.isspace():
            last_comma = i if c == "," and previous not in "{[," else None
            previous = c
        i += 1
    return "".join(out), had_comments


def _string_end(text: str, start: int) -> int:
    """The index after the closing quote of the string opening at `start` (or the end of the text)."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return len(text)  # unterminated: `json` reports it where it starts


def _comment_end(text: str, start: int) -> int:
    if text.startswith("//", start):
        end = text.find("\n", start)
        return len(text) if end < 0 else end
    end = text.find("*/", start + 2)
    if end < 0:
        raise json.JSONDecodeError("unterminated /* comment", text, start)
    return end + 2


def _blank(out: list[str], start: int, end: int) -> None:
    """Spaces in place of a comment, its line breaks kept so positions after it stay true."""
    for i in range(start, end):
        if out[i] not in "\r\n":
            out[i] = " "
