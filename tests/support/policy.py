"""Helpers for the policy and ledger command tests: a parser built from the command modules."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

import pytest

from commitgate.server.cli import ops as opscmd
from commitgate.server.cli import policy as policycmd


def parser() -> argparse.ArgumentParser:
    """The `commitgate` commands of this area, wired the way cli.py wires them."""
    root = argparse.ArgumentParser(prog="commitgate")
    sub = root.add_subparsers(dest="command", required=True)
    policycmd.register(sub)
    opscmd.register(sub)
    return root


@dataclass(frozen=True, slots=True)
class Run:
    code: int
    out: str
    err: str

    @property
    def text(self) -> str:
        return self.out + self.err


def run(capsys: pytest.CaptureFixture[str], command: str | list[str]) -> Run:
    """Parse and run one command in-process; its output as captured."""
    argv = shlex.split(command) if isinstance(command, str) else command
    args = parser().parse_args(argv)
    capsys.readouterr()
    code = int(args.func(args))
    captured = capsys.readouterr()
    return Run(code, captured.out, captured.err)
