"""The docs/ pages: every anchor that code or another page cites exists, and the contract's
fingerprint example is what the boundary computes."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from commitgate.server.core.boundary import canonical_json, fingerprint

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
