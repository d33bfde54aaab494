"""The measured numbers of README.md and docs/*.md equal what the committed baselines give
(``python3 -m tools.readme --write`` renders them; no training here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import readme
from tools.readme_blocks import Baselines, scaling_points

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rendered():
    return readme.render_all(Baselines(REPO / "baselines" / readme.PROFILE))


def _texts() -> dict[str, str]:
    return {str(f.relative_to(REPO)): f.read_text() for f in readme.doc_files()}


def test_every_number_block_matches_the_baselines(rendered):
    problems = readme.differences(_texts(), rendered)
    assert not problems, "\n".join(problems) + "\nrun: python3 -m tools.readme --write"


def test_the_blocks_live_in_the_readme_and_docs():
    where = {name: file for file, text in _texts().items() for name, _ in readme.readme_blocks(text)}
    assert set(where) == set(readme.BLOCKS)
    assert where["smoke-table"] == "docs/results.md" and where["gpu-golden-table"] == "docs/appliance.md"
    assert any(name == "caps-table" for name, _ in readme.readme_blocks((REPO / "README.md").read_text()))


def test_a_hand_edited_number_is_caught_and_rewritten(rendered):
    texts = _texts()
    table = rendered["smoke-table"]
    row = next(line for line in table.splitlines() if line.startswith("| smollm2"))
    cell = row.split(" | ")[1]
    edited = dict(texts, **{"docs/results.md": texts["docs/results.md"].replace(
        row, row.replace(f" | {cell} | ", " | 11.73 | ", 1), 1)})
    assert edited != texts
    problems = readme.differences(edited, rendered)
    assert any(p.startswith("smoke-table: docs/results.md") and "11.73" in p for p in problems), problems
    fixed = {f: readme.rewrite(t, rendered) for f, t in edited.items()}
    assert readme.differences(fixed, rendered) == []
    missing = {f: t.replace("<!-- generated: capped-notes -->", "<!-- capped-notes -->") for f, t in texts.items()}
    assert any(p.startswith("capped-notes: no") for p in readme.differences(missing, rendered))


def test_every_copy_of_a_repeated_block_is_checked(rendered):
    """The cap table is in the README and in docs/results.md: a stale copy in either is named."""
    texts = _texts()
    first = rendered["caps-table"].splitlines()[2]
    for file in ("README.md", "docs/results.md"):
        edited = dict(texts, **{file: texts[file].replace(first, first.replace("| 4 GiB |", "| 5 GiB |"), 1)})
        assert edited[file] != texts[file]
        assert [p.split(" line")[0] for p in readme.differences(edited, rendered)] == [f"caps-table: {file}"]


def test_scaling_figure_has_every_measured_size():
    pts = scaling_points(Baselines(REPO / "baselines" / readme.PROFILE))
    mine = sorted(p.param_numel for p in pts if p.engine == "memascend" and p.peak_rss_bytes)
    assert len(mine) == len(set(mine)) and mine[-1] > 2.7e9  # one point per size, up to llama-3b
    assert any(p.engine == "baseline" and p.peak_rss_bytes is None for p in pts)  # OOM-killed under the cap


def test_the_settings_reference_has_every_field_with_its_default(rendered):
    """docs/configuration.md's "memascend" table comes from MemAscendSettings itself."""
    import dataclasses

    from memascend.config.settings import MemAscendSettings

    table = rendered["memascend-settings"]
    for f in dataclasses.fields(MemAscendSettings):
        row = next(line for line in table.splitlines() if line.startswith(f"| `{f.name}` |"))
        assert row.split(" | ")[1].strip("`") == {True: "true", False: "false", None: "null"}.get(
            f.default, f'"{f.default}"' if isinstance(f.default, str) else str(f.default))
    assert len(table.splitlines()) == 2 + len(dataclasses.fields(MemAscendSettings))
