"""`commitgate policy init --from-config`: a client config of real servers in, a working policy out.

One init (module-scoped) runs over a Claude Desktop config of two small annotated stdio servers that
share a tool name, one HTTP server, one that cannot start and an entry that already runs commitgate;
the policy it writes is checked and served by a real `commitgate serve`, and each call is counted in
the servers' own effect log. Reading configs (VS Code's form, references, errors) needs no process.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.wrapping import CONSOLE_SCRIPT, TESTS_DIR, annotated_web, call, error_code, operation, serve

from commitgate.server.cli import jsonc
from commitgate.server.cli.client_configs import ClientConfigError, read_client_config
from commitgate.server.cli.main import main

SERVER = str(TESTS_DIR / "support" / "annotated_server.py")
SECRETS = {
    "API_TOKEN": "s3cret-notes",
    "TASKS_API_TOKEN": "s3cret-tasks",
    "WEB_AUTHORIZATION": "Bearer s3cret-web",
}


def init(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`commitgate policy init ARGS` in this process (the servers it starts are real processes)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["policy", "init", *map(str, args)])
    return subprocess.CompletedProcess(["commitgate", "policy", "init"], code, out.getvalue(), err.getvalue())


def printed_entry(out: str) -> dict[str, Any]:
    document, _ = json.JSONDecoder().raw_decode(out[out.index("{") :])
    return dict(document["mcpServers"]["commitgate"])


@dataclass
class Setup:
    root: Path
    config: Path
    original: str
    policy: Path
    effects: Path
    result: subprocess.CompletedProcess[str]

    def effects_by(self, server: str) -> list[dict[str, Any]]:
        if not self.effects.exists():
            return []
        lines = self.effects.read_text(encoding="utf-8").splitlines()
        return [e for e in map(json.loads, lines) if e["server"] == server]


def client_config(root: Path, effects: Path, web_url: str) -> dict[str, Any]:
    def stdio(name: str) -> dict[str, Any]:
        env = {"EFFECTS": str(effects), "API_TOKEN": f"s3cret-{name}"}
        return {"command": sys.executable, "args": [SERVER, name], "env": env}

    return {
        "mcpServers": {
            "notes": stdio("notes"),
            "tasks": stdio("tasks"),
            "web": {"type": "http", "url": web_url, "headers": {"Authorization": "Bearer s3cret-web"}},
            "gone": {"command": str(root / "no-such-server")},
            "guard": {"command": str(CONSOLE_SCRIPT), "args": ["serve"]},
        },
        "globalShortcut": "Ctrl+Space",
    }


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    effects = tmp_path_factory.mktemp("init") / "effects.jsonl"
    with annotated_web(effects) as url:
        yield url, effects


@pytest.fixture(scope="module")
def setup(web: tuple[str, Path]) -> Setup:
    url, effects = web
    root = effects.parent
    config = root / "claude_desktop_config.json"
    config.write_text(json.dumps(client_config(root, effects, url), indent=2), encoding="utf-8")
    result = init("--from-config", config, "--connect-timeout", "30s")
    return Setup(root, config, config.read_text(), root / "commitgate.toml", effects, result)


def test_every_reachable_tool_gets_an_entry_with_the_class_its_annotations_give(setup: Setup) -> None:
    policy = tomllib.loads(setup.policy.read_text(encoding="utf-8"))
    tools = policy["tools"]
    assert set(tools) == {
        "read_notes", "notes__write", "plain_notes",
        "read_tasks", "tasks__write", "plain_tasks",
        "read_web", "web__write", "plain_web",
    }  # fmt: skip
    assert tools["notes__write"] == {"upstream": "notes", "upstream_tool": "write", "class": "key-required"}
    assert tools["web__write"]["upstream"] == "web"
    assert tools["read_tasks"] == {"upstream": "tasks", "class": "safe-retry"}
    assert tools["plain_web"]["class"] == "key-required"  # no annotations: a key
    assert set(policy["upstreams"]) == {"notes", "tasks", "web", "gone"}  # guard runs commitgate


def test_each_entry_says_what_its_server_declared_and_why_the_class(setup: Setup) -> None:
    text = setup.policy.read_text(encoding="utf-8")
    above_write = text.split("[tools.notes__write]")[0].splitlines()[-2:]
    assert above_write[0] == "# notes declares destructiveHint: true, idempotentHint: true."
    assert above_write[1].startswith("# key-required: not declared read-only")
    above_read = text.split("[tools.read_web]")[0].splitlines()[-2:]
    assert above_read[0] == '# web declares title: "Read web", readOnlyHint: true.'
    assert "# plain_tasks" not in text and "# tasks declares no annotations." in text


def test_secrets_are_references_never_copied(setup: Setup) -> None:
    text = setup.policy.read_text(encoding="utf-8")
    assert "s3cret" not in text
    upstreams = tomllib.loads(text)["upstreams"]
    assert upstreams["notes"]["env"]["API_TOKEN"] == "${API_TOKEN}"
    assert upstreams["tasks"]["env"]["API_TOKEN"] == "${TASKS_API_TOKEN}"  # same name, another value
    assert upstreams["notes"]["env"]["EFFECTS"] == "${EFFECTS}"  # every env value: the entry holds it
    assert upstreams["web"]["headers"] == {"Authorization": "${WEB_AUTHORIZATION}"}
    out = setup.result.stdout
    assert "s3cret" not in out + setup.result.stderr
    assert "${API_TOKEN}, ${EFFECTS}, ${TASKS_API_TOKEN}, ${WEB_AUTHORIZATION}" in out
    # `policy show` fails on an unset variable: the line that suggests it says to set them first
    check = next(line for line in out.splitlines() if line.startswith("Check the classes"))
    assert "with API_TOKEN, EFFECTS, TASKS_API_TOKEN, WEB_AUTHORIZATION set in this shell" in check
    entry = printed_entry(out)
    assert entry["env"] == {name: f"<{name}>" for name in [*SECRETS, "EFFECTS"]}


def test_an_unreachable_server_is_written_with_why_and_init_exits_1(setup: Setup) -> None:
    assert setup.result.returncode == 1, setup.result
    not_reached = [line for line in setup.result.stderr.splitlines() if "not reached" in line]
    assert len(not_reached) == 1 and not_reached[0].startswith("commitgate: gone: not reached: ")
    assert "skipped 'guard': it already runs commitgate" in setup.result.stderr
    text = setup.policy.read_text(encoding="utf-8")
    assert "# gone could not be reached, so it has no [tools.X] entries yet" in text
    upstreams = tomllib.loads(text)["upstreams"]
    assert upstreams["gone"]["tools"] == "all"  # served, with the classes init would give, once it starts
    assert "tools" not in upstreams["notes"] and upstreams["notes"]["connect_timeout"] == "30s"
    assert "wrote" in setup.result.stdout and "4 of 5" not in setup.result.stdout


def test_the_printed_entry_starts_this_commitgate_on_the_policy_by_absolute_paths(setup: Setup) -> None:
    out = setup.result.stdout
    entry = printed_entry(out)
    assert entry["command"] == str(CONSOLE_SCRIPT.absolute())
    assert entry["args"] == ["serve", "--policy", str(setup.policy.resolve())]
    assert setup.config.read_text() == setup.original  # only --write-config changes it
    # Rerunning with --write-config keeps the policy as it is and puts the entry in the config.
    assert "(or rerun with --write-config: init keeps the policy as it is and puts the entry there):" in out


def test_the_written_policy_passes_check_once_its_variables_are_set(
    setup: Setup, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [*SECRETS, "EFFECTS"]:
        monkeypatch.delenv(name, raising=False)
    # An unset secret breaks only its own upstream: a warning, not an error.
    assert main(["policy", "check", str(setup.policy)]) == 0
    out = capsys.readouterr().out
    assert "warning: upstreams.notes: environment variables" in out and "TASKS_API_TOKEN" in out
    for name, value in {**SECRETS, "EFFECTS": str(setup.effects)}.items():
        monkeypatch.setenv(name, value)
    assert main(["policy", "check", str(setup.policy)]) == 0, capsys.readouterr().out


@pytest.mark.anyio
async def test_serving_it_a_retried_write_runs_once_and_each_call_reaches_its_own_server(
    setup: Setup,
) -> None:
    env = {**SECRETS, "EFFECTS": str(setup.effects)}
    async with serve(setup.policy, setup.root / "serve.log", env=env, log_level="warning") as client:
        listed = {tool.name for tool in (await client.list_tools()).tools}
        assert {"notes__write", "tasks__write", "web__write", "read_notes"} <= listed
        for tool in ("notes__write", "tasks__write", "web__write"):
            arguments = {"note": f"via {tool}", "idempotency_key": f"k-{tool}"}
            first = await call(client, tool, arguments)
            retry = await call(client, tool, arguments)
            assert error_code(first) is None, first
            assert not operation(first)["replayed"] and operation(retry)["replayed"]
        keyless = await call(client, "notes__write", {"note": "no key"})
        assert error_code(keyless) == "idempotency_key_required"
        read = await call(client, "read_notes")
        assert error_code(read) is None and read.structured_content == {"result": 1}
    for server in ("notes", "tasks", "web"):
        effects = setup.effects_by(server)
        assert effects == [{"server": server, "note": f"via {server}__write", "saw_secret": True}]


def test_an_existing_policy_is_kept_and_added_to_unless_forced(setup: Setup, tmp_path: Path) -> None:
    out = tmp_path / "mine.toml"
    out.write_text(
        "# hand-written", encoding="utf-8"
    )  # no line end: the additions start on a line of their own
    result = init("--from-config", setup.config, "--server", "notes", "-o", out)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text.startswith("# hand-written\n\n# Set API_TOKEN, EFFECTS where commitgate runs")
    assert set(tomllib.loads(text)["tools"]) == {"read_notes", "write", "plain_notes"}
    added = [line for line in result.stdout.splitlines() if line.startswith("added ")]
    assert added == [
        "added [upstreams.notes]",
        "added [tools.read_notes]: 'read_notes' of notes, safe-retry",
        "added [tools.write]: 'write' of notes, key-required",
        "added [tools.plain_notes]: 'plain_notes' of notes, key-required",
    ]
    forced = init("--from-config", setup.config, "--server", "tasks", "-o", out, "--force")
    assert forced.returncode == 0, forced.stderr
    assert set(tomllib.loads(out.read_text())["tools"]) == {"read_tasks", "write", "plain_tasks"}
    assert "# hand-written" not in out.read_text()  # --force: written anew


def test_write_config_replaces_the_wrapped_servers_and_keeps_a_backup(setup: Setup, tmp_path: Path) -> None:
    config, out = tmp_path / "claude_desktop_config.json", tmp_path / "mine.toml"
    config.write_text(setup.original, encoding="utf-8")
    out.write_text("# hand-written\n", encoding="utf-8")
    result = init("--from-config", config, "--server", "notes", "-o", out, "--force", "--write-config")
    assert result.returncode == 0, result.stderr
    assert set(tomllib.loads(out.read_text())["tools"]) == {"read_notes", "write", "plain_notes"}
    assert (tmp_path / "claude_desktop_config.json.bak").read_text() == setup.original
    written = json.loads(config.read_text())
    servers = written["mcpServers"]
    assert list(servers) == ["commitgate", "tasks", "web", "gone", "guard"]  # in the wrapped one's place
    assert written["globalShortcut"] == "Ctrl+Space"
    entry = servers["commitgate"]
    assert entry["args"] == ["serve", "--policy", str(out.resolve())]
    # The secrets stay where they already were, in the client's config, now for commitgate to pass on.
    assert entry["env"] == {"EFFECTS": str(setup.effects), "API_TOKEN": "s3cret-notes"}
    assert "comments" not in result.stdout  # there were none to lose


_JSON_LEAF = st.none() | st.booleans() | st.integers() | st.text(alphabet='/*,"\\\n ab{}[]')


# VS Code's own `.vscode/mcp.json` as people keep it: comments, trailing commas, `//` inside strings.
VSCODE_JSONC = """\ufeff{
  // Servers for this workspace
  "inputs": [
    {"id": "gh", "type": "promptString", "password": true}, // asked once
  ],
  "servers": {
    /* the commitgate this workspace already ran */
    "commitgate": {"type": "stdio", "command": "commitgate", "args": ["serve"]},
    "gh": {
      "type": "http",
      "url": "https://api.example.com//mcp/*v1*/", // a `//` and a `/*` that are text
      "headers": {"Authorization": "Bearer ${input:gh}", "X-Note": "say \\"hi\\" // twice",},
    },
    "gone": {
      "type": "stdio",
      "command": "/no-such-dir/server", /* never starts */
      "args": ["--path", "C:\\\\tmp\\\\"],
      "env": {"GONE_TOKEN": "${env:GONE_TOKEN}"}, // from the shell VS Code started in
    },
  },
}
"""


def test_vs_code_jsonc_with_comments_and_trailing_commas_is_read(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(VSCODE_JSONC, encoding="utf-8")
    config = read_client_config(path)
    gh, gone = config.servers["gh"], config.servers["gone"]
    assert gh.url == "https://api.example.com//mcp/*v1*/"
    assert gh.headers == {"Authorization": "${GH_AUTHORIZATION}", "X-Note": "${GH_X_NOTE}"}
    assert gh.secrets["header X-Note"].value == 'say "hi" // twice'
    assert (gone.command, gone.args) == ("/no-such-dir/server", ["--path", "C:\\tmp\\"])
    assert config.document["inputs"] == [{"id": "gh", "type": "promptString", "password": True}]
    assert config.had_comments


def test_write_config_on_jsonc_replaces_the_servers_table_and_keeps_the_rest_comments_included(
    tmp_path: Path,
) -> None:
    config = tmp_path / "mcp.json"
    config.write_bytes(VSCODE_JSONC.replace("\n", "\r\n").encode())  # as a Windows editor saves it
    # Only `gone`, which cannot start: no process, and the rewrite happens all the same.
    result = init("--from-config", config, "--server", "gone", "--write-config", "--connect-timeout", "5s")
    assert result.returncode == 1 and "commitgate: gone: not reached" in result.stderr
    assert (tmp_path / "mcp.json.bak").read_bytes() == VSCODE_JSONC.replace("\n", "\r\n").encode()
    raw = config.read_bytes().decode()
    assert "\n" not in raw.replace("\r\n", "")  # its line ends as they were, the new lines' too
    text = raw.replace("\r\n", "\n")
    before_the_table = VSCODE_JSONC.lstrip("\ufeff").split('"servers": ')[0]
    assert text.startswith("\ufeff" + before_the_table)  # BOM, comments, trailing commas, layout as they were
    assert text.endswith("  },\n}\n")
    written = jsonc.loads(text.lstrip("\ufeff")).value
    assert list(written["servers"]) == ["commitgate", "gh", "commitgate-2"]
    assert written["servers"]["commitgate-2"]["type"] == "stdio"
    # VS Code hands commitgate the variable it handed the server; `policy show` needs it set too.
    assert written["servers"]["commitgate-2"]["env"] == {"GONE_TOKEN": "${env:GONE_TOKEN}"}
    assert "Check the classes (with GONE_TOKEN set in this shell" in result.stdout
    assert written["servers"]["gh"]["url"] == "https://api.example.com//mcp/*v1*/"
    assert written["inputs"] == [{"id": "gh", "type": "promptString", "password": True}]
    lines = result.stdout.splitlines()
    assert (
        "The comments inside its `servers` were not kept (the rest of it was); mcp.json.bak has them."
        in lines
    )
    assert (
        "(It is called 'commitgate-2' because the entry 'commitgate' already in the config stays as it is.)"
        in lines
    )


def test_a_rewrite_keeps_vs_code_settings_around_the_servers_in_their_own_indentation() -> None:
    settings = (
        '{\n    // editor\n    "editor.tabSize": 4,\n    "mcp": {\n        "servers": {"a": {"command": "x"}},'
        "\n        /* kept */\n    },\n}\n"
    )
    text, dropped = jsonc.replace_value(settings, ("mcp", "servers"), {"b": {"url": "http://h//p"}})
    assert not dropped
    crlf, _ = jsonc.replace_value(
        settings.replace("\n", "\r\n"), ("mcp", "servers"), {"b": {"url": "http://h//p"}}
    )
    assert crlf == text.replace("\n", "\r\n")
    assert text == (
        '{\n    // editor\n    "editor.tabSize": 4,\n    "mcp": {\n        "servers": {\n'
        '            "b": {\n                "url": "http://h//p"\n            }\n        },'
        "\n        /* kept */\n    },\n}\n"
    )


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=5), _JSON_LEAF, max_size=3), _JSON_LEAF, st.integers(0, 4))
def test_replacing_one_value_changes_that_value_only(other: dict[str, Any], new: Any, indent: int) -> None:
    document = {**other, "servers": {"old": other}, "z": [other]}
    text, dropped = jsonc.replace_value(json.dumps(document, indent=indent), ("servers",), new)
    assert json.loads(text) == {**document, "servers": new} and not dropped


# --- reading configs (no process) ---------------------------------------------------------------------


def test_vs_code_servers_with_http_entries_and_its_references(tmp_path: Path) -> None:
    path = tmp_path / "mcp.json"
    path.write_text(
        json.dumps(
            {
                "inputs": [{"id": "gh", "type": "promptString", "password": True}],
                "servers": {
                    "gh": {
                        "type": "sse",
                        "url": "http://127.0.0.1:1/sse",
                        "headers": {"Authorization": "Bearer ${input:gh}", "X-Org": "${env:ORG}"},
                    },
                    "fs": {
                        "type": "stdio",
                        "command": "npx",
                        "args": ["-y", "fs"],
                        "env": {"HOME_DIR": "/h"},
                    },
                },
            }
        )
    )
    config = read_client_config(path)
    gh, fs = config.servers["gh"], config.servers["fs"]
    assert (gh.url, gh.transport) == ("http://127.0.0.1:1/sse", "sse")
    assert gh.headers == {"Authorization": "${GH_AUTHORIZATION}", "X-Org": "${ORG}"}
    assert not gh.secrets["header Authorization"].known  # VS Code asks for it: the variable is set by hand
    assert (gh.environment, fs.environment) == ({"ORG"}, set())
    assert (fs.command, fs.args, fs.env) == ("npx", ["-y", "fs"], {"HOME_DIR": "${HOME_DIR}"})
    assert fs.secrets["env HOME_DIR"].value == "/h"  # every env value: the policy refers to it


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not valid JSON"),
        ('{"other": {}}', "no `mcpServers` (Claude Desktop, Cursor) or `servers` (VS Code) object"),
        ('{"mcpServers": {"x": {"args": []}}}', "server 'x': has neither `command` (stdio) nor `url` (HTTP)"),
        ('{"mcpServers": {"x": {"command": "a", "env": []}}}', "server 'x': `env` must be an object"),
        ('{"mcpServers": {} /* open', "config.json:1:19: not valid JSON (unterminated /* comment)"),
        ('{\n/* one\n two */ "mcpServers": {"x": 1,,}}', "config.json:3:31: not valid JSON"),
        ('{"mcpServers": {,}}', "config.json:1:17: not valid JSON"),
    ],
)
def test_a_config_that_cannot_be_read_says_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ClientConfigError, match=re.escape(message)):
        read_client_config(path)


def test_a_missing_config_says_where_to_find_the_real_one(tmp_path: Path) -> None:
    # The quick start prints the macOS path; elsewhere that file is not there.
    with pytest.raises(
        ClientConfigError, match=re.escape("no such file (`commitgate claude-config` says where")
    ):
        read_client_config(tmp_path / "claude_desktop_config.json")


_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(_JSON)
def test_jsonc_reads_any_json_as_json_does_and_comments_between_tokens_change_nothing(value: Any) -> None:
    text = json.dumps(value, indent=1)
    assert jsonc.loads(text) == jsonc.Jsonc(value, had_comments=False)
    # Between tokens only: json.dumps escapes every line break inside a string.
    commented = text.replace("\n", ' /* a "b" // */ // c, "d" /*\n') + "\n// the end"
    assert jsonc.loads(commented) == jsonc.Jsonc(value, had_comments=True)
