"""The docs/ pages: every anchor that code or another page cites exists, and the contract's
fingerprint example is what the boundary computes."""

from __future__ import annotations

import hashlib
import re
import shlex
from pathlib import Path

import pytest

from commitgate.server.cli.main import build_parser
from commitgate.server.core.requests import fingerprint
from commitgate.server.model.canonical import canonical_json

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# `docs/contract.md#operation-states` in code; `(policy.md#auth)` or `(#leases)` in a page's links.
CITATION = re.compile(r"docs/([a-z_]+\.md)#([a-z0-9_\-]+)")
LINK = re.compile(r"\]\(([a-z_]*\.md)?#([a-z0-9_\-]+)\)")


def slug(heading: str) -> str:
    """The anchor a Markdown renderer (GitHub) gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    lines = page.read_text(encoding="utf-8").splitlines()
    return {slug(line.lstrip("#")) for line in lines if re.match(r"#{1,6} ", line)}


def cited() -> list[tuple[str, str, str]]:
    """(where, page, anchor) for every citation in the code and every anchored link in docs/."""
    found = []
    for folder in ("server", "tools", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for page, anchor in CITATION.findall(path.read_text(encoding="utf-8")):
                found.append((str(path.relative_to(ROOT)), page, anchor))
    for path in sorted(DOCS.glob("*.md")):
        for page, anchor in LINK.findall(path.read_text(encoding="utf-8")):
            found.append((str(path.relative_to(ROOT)), page or path.name, anchor))
    return found


def test_slugs_follow_the_renderer() -> None:
    assert slug("Operation states") == "operation-states"
    assert slug("server.limits") == "serverlimits"
    assert slug("get_operation_status") == "get_operation_status"


def test_every_cited_anchor_exists() -> None:
    citations = cited()
    assert any(where.startswith("server/") for where, _, _ in citations)  # the code does cite the docs
    missing = [
        f"{where}: {page}#{anchor}"
        for where, page, anchor in citations
        if not (DOCS / page).is_file() or anchor not in anchors(DOCS / page)
    ]
    assert missing == []


def test_the_fingerprint_example_of_the_contract() -> None:
    text = (DOCS / "contract.md").read_text(encoding="utf-8")
    document = '{"arguments":{"amount_cents":500,"charge":"ch_1"},"tool":"refund"}'
    assert f"`{document}`" in text
    arguments = canonical_json({"charge": "ch_1", "amount_cents": 500})
    expected = hashlib.sha256(document.encode("utf-8")).hexdigest()
    assert fingerprint("refund", arguments) == expected


# --- the README: a quick start a newcomer follows in order, every command as printed --------------------

README = ROOT / "README.md"
SH_BLOCK = re.compile(r"```sh\n(.*?)```", re.DOTALL)


def quick_start() -> str:
    text = README.read_text(encoding="utf-8")
    return text[text.index("## Quick start") : text.index("\n## ", text.index("## Quick start") + 1)]


def test_the_quick_start_is_short_in_order_and_wraps_servers_early() -> None:
    steps = quick_start()
    assert len(steps.splitlines()) <= 60
    order = [
        "pip install .",
        "source .venv/bin/activate",
        "commitgate claude-config",
        "policy init",
        "safe-retry",
    ]
    assert [steps.index(step) for step in order] == sorted(steps.index(step) for step in order)
    first_100 = "\n".join(README.read_text(encoding="utf-8").splitlines()[:100])
    assert "commitgate policy init --from-config" in first_100


def commands(path: Path) -> list[list[str]]:
    """Every `commitgate ...` line of the page's sh blocks, as its argv (comments dropped)."""
    found = []
    for block in SH_BLOCK.findall(path.read_text(encoding="utf-8")):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s+#\s", line)[0].strip()
            if line.startswith("commitgate ") and "..." not in line:
                found.append(shlex.split(line)[1:])
    return found


@pytest.mark.parametrize("page", ["README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))])
def test_every_command_a_page_prints_is_one_commitgate_takes(page: str) -> None:
    path = ROOT / page
    for argv in commands(path):
        try:
            build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{page}: `commitgate {shlex.join(argv)}` is not a valid command")
    if page == "README.md":
        assert ["demo", "--quick"] in commands(path)
        assert any(argv[:3] == ["policy", "init", "--from-config"] for argv in commands(path))


@pytest.mark.parametrize("page", ["README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))])
def test_installing_the_server_from_a_checkout_installs_its_client_beside_it(page: str) -> None:
    """`commitgate-client` is not on a package index: a server installed from a path needs it from one too."""
    for command in re.findall(r"pip install ([^`\n#&;]*)", (ROOT / page).read_text(encoding="utf-8")):
        words = shlex.split(command)
        if any(re.fullmatch(r"(\.|/path/to/commitgate)(\[[\w,-]+\])?", word) for word in words):
            assert any(word.rstrip("/").endswith("client") for word in words), (
                f"{page}: pip install {command}"
            )


@pytest.mark.parametrize("page", ["README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))])
def test_install_lines_and_client_entries_work_outside_a_checkout(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    assert "REPOSITORY-URL" not in text
    assert not re.search(r"pip install '?commitgate\[", text)  # not on a package index: a path is needed
    assert not re.search(r"pip install '\.\[", text.replace("inside it, pip install '.[", ""))
    bare = re.findall(r'"command":\s*"([^"/\\%]+)"', text)
    assert bare == [] or (page == "docs/wrapping.md" and bare == ["commitgate"])  # the one that says why not
