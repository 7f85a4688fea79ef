"""The import rule: a layer may import its own layer and the layers below it, never one above.

The flow of a call is transport → MCP surface → commit boundary → tool source → ledger, and the
folders say so (docs/architecture.md). Every import counts, including those inside functions,
so a lazy import cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The folder -> import-name mapping has one home: src/commitgate/, a link per top-level folder.
PACKAGE = ROOT / "src" / "commitgate"
FOLDERS = {f"commitgate.{link.name}": link.resolve() for link in sorted(PACKAGE.iterdir())}

# Lowest first. A module belongs to the first layer whose prefix matches its name.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("model", ("commitgate.server.model", "commitgate.server")),
    ("ledger", ("commitgate.server.ledger",)),
    ("policy", ("commitgate.server.policy",)),
    ("sources", ("commitgate.tools",)),
    ("core", ("commitgate.server.core",)),
    ("serve", ("commitgate.server.serve",)),
    (
        "commands",
        (
            "commitgate.server.cli",
            "commitgate.server.demo",
            "commitgate.server.bench",
            "commitgate.server.verify",
            "commitgate.server.console",
        ),
    ),
]
# The bundled example tools are user code, kept with the command that serves them: they see only the
# public names of commitgate.server.
BUNDLED = (
    "commitgate.server.demo.tools",
    "commitgate.server.demo.payments_api",
    "commitgate.server.bench.tools",
    "commitgate.server.bench.plain_sdk",
)
BUNDLED_MAY_IMPORT = ("commitgate.server", "commitgate.server.model")
# The client library runs in agent processes that install no server: it imports nothing of it.
CLIENT = "commitgate.client"
# Among the commands: the demo holds the harness the benchmark uses, never the other way round.
FORBIDDEN_PAIRS = [
    ("commitgate.server.demo", "commitgate.server.bench"),
    ("commitgate.server.demo", "commitgate.server.cli"),
    ("commitgate.server.bench", "commitgate.server.cli"),
]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer index): the longest prefix wins
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _within(module, prefix) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def modules(folders: dict[str, Path]) -> Iterator[tuple[str, Path]]:
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([package, *parts]), path


def imports_of(module: str, path: Path) -> Iterator[tuple[int, str]]:
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            # `from pkg import sub` may name a submodule: judge the most specific name.
            for alias in node.names:
                yield node.lineno, f"{target}.{alias.name}"


def violations(folders: dict[str, Path]) -> list[str]:
    found = []
    for module, path in modules(folders):
        own = layer_of(module)
        for line, target in imports_of(module, path):
            if target.startswith("commitgate."):
                where = f"{path.relative_to(path.parents[1])}:{line}: {module} imports {target}"
                found += [f"{where} ({why})" for why in _reasons(module, own, target)]
    return found


def _reasons(module: str, own: int | None, target: str) -> list[str]:
    """Why `module` (of layer `own`) may not import `target`; empty when it may."""
    if _within(module, CLIENT):
        return [] if _within(target, CLIENT) else ["the client imports nothing of the server"]
    if any(_within(module, b) for b in BUNDLED):
        public = any(_within(target, p) and layer_of(target) == 0 for p in BUNDLED_MAY_IMPORT)
        allowed = public or any(_within(target, b) for b in BUNDLED)
        return [] if allowed else ["bundled tools use only the public names"]
    if any(_within(target, b) for b in BUNDLED) and (own is None or own < len(LAYERS) - 1):
        return ["only the commands may use the bundled tools"]
    reasons = []
    theirs = layer_of(target)
    if own is not None and theirs is not None and theirs > own:
        reasons.append(f"{LAYERS[own][0]} is below {LAYERS[theirs][0]}")
    for low, high in FORBIDDEN_PAIRS:
        if _within(module, low) and _within(target, high):
            reasons.append(f"{low} must not depend on {high}")
    return reasons


def test_no_layer_imports_a_higher_one() -> None:
    assert violations(FOLDERS) == []


def import_graph(folders: dict[str, Path]) -> dict[str, set[str]]:
    """Each module -> the project's modules it imports (type-only and in-function imports included).

    `from a.b import c` names the module `a.b.c` when there is one, else the module `a.b`."""
    paths = dict(modules(folders))
    graph: dict[str, set[str]] = {module: set() for module in paths}
    for module, path in paths.items():
        for _, target in imports_of(module, path):
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each module that lies on one, without repeats: [a, b, a]."""
    found: dict[frozenset[str], list[str]] = {}
    for start in sorted(graph):
        path = _shortest_path(graph, start)
        if path and frozenset(path) not in found:
            found[frozenset(path)] = path
    return sorted(found.values())


