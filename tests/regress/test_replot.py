"""``results.json`` read back (the README generator and ``memascend regress --replot`` use it)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from memascend.cli.main import cli
from memascend.regress.output import markdown_table
from memascend.regress.replot import read_results

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "baselines" / "cpu-2c-24g"


def _csv(path: Path, scale: float) -> None:
    rows = ["t_s,phase,rss_bytes,uss_bytes,hwm_bytes,locked_bytes,read_bytes,write_bytes,gpu_allocated_bytes,"
            "gpu_reserved_bytes"]
    for i, ph in enumerate(["load", "initialize", "forward", "backward", "step", "done"]):
        rows.append(f"{i},{ph},{int(scale * (i + 1) * 2**28)},,0,0,0,0,,")
    path.write_text("\n".join(rows) + "\n")


def test_committed_results_read_back_give_their_own_table():
    for folder in ("smoke", "cpu-full", "ablation"):
        md = (PROFILE / folder / "results.md").read_text()
        table = markdown_table(read_results(PROFILE / folder / "results.json"))
        assert table in md, folder


def test_replot_draws_timelines_from_kept_csvs_and_leaves_results_alone(tmp_path):
    doc = json.loads((PROFILE / "smoke" / "results.json").read_text())
    (tmp_path / "results.json").write_text(json.dumps(doc))
    name = doc["configs"][0]["config"]["name"]
    (tmp_path / "timelines").mkdir()
    _csv(tmp_path / "timelines" / f"{name}-baseline.csv", 2.0)
    run = tmp_path / name / "memascend"
    run.mkdir(parents=True)
    _csv(run / "memory_timeline.csv", 1.0)
    result = CliRunner().invoke(cli, ["regress", "--replot", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert f"timeline-{name}.png" in result.output
    assert (tmp_path / f"timeline-{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "timelines" / f"{name}-memascend.csv").is_file()  # kept for the next replot
    assert json.loads((tmp_path / "results.json").read_text()) == doc
