"""JSON with comments (JSONC), as VS Code writes its `mcp.json` and `settings.json`.

`//` and `/* */` comments and a trailing comma before `}` or `]` are allowed; inside a string they are
text (`"http://host//path"` stays as it is). The reader blanks them out and hands the rest to `json`,
so an error still points at the line and column of the original text. `replace_value` rewrites one
value of such a text and keeps the rest, comments included.
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


# --- rewriting one value in place -------------------------------------------------------------------

_DECODER = json.JSONDecoder()
_BLANKS = " \t\r\n"


def replace_value(text: str, path: tuple[str, ...], value: Any) -> tuple[str, bool]:
    """`text` with the value at `path` (object keys from the top) replaced by `value` as indented JSON,
    every other byte kept, comments included; and whether comments inside the old value were dropped."""
    plain, _ = strip(text)
    start = _blank_end(plain, 0)
    for key in path:
        start = _member(plain, start, key)
    end = _DECODER.raw_decode(plain, start)[1]
    line = text[text.rfind("\n", 0, start) + 1 : start]
    margin = line[: len(line) - len(line.lstrip())]
    unit = margin[: len(margin) // len(path)] if path and len(margin) % len(path) == 0 else ""
    newline = "\r\n" if "\r\n" in text else "\n"  # as the file has them (Windows editors: CRLF)
    written = json.dumps(value, indent=unit or "  ", ensure_ascii=False).replace("\n", newline + margin)
    return text[:start] + written + text[end:], strip(text[start:end])[1]


def _member(plain: str, start: int, key: str) -> int:
    """Where the value of `key` starts in the object at `start` (the last one, as `json` reads it)."""
    if plain[start : start + 1] != "{":
        raise ValueError(f"no object where {key!r} was expected")
    found, i = None, _blank_end(plain, start + 1)
    while plain[i] != "}":
        name, i = _DECODER.raw_decode(plain, i)
        value = _blank_end(plain, _blank_end(plain, i) + 1)  # past the colon
        if name == key:
            found = value
        i = _blank_end(plain, _DECODER.raw_decode(plain, value)[1])
        if plain[i] == ",":
            i = _blank_end(plain, i + 1)
    if found is None:
        raise ValueError(f"no key {key!r}")
    return found


def _blank_end(text: str, i: int) -> int:
    while i < len(text) and text[i] in _BLANKS:
        i += 1
    return i
