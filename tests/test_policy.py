"""The policy file: models, cross-field rules, `${ENV}`, locations, JSON Schema, `policy show|schema`."""

from __future__ import annotations

import json
import textwrap
import tomllib
import uuid
from pathlib import Path

import jsonschema.validators
import pytest
from support.policy import run

from commitgate.server.cli.policy import schema_text
from commitgate.server.policy.loading import analyse_text, default_policy, load_policy, loads_policy
from commitgate.server.policy.models import Policy, policy_json_schema
from commitgate.server.policy.problems import PolicyError, Problem, key_lines
from commitgate.server.serve.checking import check_policy_file

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ROOT / "policies"
SHIPPED = [POLICIES / "default.toml", *sorted((POLICIES / "examples").glob("*.toml"))]


def problems_of(text: str) -> list[Problem]:
    return analyse_text(textwrap.dedent(text), "t.toml").problems


def strings(problems: list[Problem]) -> list[str]:
    return [str(p) for p in problems]


# --- shipped policies -------------------------------------------------------------------------


def test_examples_exist() -> None:
    names = {p.name for p in SHIPPED}
    assert {"default.toml", "payments_http.toml", "saga.toml", "upstream_mcp.toml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_policies_pass_check(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Also the http and upstream examples: `check` needs neither the API nor the upstream running."""
    result = run(capsys, ["policy", "check", str(path)])
    assert result.code == 0, result.text
    assert result.out.strip() == f"{path}: OK"


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_policies_name_the_schema_for_editors(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    assert first.startswith("#:schema ")
    schema = (path.parent / first.removeprefix("#:schema ").strip()).resolve()
    assert schema == POLICIES / "policy.schema.json"


def test_examples_declare_what_their_stories_need() -> None:
    payments = load_policy(POLICIES / "examples" / "payments_http.toml")
    charge = payments.tools["create_charge"]
    assert charge.http is not None and charge.http.url.startswith("http://127.0.0.1:8790/")
    assert charge.status_check is not None and charge.status_check.http is not None
    assert charge.input_schema is not None
    saga = load_policy(POLICIES / "examples" / "saga.toml")
    undo = {name: (t.compensate.tool if t.compensate else None) for name, t in saga.tools.items()}
    assert undo["book"] == "release" and undo["charge"] == "refund"
    assert undo["confirm"] == "send_cancellation_notice"
    assert not any(saga.tools[t].expose for t in ("release", "refund", "send_cancellation_notice"))
    upstream = load_policy(POLICIES / "examples" / "upstream_mcp.toml")
    assert upstream.upstreams["memory"].command == "npx"
    assert sorted(t for t, p in upstream.tools.items() if p.upstream == "memory") == [
        "create_entities",
        "read_graph",
    ]


# --- JSON Schema ----------------------------------------------------------------------------------


def test_bundled_schema_file_is_in_sync_with_the_models() -> None:
    bundled = (POLICIES / "policy.schema.json").read_text(encoding="utf-8")
    assert bundled == schema_text(), "run `commitgate policy schema -o policies/policy.schema.json`"


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_schema_accepts_the_shipped_policies(path: Path) -> None:
    jsonschema.validate(tomllib.loads(path.read_text()), policy_json_schema())


def test_schema_catches_what_an_editor_should_underline() -> None:
    schema = policy_json_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    assert isinstance(validator, jsonschema.Draft7Validator)
    bad = {
        "tools": {
            "x": {"class": "key-requird", "python": "m:f", "timout": "1s", "retry": {"attempts": 0}},
        },
        "server": {"lease": "10 seconds"},
    }
    messages = sorted(e.message for e in validator.iter_errors(bad))
    assert any("key-requird" in m for m in messages)
    assert any("timout" in m for m in messages)
    assert any("less than the minimum of 1" in m for m in messages)
    assert any("10 seconds" in m for m in messages)


def test_schema_has_descriptions_for_completion() -> None:
    tool = policy_json_schema()["$defs"]["ToolPolicy"]["properties"]
    assert "class" in tool and "idempotency_class" not in tool
    missing = [name for name, field in tool.items() if not field.get("description")]
    assert missing == []


def test_schema_command_writes_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "policy.schema.json"
    result = run(capsys, ["policy", "schema", "-o", str(target)])
    assert result.code == 0
    assert "#:schema ./policy.schema.json" in result.out
    assert target.read_text() == (POLICIES / "policy.schema.json").read_text()
    to_stdout = run(capsys, ["policy", "schema"])
    assert json.loads(to_stdout.out) == policy_json_schema()


# --- show -------------------------------------------------------------------------------------------


def test_show_prints_each_tool_and_how_it_is_guarded(capsys: pytest.CaptureFixture[str]) -> None:
    result = run(capsys, ["policy", "show", str(POLICIES / "examples" / "saga.toml")])
    assert result.code == 0
    for header in ("tool", "class", "source", "key", "attempts", "retention", "compensation", "exposed"):
        assert header in result.out
    rows = {line.split("│")[1].strip(): line for line in result.out.splitlines() if line.startswith("│ ")}
    assert "compensable" in rows["book"] and "release" in rows["book"] and "yes" in rows["book"]
    assert "key-and-status-check" in rows["release"] and rows["release"].rstrip("│ ").endswith("no")
    assert "{arguments.amount_cents}" in result.out


def test_show_without_a_file_is_the_bundled_policy(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COMMITGATE_POLICY", raising=False)
    result = run(capsys, ["policy", "show"])
    assert result.code == 0
    assert "bundled default policy" in result.out
    assert "charge_card" in result.out


def test_show_json_is_the_effective_policy_and_loads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = POLICIES / "examples" / "saga.toml"
    result = run(capsys, ["policy", "show", "--json", str(source)])
    assert result.code == 0
    shown = json.loads(result.out)
    assert shown["ledger"]["url"].startswith("sqlite:///")  # the default made explicit
    assert shown["tools"]["book"]["timeout"] == "30s"  # durations as written, defaults filled in
    assert Policy.model_validate(shown).tools == load_policy(source).tools


def test_show_of_a_broken_policy_lists_its_problems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.toml"
    path.write_text('[tools.x]\nclass = "key-required"\n')
    result = run(capsys, ["policy", "show", str(path)])
    assert result.code == 1
    assert "tools.x: needs exactly one source" in result.err
    assert "Traceback" not in result.text


# --- rules --------------------------------------------------------------------------------------------


def test_bundled_default_policy_loads() -> None:
    policy = default_policy()
    assert policy.tools["charge_card"].status_check is not None


def test_field_and_cross_field_problems_are_reported_together() -> None:
    found = strings(
        problems_of(
            """
            [tools.charge]
            class = "key-and-status-check"
            timeout = "later"
            python = "commitgate.server.demo.tools:charge_card"
            retry = { attempts = 0 }

            [tools.book]
            class = "compensable"
            python = "commitgate.server.demo.tools:reserve"
            """
        )
    )
    assert "tools.charge.status_check: class key-and-status-check needs a status_check (line 2)" in found
    assert any(s.startswith("tools.charge.timeout: invalid duration 'later'") for s in found)
    assert "tools.charge.retry.attempts: must be >= 1 (got 0) (line 6)" in found
    assert any(s.startswith("tools.book.compensate: class compensable needs compensate") for s in found)


def test_loading_raises_with_every_problem() -> None:
    with pytest.raises(PolicyError) as caught:
        loads_policy('[tools.a]\nclass = "nope"\n[tools.b]\nclass = "safe-retry"\n', "x.toml")
    assert [p.location for p in caught.value.problems] == ["tools.a", "tools.a.class", "tools.b"]
    assert str(caught.value).startswith("x.toml: 3 problem(s)")


def test_env_references_resolve_at_load_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CG_TEST_HOST", "127.0.0.1:8790")
    monkeypatch.delenv("CG_TEST_TOKEN", raising=False)
    policy = loads_policy(
        textwrap.dedent(
            """
            [tools.pay]
            class = "key-required"
            input_schema = { type = "object" }
            http = { url = "http://${CG_TEST_HOST}/v1", headers = { Authorization = "Bearer ${CG_TEST_TOKEN:-dev}" } }
            """
        )
    )
    http = policy.tools["pay"].http
    assert http is not None
    assert http.url == "http://127.0.0.1:8790/v1"
    assert http.headers == {"Authorization": "Bearer dev"}


def test_unset_env_reference_names_its_location(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CG_TEST_UNSET", raising=False)
    found = problems_of(
        """
        [upstreams.git]
        command = "uvx"
        args = ["mcp-server-git", "--repository", "${CG_TEST_UNSET}"]
        """
    )
    assert [(p.location, p.line) for p in found] == [("upstreams.git.args[2]", 4)]
    assert "environment variable CG_TEST_UNSET is not set" in found[0].message


def test_durations_and_the_server_shorthand() -> None:
    policy = loads_policy(
        '[server]\nlease = "250ms"\nretention = "7d"\nmax_argument_bytes = 1000\n'
        '[tools.t]\nclass = "safe-retry"\npython = "commitgate.server.demo.tools:get_balance"\ntimeout = "2s"\n'
    )
    assert policy.server.lease == 0.25
    assert policy.server.retention == 7 * 86400
    assert policy.server.limits.max_argument_bytes == 1000
    assert policy.tools["t"].timeout == 2.0
    dumped = policy.model_dump(mode="json", by_alias=True)
    assert dumped["server"]["lease"] == "250ms" and dumped["server"]["retention"] == "7d"
    assert Policy.model_validate(dumped) == policy


def test_retry_backoff_bounds_are_consistent() -> None:
    found = problems_of(
        """
        [tools.t]
        class = "safe-retry"
        python = "commitgate.server.demo.tools:get_balance"
        retry = { initial = "2s", max = "1s" }
        """
    )
    assert strings(found) == ["tools.t.retry: `max` must not be smaller than `initial` (line 5)"]


def test_booleans_are_toml_booleans() -> None:
    found = problems_of('[tools.t]\nclass = "safe-retry"\npython = "m:f"\nexpose = "false"\n')
    assert strings(found) == ["tools.t.expose: must be true or false (got 'false') (line 4)"]


def test_lines_follow_tables_inline_tables_and_arrays_of_tables() -> None:
    text = textwrap.dedent(
        """\
        [server]
        name = "x"
        [tools.a]
        retry = { attempts = 1 }
        [[auth.tokens]]
        principal = "p"
        [[auth.tokens]]
        principal = "q"
        [tools."b c"]
        doc = '''
        fake = 1
        '''
        """
    )
    lines = key_lines(text)
    assert lines["server.name"] == 2
    assert lines["tools.a.retry"] == 4
    assert lines["auth.tokens[1].principal"] == 8
    assert lines['tools."b c"'] == 9
    assert 'tools."b c".fake' not in lines  # inside a multi-line string


# --- checks that need the code -------------------------------------------------------------------------


def _module(tmp_path: Path, source: str) -> str:
    name = f"cg_policy_tools_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    return name


def test_references_are_checked_against_signatures_and_return_types(tmp_path: Path) -> None:
    module = _module(
        tmp_path,
        """
        from typing import TypedDict
        from pydantic import BaseModel

        class Guest(BaseModel):
            name: str
            email: str

        class Booking(TypedDict):
            booking_id: str
            room: str

        def book(room: str, guest: Guest) -> Booking:
            return {"booking_id": "b1", "room": room}

        def cancel(booking_id: str, notify: str) -> dict:
            return {}
        """,
    )
    policy = tmp_path / "p.toml"
    policy.write_text(
        textwrap.dedent(
            f"""
            [tools.book]
            class = "compensable"
            python = "{module}:book"
            compensate = {{ tool = "cancel", arguments = {{ booking_id = "{{result.booking_id}}", notify = "{{arguments.guest.email}}" }} }}

            [tools.book_wrong]
            class = "compensable"
            python = "{module}:book"
            compensate = {{ tool = "cancel", arguments = {{ booking_id = "{{result.id}}", notify = "{{arguments.guest.phone}}" }} }}

            [tools.cancel]
            class = "key-required"
            python = "{module}:cancel"
            expose = false
            """
        )
    )
    found = strings(check_policy_file(policy))
    assert found == [
        "tools.book_wrong.compensate.arguments.booking_id: the forward call's result has no 'id' (line 10)",
        "tools.book_wrong.compensate.arguments.notify: the forward call has no argument 'guest.phone' (line 10)",
    ]


STUB_UPSTREAM = '''
from mcp.server.mcpserver import MCPServer

mcp = MCPServer("stub")


@mcp.tool()
def add_note(text: str) -> str:
    """Add a note."""
    return text


@mcp.tool()
def list_notes() -> list[str]:
    """List the notes."""
    return []


if __name__ == "__main__":
    mcp.run()
'''


def test_show_upstreams_lists_what_is_available_but_not_exposed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    (tmp_path / "stub_upstream.py").write_text(STUB_UPSTREAM)
    policy = tmp_path / "p.toml"
    policy.write_text(
        textwrap.dedent(
            f"""
            [upstreams.notes]
            command = {json.dumps(sys.executable)}
            args = [{json.dumps(str(tmp_path / "stub_upstream.py"))}]

            [tools.add_note]
            class = "key-required"
            upstream = "notes"

            [tools.forget]
            class = "key-required"
            upstream = "notes"
            upstream_tool = "forget_note"
            """
        )
    )
    result = run(capsys, ["policy", "show", "--json", "--upstreams", str(policy)])
    assert result.code == 0, result.text
    [notes] = json.loads(result.out)["upstream_inventory"]
    assert notes["connected"] is True
    assert (notes["exposed"], notes["not_exposed"], notes["missing"]) == (
        ["add_note"],
        ["list_notes"],
        ["forget_note"],
    )
    table = run(capsys, ["policy", "show", "--upstreams", str(policy)])
    assert "available, not exposed" in table.out and "list_notes" in table.out


def test_show_never_prints_a_resolved_secret(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAYMENTS_TOKEN", "sk_test_do_not_print")
    path = POLICIES / "examples" / "payments_http.toml"
    assert load_policy(path).tools["create_charge"].http.headers["Authorization"] == (  # type: ignore[union-attr]
        "Bearer sk_test_do_not_print"
    )
    shown = run(capsys, ["policy", "show", "--json", str(path)])
    assert "sk_test_do_not_print" not in shown.out
    headers = json.loads(shown.out)["tools"]["create_charge"]["http"]["headers"]
    assert headers == {"Authorization": "Bearer ${PAYMENTS_TOKEN:-sandbox-token}"}  # as written
    table = run(capsys, ["policy", "show", str(path)])
    assert table.code == 0 and "sk_test_do_not_print" not in table.out
    assert "{arguments.charge}" in table.out
