"""`commitgate claude-config`: the Claude Desktop entry that starts this very installation.

Claude Desktop starts servers with a small environment of its own, so a bare
`"command": "commitgate"` fails (`spawn commitgate ENOENT`) unless the install's
bin directory happens to be on the app's PATH. The entry printed here names the
absolute path of the running executable and of the policy, so it works wherever
the app looks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

# Where Claude Desktop reads its configuration, by platform.
CONFIG_FILES = {
    "macOS": "~/Library/Application Support/Claude/claude_desktop_config.json",
    "Windows": r"%APPDATA%\Claude\claude_desktop_config.json",
    "Linux": "~/.config/Claude/claude_desktop_config.json",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Print the mcpServers entry for Claude Desktop (JSON on stdout) with the absolute path of this"
        " commitgate and of the policy, and say (on stderr) where Claude Desktop's config file is."
    )
    parser.add_argument(
        "--policy", help="policy file to serve (default: $COMMITGATE_POLICY, else the bundled demo policy)"
    )
    parser.add_argument(
        "--name", default="commitgate", help="the server's name in mcpServers (default: commitgate)"
    )
    parser.set_defaults(func=cmd_claude_config)


def server_command() -> list[str]:
    """How to start this installation from anywhere: its console script, else its interpreter."""
    script = Path(sys.argv[0])
    if script.name.startswith("commitgate") and script.is_file():
        return [str(script.absolute())]
    found = shutil.which("commitgate", path=str(Path(sys.executable).parent))
    if found:
        return [str(Path(found).absolute())]
    return [str(Path(sys.executable).absolute()), "-m", "commitgate.server.cli"]


def desktop_entry(policy: str | None) -> dict[str, Any]:
    command, *prefix = server_command()
    args = [*prefix, "serve"]
    if policy:
        args += ["--policy", str(Path(policy).expanduser().absolute())]
    return {"command": command, "args": args}


def this_platform() -> str:
    if sys.platform == "darwin":
        return "macOS"
    return "Windows" if sys.platform.startswith("win") else "Linux"


def config_file(platform: str) -> Path:
    return Path(os.path.expandvars(CONFIG_FILES[platform])).expanduser()


def cmd_claude_config(args: argparse.Namespace) -> int:
    policy = args.policy or os.environ.get("COMMITGATE_POLICY")
    if policy and not Path(policy).expanduser().is_file():
        print(f"commitgate: no policy file at {policy}", file=sys.stderr)
        return 1
    print(json.dumps({"mcpServers": {args.name: desktop_entry(policy)}}, indent=2))
    here = this_platform()
    path = config_file(here)
    state = (
        "exists: merge the entry into its mcpServers" if path.exists() else "does not exist yet: create it"
    )
    lines = [
        "",
        "Put the mcpServers entry above in Claude Desktop's config file, then restart Claude Desktop:",
        *(f"  {name:8} {where}" for name, where in CONFIG_FILES.items()),
        f"On this machine ({here}): {path} ({state}).",
        "In Claude Desktop: Settings > Developer > Edit Config opens the same file.",
    ]
    if not policy:
        lines.append("No --policy given: it serves the bundled demo tools. Add --policy FILE to serve yours.")
    print("\n".join(lines), file=sys.stderr)
    return 0
