"""Subcommands whose code is imported only when one of them runs.

`commitgate --help` lists every command and `commitgate policy check` runs one: neither should pay
for importing the others (the MCP SDK, HTTP clients and the server stack take most of a second). A
deferred command is added with its one-line help and the function that declares its arguments
(`add_parser(name, help=..., arguments="module:function")`); that function's module is imported when
argparse hands the command its arguments, not before.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser; given `arguments="module:function"`, that function adds its arguments
    the first time it parses."""

    def __init__(self, *args: Any, arguments: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._arguments = arguments

    def loaded(self) -> CommandParser:
        """This parser with its arguments declared (importing the module that declares them, once)."""
        if self._arguments is not None:
            module, function = self._arguments.split(":")
            self._arguments = None
            getattr(importlib.import_module(module), function)(self)
        return self

    # typeshed spells this as two overloads; one signature taking both serves every caller.
    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # pyright: ignore[reportIncompatibleMethodOverride]
        self.loaded()
        return super().parse_known_args(args, namespace)
