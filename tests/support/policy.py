"""Helpers for the policy and ledger command tests: commands parsed and run in-process."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import pytest

from commitgate.server.cli.main import build_parser


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
    args = build_parser().parse_args(argv)
    capsys.readouterr()
    code = int(args.func(args))
    captured = capsys.readouterr()
    return Run(code, captured.out, captured.err)
