"""The README's measured numbers equal what the committed baselines give
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


def test_every_readme_number_block_matches_the_baselines(rendered):
    problems = readme.differences((REPO / "README.md").read_text(), rendered)
    assert not problems, "\n".join(problems) + "\nrun: python3 -m tools.readme --write"


def test_a_hand_edited_number_is_caught_and_rewritten(rendered):
    text = (REPO / "README.md").read_text()
    table = rendered["smoke-table"]
    row = next(line for line in table.splitlines() if line.startswith("| smollm2"))
    cell = row.split(" | ")[1]
    edited = text.replace(row, row.replace(f" | {cell} | ", " | 11.73 | ", 1), 1)
    assert edited != text
    assert any(p.startswith("smoke-table:") and "11.73" in p for p in readme.differences(edited, rendered))
    assert readme.differences(readme.rewrite(edited, rendered), rendered) == []
    missing = text.replace("<!-- generated: capped-notes -->", "<!-- capped-notes -->")
    assert any(p.startswith("capped-notes: no") for p in readme.differences(missing, rendered))


def test_scaling_figure_has_every_measured_size():
    pts = scaling_points(Baselines(REPO / "baselines" / readme.PROFILE))
    mine = sorted(p.param_numel for p in pts if p.engine == "memascend" and p.peak_rss_bytes)
    assert len(mine) == len(set(mine)) and mine[-1] > 2.7e9  # one point per size, up to llama-3b
    assert any(p.engine == "baseline" and p.peak_rss_bytes is None for p in pts)  # OOM-killed under the cap
