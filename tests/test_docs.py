"""The documents' relative links point at files that exist (README.md, BENCHMARKS.md, docs/, benchmarks/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT

# [text](target) and [text](target "title"); images too. Code spans are removed first, so a
# link written inside backticks as an example is not checked.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)
DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").glob("*.md"),
               *(ROOT / "benchmarks").rglob("*.md")])


def relative_links(doc: Path) -> list[str]:
    """Every link target of ``doc`` that is a path in the repository (no scheme, not an anchor)."""
    text = CODE.sub("", doc.read_text(encoding="utf-8"))
    targets = (m.group(1) for m in LINK.finditer(text))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(doc: Path):
    missing = [t for t in relative_links(doc) if not (doc.parent / t.split("#")[0]).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to paths that do not exist: {missing}"
