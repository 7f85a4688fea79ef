"""The `commitgate` command line: each command wires its arguments to the layers below."""

from commitgate.server.cli.main import main

__all__ = ["main"]
