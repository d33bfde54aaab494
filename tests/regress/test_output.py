"""Outputs: scaling fit over the matrix's scaling series, markdown table, plots."""

from __future__ import annotations

import json

import pytest
from bench_reports import LOSSES, make_report

from memascend.regress.compare import GoldenTolerances, evaluate
from memascend.regress.matrix import get_matrix
from memascend.regress.output import markdown_table, scaling_fit, write_outputs


def _series_results():
    full = get_matrix("cpu-full")
    series = [c for c in full.configs if c.scaling][:3]
    out = []
    for i, cfg in enumerate(series):
        numel = (i + 1) * 100_000_000
        base = make_report(rss_gib=(20 * numel + 2 * 2**30) / 2**30, locked_gib=1, step_s=5, losses=LOSSES,
                           param_numel=numel)
        mine = make_report(rss_gib=(6 * numel + 1 * 2**30) / 2**30, locked_gib=0.2, step_s=5, losses=LOSSES,
                           param_numel=numel)
        out.append(evaluate(cfg, base, mine, golden=None, tol=GoldenTolerances()))
    # a non-series config with a wild peak must not bend the fit
    odd = next(c for c in full.configs if not c.scaling)
    out.append(evaluate(odd, make_report(rss_gib=50, locked_gib=1, step_s=5, losses=LOSSES, param_numel=7),
                        make_report(rss_gib=40, locked_gib=0.2, step_s=5, losses=LOSSES, param_numel=7),
                        golden=None, tol=GoldenTolerances()))
    return out


def test_scaling_fit_uses_only_the_series():
    fit = scaling_fit(_series_results())
    assert fit["baseline"]["bytes_per_param"] == pytest.approx(20, rel=1e-6)
    assert fit["baseline"]["intercept_bytes"] == pytest.approx(2 * 2**30, rel=1e-4)
    assert fit["memascend"]["bytes_per_param"] == pytest.approx(6, rel=1e-6)
    assert len(fit["memascend"]["points"]) == 3
    assert scaling_fit(_series_results()[:1]) is None


