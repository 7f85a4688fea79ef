"""The tests' npm packages (support/node.py) come from one npm run, whichever test asks first."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from support import node

# Records the packages of each run, and installs each as a bare package.json of its version.
FAKE_NPM = """
import json, os, sys
from pathlib import Path
args = sys.argv[2:]
prefix = Path(args[args.index("--prefix") + 1])
specs = [a for a in args if not a.startswith("-") and a != str(prefix)]
with open(os.environ["FAKE_NPM_LOG"], "a") as log:
    log.write(" ".join(specs) + "\\n")
for spec in specs:
    at = spec.rfind("@")
    name, version = (spec[:at], spec[at + 1 :]) if at > 0 else (spec, "1.0.0")
    (prefix / "node_modules" / name).mkdir(parents=True, exist_ok=True)
    (prefix / "node_modules" / name / "package.json").write_text(json.dumps({"version": version}))
"""


def test_the_first_package_asked_for_installs_every_package_in_one_npm_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, log = tmp_path / "bin" / "npm", tmp_path / "npm.log"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\n{FAKE_NPM}")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NPM_LOG", str(log))
    monkeypatch.setattr(node, "ROOT", tmp_path / "node22")
    monkeypatch.setattr(node, "_system_node", lambda: "node")  # a new enough Node: none installed

    assert (
        node.package(node.MEMORY_SERVER)
        == tmp_path / "node22" / "node_modules" / "@modelcontextprotocol" / "server-memory"
    )
    for spec in node.PACKAGES:  # the others are there already
        assert node.package(spec).is_dir()

    runs = log.read_text().splitlines()
    assert len(runs) == 1
    assert sorted(runs[0].split()) == sorted(node.PACKAGES)
