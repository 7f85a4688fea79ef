"""Which policy the local Claude Desktop serves: what `commitgate ops` works on when told nothing.

A user who added commitgate to Claude Desktop (`claude-config`, or `policy init --write-config`) runs
`commitgate ops list` in a terminal without repeating the policy: the `commitgate` entry of Claude
Desktop's config says which policy its server serves, hence which ledger it records in.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from commitgate.server.cli.client_configs import ClientConfigError, ServerEntry, read_client_config
from commitgate.server.cli.desktop import config_file, this_platform
from commitgate.server.model.errors import UserFacingError


@dataclass(frozen=True, slots=True)
class ServedPolicy:
    """The policy a client entry serves: its file, or None for the bundled demo policy."""

    path: str | None
    entry: str
    config: Path

    @property
    def why(self) -> str:
        return f"served by the {self.entry!r} entry of {self.config}"


class AmbiguousEntries(UserFacingError):
    """Several commitgate entries serve different policies: the user says which."""


def policy_of_entry(entry: ServerEntry) -> str | None:
    """The `--policy` of a `commitgate serve` entry (or its $COMMITGATE_POLICY), absolute; None: bundled."""
    args, path = entry.args, None
    for i, arg in enumerate(args):
        if arg == "--policy" and i + 1 < len(args):
            path = args[i + 1]
        elif arg.startswith("--policy="):
            path = arg.removeprefix("--policy=")
    path = path or entry.env.get("COMMITGATE_POLICY")
    if not path:
        return None
    resolved = Path(path).expanduser()
    if not resolved.is_absolute() and entry.cwd:
        resolved = Path(entry.cwd).expanduser() / resolved
    return str(resolved)


def desktop_policy(config: Path | None = None) -> ServedPolicy | None:
    """The policy of Claude Desktop's commitgate entry; None when there is no config or no such entry.

    The entry named `commitgate` wins; otherwise the one entry that runs `commitgate serve`. Several
    serving different policies raise AmbiguousEntries, naming the `--policy` of each."""
    path = config or config_file(this_platform())
    if not path.is_file():
        return None
    try:
        servers = read_client_config(path).servers
    except ClientConfigError:
        return None  # not a config we can read: nothing to go by
    serving = {n: e for n, e in servers.items() if e.runs_commitgate and "serve" in e.args}
    if "commitgate" in serving:
        return ServedPolicy(policy_of_entry(serving["commitgate"]), "commitgate", path)
    policies = {policy_of_entry(entry): name for name, entry in serving.items()}
    if len(policies) > 1:
        choices = "; ".join(
            f"--policy {p or '(none: the bundled policy)'} for {n!r}" for p, n in policies.items()
        )
        raise AmbiguousEntries(f"{path} has several commitgate entries: pass {choices}")
    if not policies:
        return None
    ((policy, name),) = policies.items()
    return ServedPolicy(policy, name, path)


def policy_path(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The policy file a command reads and, when it was not given, why that one: --policy,
    $COMMITGATE_POLICY, else the one Claude Desktop's commitgate entry serves (None: the bundled one)."""
    given = args.policy or os.environ.get("COMMITGATE_POLICY")
    if given:
        return given, None
    served = desktop_policy()
    return (served.path, served.why) if served is not None else (None, None)
