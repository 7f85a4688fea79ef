"""Small things a new user tripped over, each checked the way they met it."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import pytest

from commitgate.server.cli.commands import CommandParser
from commitgate.server.cli.main import build_parser
from commitgate.server.cli.serve import say_when_run_by_hand
from commitgate.server.policy.loading import load_policy
from commitgate.server.serve.gateway import Gateway
from commitgate.server.serve.reload import PolicyReloader, ReloadStatus

pytestmark = pytest.mark.anyio

TOOL = '[tools.send_email]\nclass = "key-required"\npython = "commitgate.server.demo.tools:send_email"\n'


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_an_applied_policy_is_routine_news_logged_at_info(
    tmp_path: Path, sandbox: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "policy.toml"
    ledger = f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n'
    write(path, ledger + TOOL)
    gateway = await Gateway.open(load_policy(path), path)

    async def on_applied() -> None:
        return None

    try:
        reloader = PolicyReloader(gateway, path, on_applied)
        await reloader.prime()
        write(path, ledger + TOOL + 'timeout = "20s"\n')
        with caplog.at_level(logging.DEBUG, logger="commitgate"):
            assert (await reloader.reload()).status is ReloadStatus.APPLIED
    finally:
        await gateway.close()
    applied = [r for r in caplog.records if "applied" in r.getMessage()]
    assert applied and all(r.levelno == logging.INFO for r in applied)


async def test_a_reload_that_imports_a_module_calling_sys_exit_keeps_the_server(
    tmp_path: Path, sandbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "quits_on_import.py").write_text("import sys\nsys.exit(2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "policy.toml"
    ledger = f'[ledger]\nurl = "sqlite:///{tmp_path / "ledger.db"}"\n'
    write(path, ledger + TOOL)
    gateway = await Gateway.open(load_policy(path), path)

    async def on_applied() -> None:
        return None

    try:
        reloader = PolicyReloader(gateway, path, on_applied)
        await reloader.prime()
        write(path, ledger + TOOL + '[tools.quit]\nclass = "key-required"\npython = "quits_on_import:f"\n')
        result = await reloader.reload()
        assert result.status is ReloadStatus.REJECTED
        assert any("called sys.exit(2)" in p.message for p in result.problems)
        assert gateway.has_tool("send_email") and not gateway.has_tool("quit")
    finally:
        await gateway.close()


def _options(argv: list[str]) -> list[argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = sub.choices[argv[0]]
    assert isinstance(command, CommandParser)
    return [a for a in command.loaded()._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", ["serve", "sandbox"])
def test_every_serve_and_sandbox_option_says_its_default(command: str) -> None:
    undocumented = [a.option_strings[0] for a in _options([command]) if not a.help or "default" not in a.help]
    assert undocumented == []


def test_sandbox_probabilities_and_seconds_say_their_units() -> None:
    helps = {a.option_strings[0]: a.help or "" for a in _options(["sandbox"])}
    for option in ("--lose-response", "--fail-5xx", "--rate-limit"):
        assert "0 to 1" in helps[option]
    assert "AFTER" in helps["--lose-response"] and "BEFORE" in helps["--fail-5xx"]
    for option in ("--hang", "--latency", "--retry-after"):
        assert "seconds" in helps[option]


def test_every_folder_of_shipped_files_is_a_declared_package() -> None:
    """setuptools warns at every install about a folder whose files are package-data but which is not
    itself a package ("absent from the packages configuration"): each such folder is found as one."""
    import tomllib

    from setuptools import find_namespace_packages

    root = Path(__file__).resolve().parent.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    find = setuptools["packages"]["find"]
    src = root / find["where"][0]
    declared = set(find_namespace_packages(str(src), include=find["include"], exclude=find["exclude"]))
    assert "commitgate.server.console.static" in declared and "commitgate.client" not in declared
    for package, patterns in setuptools["package-data"].items():
        assert package in declared, package
        folder = src.joinpath(*package.split("."))
        for pattern in patterns:
            for shipped in folder.glob(pattern):
                if shipped.is_file():  # a file in a subfolder would make that subfolder a package too
                    assert shipped.parent == folder, f"{shipped} is shipped from a folder not declared"


def test_serve_run_by_hand_in_a_terminal_says_it_waits_for_a_client(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    say_when_run_by_hand("stdio")
    said = capsys.readouterr()
    assert said.out == ""  # stdout is the protocol's
    assert "serving MCP on stdio, for a client that starts this command itself" in said.err
    say_when_run_by_hand("streamable-http")  # that one announces its URL
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)  # a client's pipe: not a word
    say_when_run_by_hand("stdio")
    assert capsys.readouterr() == ("", "")
