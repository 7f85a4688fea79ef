"""What a `tools = "all"` upstream offers that commitgate cannot serve as it is, and hints it must not pass on.

A real upstream (tests/support/odd_names_server.py) offers the meta tools' names, an empty name,
names with a space, a control character or a bidi override, and a 300-character name, behind a real
`commitgate serve`; what reaches the upstream is counted in its own log.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from mcp import MCPError
from support.wrapping import TESTS_DIR, call, operation, serve, text, upstream_listed

from commitgate.server.policy.rules import TOOL_NAME

ODD = TESTS_DIR / "support" / "odd_names_server.py"
META = {"get_operation_status", "list_operations", "compensate_session"}


def policy_for(root: Path) -> Path:
    policy = root / "policy.toml"
    policy.write_text(
        f'[ledger]\nurl = "sqlite:///{root / "ledger.db"}"\n\n'
        f'[upstreams.odd]\ncommand = "{sys.executable}"\nargs = ["{ODD}"]\n'
        f'env = {{ ODD_EFFECTS = "{root / "effects.jsonl"}" }}\ntools = "all"\n'
        '\n[tools.reserve]\nclass = "compensable"\npython = "commitgate.server.demo.tools:reserve"\n'
        'compensate = { tool = "release", arguments = { booking_id = "{result.booking_id}" } }\n'
        '\n[tools.release]\nclass = "key-required"\npython = "commitgate.server.demo.tools:release"\n'
        '\n[tools.careful_peek]\nupstream = "odd"\nupstream_tool = "peek"\nclass = "key-required"\n'
    )
    return policy


def effects(root: Path) -> list[str]:
    path = root / "effects.jsonl"
    return [json.loads(line)["tool"] for line in path.read_text().splitlines()] if path.exists() else []


def hints(tool: Any) -> dict[str, Any]:
    return tool.annotations.model_dump(by_alias=True, exclude_none=True) if tool.annotations else {}


@pytest.mark.anyio
async def test_odd_upstream_names_are_prefixed_or_left_out_and_keyed_tools_never_read_only(
    tmp_path: Path,
) -> None:
    stderr = tmp_path / "stderr.log"
    sandbox = {"COMMITGATE_SANDBOX": str(tmp_path / "sandbox.db")}
    async with serve(policy_for(tmp_path), stderr, env=sandbox) as client:
        await upstream_listed(client, "careful_peek")  # connected, its tools merged in
        tools = (await client.list_tools()).tools
        names = [t.name for t in tools]
        by_name = {t.name: t for t in tools}
        relayed = await call(client, "odd__compensate_session", {"note": "x", "idempotency_key": "k-1"})
        spaced = await call(client, "odd__a_b", {"note": "y", "idempotency_key": "k-2"})
        meta = await call(client, "compensate_session", {"session": "nothing-here"})
        with pytest.raises(MCPError):  # not served under its own name: an unknown tool
            await call(client, "evil\u202etxt", {"note": "z", "idempotency_key": "k-3"})
    print("tools/list:", names)
    assert len(names) == len(set(names))  # each name once
    assert all(TOOL_NAME.fullmatch(name) for name in names), names
    assert (
        "odd__" not in names and "upstream odd: a tool with an empty name is not served" in stderr.read_text()
    )
    assert {
        "odd__get_operation_status",
        "odd__list_operations",
        "odd__compensate_session",
        "odd__a_b",
        "odd__bell_",
        "odd__evil_txt",
        "odd__" + "n" * 123,
    } <= set(names)
    for name in META:  # the meta tools are commitgate's own, described as such
        assert "odd server" not in (by_name[name].description or "")
    assert not relayed.is_error and not spaced.is_error, (text(relayed), text(spaced))
    assert operation(relayed)["state"] == "SUCCEEDED"
    assert not meta.is_error and "compensations" in (meta.structured_content or {})
    assert effects(tmp_path) == ["compensate_session", "a b"]  # once each, and only those
    # a keyed class is an action, recorded: never advertised read-only, whatever its server declares
    careful = hints(by_name["careful_peek"])
    assert (careful["readOnlyHint"], careful["idempotentHint"]) == (False, True)