def test_write_outputs(tmp_path):
    results = _series_results()
    doc = write_outputs(results, tmp_path, {"matrix": "cpu-full", "profile": "t"}, timelines={})
    assert "scaling.png" in doc["plots"] and (tmp_path / "scaling.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "results.json").read_text())["scaling_fit"]["baseline"]["bytes_per_param"] > 0
    md = (tmp_path / "results.md").read_text()
    assert "bytes/param" in md and md.count("\n|") >= len(results) + 1
    assert markdown_table(results).splitlines()[0].startswith("| config |")


def test_scaling_plot_has_one_point_per_size_and_the_legend_outside(tmp_path):
    import matplotlib.pyplot as plt

    from memascend.regress.output import ScalingPoint, scaling_figure, scaling_points

    results = _series_results()
    points = scaling_points(results)
    assert sorted((p.engine, p.param_numel) for p in points) == sorted(
        (e, n * 100_000_000) for e in ("baseline", "memascend") for n in (1, 2, 3))
    points += [ScalingPoint("memascend", 2_000_000_000, 7 * 2**30, note="single run"),
               ScalingPoint("baseline", 1_000_000_000, None)]
    fig = scaling_figure(points, "t", scaling_fit(results), cap_bytes=16 * 2**30)
    ax = fig.axes[0]
    by_gid = {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}
    assert list(by_gid["scaling:memascend"].get_xdata()) == [0.1, 0.2, 0.3, 2.0]
    assert list(by_gid["scaling:baseline"].get_xdata()) == [0.1, 0.2, 0.3]
    assert list(by_gid["oom:baseline"].get_xdata()) == [1.0] and list(by_gid["oom:baseline"].get_ydata()) == [16.0]
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    assert not ax.get_legend().get_window_extent(r).overlaps(ax.get_window_extent(r))
    plt.close(fig)


def test_simulated_nodes_rows_are_labelled_per_node(tmp_path):
    from test_compare import _two_node_report

    from memascend.regress.output import table_rows

    two = get_matrix("cpu-full").select("smollm2-shakespeare-2nodes-r1")[0]
    one = get_matrix("smoke").select("smollm2-shakespeare-r1")[0]
    base, mine = _two_node_report((3.0, 3.0), (1.0, 1.0)), _two_node_report((1.2, 0.6), (0.1, 0.2))
    results = [evaluate(two, base, mine, golden=None, tol=GoldenTolerances()),
               evaluate(one, base, mine, golden=None, tol=GoldenTolerances())]
    rows = table_rows(results)
    assert rows[0][0] == "smollm2-shakespeare-2nodes-r1 [memory per node (largest of 2)]"
    assert rows[0][1:3] == ["3.00", "1.20"]  # the largest node's peaks
    assert rows[1][0] == "smollm2-shakespeare-r1" and rows[1][1:3] == ["6.00", "1.80"]
    write_outputs(results, tmp_path, {"matrix": "cpu-full", "profile": "t"}, timelines={})
    md = (tmp_path / "results.md").read_text()
    assert "| smollm2-shakespeare-2nodes-r1 [memory per node (largest of 2)] |" in md
    assert "`memory.max_node_peak_*`" in md
    write_outputs(results[1:], tmp_path, {"matrix": "smoke", "profile": "t"}, timelines={})
    assert "per node" not in (tmp_path / "results.md").read_text()


def _swap_io(read_mib: float, write_mib: float, step_s: float, floor_s: float, wait_s: float) -> dict:
    phase = {"read_bytes": 0, "write_bytes": 0, "io_wait_s": 0.0, "time_s": 1.0, "floor_s": 0.0,
             "time_over_floor": None}
    return {"bandwidth": {"read_bytes_per_s": 1e9, "write_bytes_per_s": 1e9},
            "median_step": {"read_bytes": read_mib * 2**20, "write_bytes": write_mib * 2**20, "io_wait_s": wait_s},
            "median_phase": {"forward_s": phase, "backward_s": phase,
                             "optimizer_step_s": {**phase, "time_s": step_s, "floor_s": floor_s,
                                                  "time_over_floor": step_s / floor_s}}}


def test_speed_table_has_time_ratio_phase_floors_and_bytes_ratio(tmp_path):
    from memascend.regress.output import speed_rows
    from memascend.regress.runner import merge_swap_io

    cfg = get_matrix("speed").configs[0]
    base = make_report(rss_gib=6, locked_gib=3, step_s=10, losses=LOSSES)
    mine = make_report(rss_gib=2, locked_gib=0.3, step_s=8, losses=LOSSES)
    base["swap_io"] = _swap_io(2000, 2000, 4.0, 2.0, 3.0)
    mine["swap_io"] = merge_swap_io([_swap_io(1000, 500, 3.0, 2.0, 1.0), _swap_io(1000, 500, 2.0, 2.0, 2.0),
                                     _swap_io(1000, 500, 2.2, 2.0, 1.5)])
    assert mine["swap_io"]["median_phase"]["optimizer_step_s"]["time_over_floor"] == pytest.approx(1.1)
    assert mine["swap_io"]["median_step"]["io_wait_s"] == 1.5
    res = evaluate(cfg, base, mine, golden=None, tol=GoldenTolerances())
    assert speed_rows([res]) == [[cfg.name, "0.800", "- / - / 2.00", "- / - / 1.10", "4,000", "1,500", "0.375",
                                  "3.00", "1.50"]]
    doc = write_outputs([res], tmp_path, {"matrix": "speed", "profile": "test"}, {})
    assert doc["configs"][0]["memascend"]["swap_io"]["median_step"]["io_wait_s"] == 1.5
    assert "## Speed against the disk floor" in (tmp_path / "results.md").read_text()
    # the optimizer step beside the next forward: the worker's time over the floor in the step's column
    worker = [_swap_io(1000, 500, 0.01, 2.0, 1.0) for _ in range(2)]
    for w, worker_s in zip(worker, (2.4, 2.8)):
        w["median_phase"]["optimizer_step_s"]["worker_s"] = worker_s
    mine["swap_io"] = merge_swap_io(worker)
    assert mine["swap_io"]["median_phase"]["optimizer_step_s"]["worker_over_floor"] == pytest.approx(1.3)
    assert speed_rows([evaluate(cfg, base, mine, golden=None, tol=GoldenTolerances())])[0][3] == "- / - / 1.30"
    # a run without swap I/O (a report from before it was measured) gives no row
    del base["swap_io"]
    assert speed_rows([evaluate(cfg, base, mine, golden=None, tol=GoldenTolerances())]) == []
