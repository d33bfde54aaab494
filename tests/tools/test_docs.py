"""README.md and docs/: every relative link resolves (its #anchor too), the README stays short and
keeps the command CI runs, and the README, docs/, the package and tools/ carry no development history
(that goes in CHANGELOG.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are not links)."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text (a repeated heading gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#+ (.*)$", _FENCE.sub("", text), re.M):
        s = slug(m.group(1))
        out.add(f"{s}-{seen[s]}" if s in seen else s)
        seen[s] = seen.get(s, 0) + 1
    return out


def broken_links(path: Path) -> list[str]:
    """The relative links of ``path`` whose file or heading does not exist."""
    bad = []
    for target in _LINK.findall(_prose(path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        shown = dest.relative_to(REPO) if REPO in dest.parents else dest
        if not dest.exists():
            bad.append(f"{target}: no {shown}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{target}: no heading #{anchor} in {shown}")
    return bad


def test_slug_follows_github():
    assert slug("The GPU runner (`ci/gpu-regress.yml`)") == "the-gpu-runner-cigpu-regressyml"
    assert slug("A host-memory budget (`--host-memory-budget`)") == "a-host-memory-budget---host-memory-budget"
    assert slug("The ~1B Llama against stock tuned to fit this host") == "the-1b-llama-against-stock-tuned-to-fit-this-host"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Here\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#here) [file](missing.md) [anchor](other.md#there) `[code](nowhere.md)` "
                    "[web](https://example.com/x)\n")
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "other.md#there"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    assert path.is_file()
    assert not broken_links(path)


def test_the_readme_is_short_and_links_every_doc():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for doc in sorted((REPO / "docs").glob("*.md")):
        assert f"(docs/{doc.name})" in text, f"README.md does not link docs/{doc.name}"


def test_ci_runs_the_readmes_test_command():
    """The Quickstart's second command is what .ci/run runs."""
    command = "./install.sh --dev && python3 -m pytest"
    quickstart = (REPO / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert command in quickstart
    assert (REPO / ".ci" / "run").read_text().strip().splitlines()[-1] == command


_HISTORY = re.compile(r"\bissues? *#? *\d+|\b(before|after|until|since) (the )?issue\b|\bthe issue's\b", re.I)


def history(text: str) -> list[str]:
    """Lines of ``text`` that name an issue: development history, which belongs in CHANGELOG.md."""
    return [ln.strip() for ln in text.splitlines() if _HISTORY.search(ln)]


def test_history_is_recognised():
    assert history("memascend before issue 21\nIssue 3's target\nthe issue's shape\nissue #4\n") == [
        "memascend before issue 21", "Issue 3's target", "the issue's shape", "issue #4"]
    assert history("io_uring's only issuer\nwhat the issue tracker says about DeepSpeed #3062\n") == []


def test_no_development_history_in_docs_or_code():
    files = [REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "memascend").rglob("*.py"),
             *(REPO / "tools").rglob("*.py")]
    found = {str(f.relative_to(REPO)): h for f in files if (h := history(f.read_text()))}
    assert not found, f"name things for what they are; history goes in CHANGELOG.md: {found}"