def _shortest_path(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest import path from `start` back to itself (breadth first), or None."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if module != start else [start, start]
                if target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    return None


def test_no_import_cycle() -> None:
    found = cycles(import_graph(FOLDERS))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_the_cycle_check_finds_a_type_only_circle(tmp_path: Path) -> None:
    """A circle through an import inside a function and an `if TYPE_CHECKING:` import counts."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from commitgate.pkg import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import X\n"
    )
    (tmp_path / "d.py").write_text("from commitgate.pkg.a import b\n")
    graph = import_graph({"commitgate.pkg": tmp_path})
    assert cycles(graph) == [["commitgate.pkg.a", "commitgate.pkg.b", "commitgate.pkg.c", "commitgate.pkg.a"]]


def test_the_bundled_tools_are_modules_of_the_commands() -> None:
    """The list names real modules (it cannot go stale), and none lives among the tool sources."""
    names = dict(modules(FOLDERS))
    for bundled in BUNDLED:
        assert bundled in names and layer_of(bundled) == len(LAYERS) - 1, bundled
    sources = [layer for layer, _ in LAYERS].index("sources")
    assert all(layer_of(name) == sources for name in names if _within(name, "commitgate.tools"))


def test_the_mapping_is_links_to_the_top_level_folders() -> None:
    assert set(FOLDERS) >= {"commitgate.server", "commitgate.tools", "commitgate.client"}
    for name, folder in FOLDERS.items():
        link = PACKAGE / name.removeprefix("commitgate.")
        assert link.is_symlink() and folder.parent == ROOT and (folder / "__init__.py").is_file(), name


def test_both_type_checkers_check_every_mapped_folder() -> None:
    """pyright follows only the links it is told of; mypy walks src/commitgate/ itself."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    for name in FOLDERS:
        assert f"src/{name.replace('.', '/')}" in tool["pyright"]["include"], name
    assert "src/commitgate" in tool["mypy"]["files"]


def test_every_layer_has_its_folder() -> None:
    for name in ("model", "ledger", "policy", "core", "serve", "cli", "demo", "bench", "console"):
        assert (ROOT / "server" / name / "__init__.py").is_file(), name


@pytest.mark.parametrize(
    ("module", "source", "reason"),
    [
        (
            "ledger/base.py",
            "from commitgate.server.core.boundary import CommitBoundary\n",
            "ledger is below core",
        ),
        (
            "core/saga.py",
            "def f():\n    from commitgate.server.serve import gateway\n",
            "core is below serve",
        ),
        ("model/facts.py", "from ..policy.models import Policy\n", "model is below policy"),
        ("demo/run.py", "from commitgate.server.bench.run import main\n", "must not depend on"),
        (
            "client/gate.py",
            "from commitgate.server.model.facts import State\n",
            "imports nothing of the server",
        ),
    ],
)
def test_the_rule_catches_an_upward_import(tmp_path: Path, module: str, source: str, reason: str) -> None:
    """A deliberate violation planted in a copy of the layout fails the rule."""
    server = tmp_path / "server"
    for package in ("model", "ledger", "policy", "core", "serve", "demo", "bench"):
        (server / package).mkdir(parents=True)
        (server / package / "__init__.py").write_text("")
    (server / "__init__.py").write_text("")
    (tmp_path / "client").mkdir()
    if module.startswith("client/"):
        (tmp_path / module).write_text(source)
    else:
        (server / module).write_text(source)
    found = violations({"commitgate.server": server, "commitgate.client": tmp_path / "client"})
    assert len(found) == 1 and reason in found[0], found


# Runs one `commitgate` command in a fresh interpreter; writes which of the MCP SDK and httpx2 it imported.
PROBE = """
import os, sys
from commitgate.server.cli.main import main
try:
    sys.exit(main(sys.argv[1:]))
finally:
    with open(os.environ["PROBE_OUT"], "w") as out:
        out.write(" ".join(m for m in ("mcp", "httpx2") if m in sys.modules))
"""


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--help"], 0),
        (["policy", "check", "python_only.toml"], 0),
        (["serve", "--policy", "does_not_load.toml"], 1),
        (["ops", "list", "--ledger", "postgresql://u@[::1/db"], 1),
    ],
)
def test_a_command_that_serves_nothing_imports_neither_the_mcp_sdk_nor_an_http_client(
    tmp_path: Path, argv: list[str], code: int
) -> None:
    """Each costs most of a second to import: a command's own modules are imported when it runs,
    a policy is checked with the wire types alone, and `serve` loads its policy first."""
    (tmp_path / "tool.py").write_text("def ok(x: int) -> dict:\n    return {'x': x}\n")
    (tmp_path / "python_only.toml").write_text(
        f'[ledger]\nurl = "sqlite:///{tmp_path}/l.db"\n[tools.t]\nclass = "key-required"\npython = "tool:ok"\n'
    )
    (tmp_path / "does_not_load.toml").write_text('[server]\nretention = "10 s"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMITGATE_")}
    env.update(PROBE_OUT=str(tmp_path / "loaded"), XDG_STATE_HOME=str(tmp_path / "state"))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == code and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert (tmp_path / "loaded").read_text() == "", done.stdout + done.stderr
