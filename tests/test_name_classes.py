"""Classes for tools that declare nothing, from their names: reads retried freely, everything else keyed.

One real `commitgate policy init` over a stdio server whose tools are named as real servers name them;
the policy's classes and comments, and init's closing table, say what came from a name.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from mcp.types import ToolAnnotations
from support.wrapping import CONSOLE_SCRIPT, TESTS_DIR

from commitgate.tools.hints import class_source, name_words, proposed_class

NAMED = str(TESTS_DIR / "support" / "named_server.py")

# name -> (annotations, class init proposes, chosen from the name)
TOOLS: dict[str, tuple[dict[str, bool], str, bool]] = {
    "read_query": ({}, "safe-retry", True),
    "list_tables": ({}, "safe-retry", True),
    "describe_table": ({}, "safe-retry", True),
    "getUserById": ({}, "safe-retry", True),
    "search.issues": ({}, "safe-retry", True),
    "fetch": ({}, "safe-retry", True),
    "get_settings": ({}, "safe-retry", True),  # "settings" is not "set"
    "get_or_create_user": ({}, "key-required", True),  # a write word anywhere keys it
    "listAndDeleteOld": ({}, "key-required", True),
    "write_query": ({}, "key-required", False),  # not a query verb: the careful default
    "get_balance": ({"readOnlyHint": False}, "key-required", False),  # a declared write stays keyed
    "list_jobs": ({"destructiveHint": True}, "key-required", False),
    "find_user": ({"readOnlyHint": True}, "safe-retry", False),  # declared: the annotation decides
}


def test_init_proposes_safe_retry_for_reads_that_declare_nothing_and_says_so(tmp_path: Path) -> None:
    spec = tmp_path / "tools.json"
    spec.write_text(json.dumps([{"name": n, "annotations": a} for n, (a, _, _) in TOOLS.items()]))
    config = tmp_path / "claude_desktop_config.json"
    server = {
        "command": sys.executable,
        "args": [NAMED, "db", str(spec)],
        "env": {"EFFECTS": str(tmp_path / "e")},
    }
    config.write_text(json.dumps({"mcpServers": {"db": server}}))
    result = subprocess.run(
        [str(CONSOLE_SCRIPT), "policy", "init", "--from-config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "commitgate.toml").read_text()
    tools = tomllib.loads(text)["tools"]
    assert {name: tool["class"] for name, tool in tools.items()} == {n: c for n, (_, c, _) in TOOLS.items()}
    above = text.split("[tools.read_query]")[0].splitlines()[-2:]
    assert above == [
        "# db declares no annotations.",
        "# safe-retry: its name reads as a query ('read') and its server declares nothing, so the class comes"
        " from the name: retried freely; make it key-required if it changes anything.",
    ]
    assert "# key-required: its name has 'create', so a repeat could repeat its effect" in text
    table = result.stdout.split(
        "Classes chosen from tool names (their servers declare nothing; check them):\n"
    )[1]
    rows = [line.split() for line in table.strip().splitlines()]
    assert {row[0]: row[2] for row in rows} == {n: c for n, (_, c, named) in TOOLS.items() if named}
    assert rows[0] == ["read_query", "db", "safe-retry", "its", "name", "starts", "with", "'read'"]


@pytest.mark.parametrize("name", list(TOOLS))
def test_tools_all_keeps_to_the_annotations(name: str) -> None:
    annotations, _, _ = TOOLS[name]
    declared = ToolAnnotations.model_validate(annotations) if annotations else None
    # Without a name (how `tools = "all"` asks), only a declared read is safe-retry.
    expected = "safe-retry" if annotations.get("readOnlyHint") is True else "key-required"
    assert proposed_class(declared) == expected
    assert class_source(declared, None) in ("annotations", "default")


def test_names_split_on_separators_and_case_changes() -> None:
    assert name_words("getHTTPStatus_v2-list.items") == ["get", "http", "status", "v", "2", "list", "items"]
