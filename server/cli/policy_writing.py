"""The text `policy init` writes: every name and value that came from a client config or a server is data.

Each block (`[upstreams.NAME]` or `[tools.X]` with the comment above it) is built by tomlkit, which quotes
keys and escapes strings; comments have every line break and control character escaped. A rerun appends
new blocks after the existing text, which stays byte for byte. Before anything is written the result is
read back, and it must hold exactly what was there plus the blocks intended, nothing else: whatever a
config says, it cannot add a table, a token or a tool of its own.
"""

from __future__ import annotations

import copy
import tomllib
import unicodedata
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from commitgate.server.model.errors import UserFacingError

# tomlkit is imported by the functions that write: every `ops` command imports this module (for
# `one_line`, through cli/client_configs.py) and none writes a policy.
if TYPE_CHECKING:
    from tomlkit.items import Item


class PolicyWriteError(UserFacingError):
    """The policy to write would not be what was intended (never written)."""


@dataclass(frozen=True, slots=True)
class Block:
    """One table of the policy, its values as plain data, and the comment lines above it."""

    section: Literal["upstreams", "tools"]
    name: str
    values: dict[str, Any]
    comments: list[str] = field(default_factory=list)


def one_line(text: str) -> str:
    """`text` with every line break, control and format character escaped as `\\uXXXX`."""
    return "".join(f"\\u{ord(c):04x}" if unicodedata.category(c).startswith("C") else c for c in text)


def comments_text(lines: list[str]) -> str:
    import tomlkit

    document = tomlkit.document()
    for line in lines:
        document.add(tomlkit.comment(one_line(line)))
    return document.as_string()


def block_text(block: Block) -> str:
    import tomlkit

    document = tomlkit.document()
    for line in block.comments:
        document.add(tomlkit.comment(one_line(line)))
    table = tomlkit.table()
    for key, value in block.values.items():
        table.add(key, _item(value))
    section = tomlkit.table(is_super_table=True)
    section.add(block.name, table)
    document.add(block.section, section)
    document[block.section].trivia.indent = ""  # the comment right above the header, no blank line
    return document.as_string()


def _item(value: Any) -> Item:
    import tomlkit

    if isinstance(value, dict):
        inline = tomlkit.inline_table()
        inline.update(value)
        return inline
    return tomlkit.item(value)


def composed(existing: str | None, header: list[str], blocks: list[Block]) -> str:
    """A new policy (`existing` None: the header comment, then the blocks) or `existing` with the blocks
    after it, its own text unchanged."""
    texts = [block_text(block) for block in blocks]
    if existing is None:
        return "\n".join([comments_text(header), *texts])
    if not texts:
        return existing
    ending = "" if existing.endswith("\n") or not existing else "\n"
    return existing + ending + "\n" + "\n".join(texts)


def check_written(text: str, before: dict[str, Any], blocks: list[Block]) -> None:
    """`text` read back holds `before` plus exactly the blocks: refuse to write anything else."""
    expected = copy.deepcopy(before)
    for block in blocks:
        expected.setdefault(block.section, {})[block.name] = block.values
    try:
        written = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyWriteError(
            f"the policy to write would not be valid TOML ({exc}); nothing written"
        ) from None
    if written != expected:
        added = sorted(set(written) ^ set(expected)) or sorted(
            f"{section}.{name}"
            for section in ("upstreams", "tools")
            for name in set(written.get(section, {})) ^ set(expected.get(section, {}))
        )
        raise PolicyWriteError(
            f"the policy to write would differ from what was intended ({', '.join(added) or 'values'});"
            " nothing written"
        )
