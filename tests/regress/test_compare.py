"""Comparison logic and thresholds on synthetic reports: every check can fail."""

from __future__ import annotations

import math

import numpy as np
import pytest
from bench_reports import LOSSES, make_report

from memascend.regress.compare import (
    GoldenTolerances,
    RunMetrics,
    check_losses,
    compare_golden,
    evaluate,
    fit_line,
    golden_entry,
)
from memascend.regress.matrix import MATRICES, BenchConfig, Thresholds

CFG = MATRICES["cpu-full"].select("smollm2-shakespeare-bf16-256x4")[0]  # issue 3's thresholds
TOL = GoldenTolerances()


def _failed(res) -> set[str]:
    return {c.name for c in res.checks if not c.ok}


def test_good_pair_passes(good_pair):
    res = evaluate(CFG, *good_pair, golden=None, tol=TOL)
    assert res.ok, [c.detail for c in res.checks]
    assert res.check("peak_rss_ratio").measured == pytest.approx(2.4 / 6.4, rel=1e-6)
    assert res.check("peak_locked_ratio").measured == pytest.approx(0.6 / 2.9, rel=1e-6)


def test_one_ulp_loss_difference_fails_bitwise(good_pair):
    base, mine = good_pair
    mine["steps"][1]["loss"] = math.nextafter(LOSSES[1], math.inf)
    res = evaluate(CFG, base, mine, golden=None, tol=TOL)
    assert _failed(res) == {"losses"}
    assert not res.ok


def test_different_training_dtype_fails(good_pair):
    base, mine = good_pair
    mine["model"]["param_dtype"] = "float16"
    res = evaluate(CFG, base, mine, golden=None, tol=TOL)
    assert _failed(res) == {"param_dtype"}


def test_loss_tolerance_when_not_bitwise():
    th = Thresholds(bitwise_losses=False, loss_rtol=1e-6)
    assert check_losses((1.0, 2.0), (1.0, 2.0 * (1 + 5e-7)), th).ok
    assert not check_losses((1.0, 2.0), (1.0, 2.0 * (1 + 5e-6)), th).ok
    assert not check_losses((1.0, 2.0), (1.0,), th).ok
    assert not check_losses((1.0, float("nan")), (1.0, float("nan")), th).ok


@pytest.mark.parametrize(("field", "value", "failing"), [
    ("rss", 2.7, "peak_rss_ratio"),        # 2.7 / 6.4 = 0.42 > 0.40
    ("locked", 0.8, "peak_locked_ratio"),  # 0.8 / 2.9 = 0.28 > 0.25
    ("step", 8.5, "step_time_ratio"),      # 8.5 / 7.0 = 1.21 > 1.05 + 0.15
])
def test_each_ratio_over_threshold_fails(field, value, failing):
    base = make_report(rss_gib=6.4, locked_gib=2.9, step_s=7.0, losses=LOSSES)
    kw = {"rss_gib": 2.4, "locked_gib": 0.6, "step_s": 7.0, "losses": LOSSES}
    kw[{"rss": "rss_gib", "locked": "locked_gib", "step": "step_s"}[field]] = value
    res = evaluate(CFG, base, make_report(**kw), golden=None, tol=TOL)
    assert _failed(res) == {failing}


def test_step_time_noise_allowance_is_separate():
    base = make_report(rss_gib=6.4, locked_gib=2.9, step_s=10.0, losses=LOSSES)
    mine = make_report(rss_gib=2.4, locked_gib=0.6, step_s=11.5, losses=LOSSES)  # 1.15x
    noisy = BenchConfig(name="x", thresholds=Thresholds(step_time_noise=0.15))
    quiet = BenchConfig(name="x", thresholds=Thresholds(step_time_noise=0.0))
    assert evaluate(noisy, base, mine, golden=None, tol=TOL).ok
    assert _failed(evaluate(quiet, base, mine, golden=None, tol=TOL)) == {"step_time_ratio"}


def test_two_ranks_use_summed_peaks():
    base = make_report(rss_gib=12.0, locked_gib=6.0, step_s=7.0, losses=LOSSES, ranks=2)
    m = RunMetrics.from_report(base)
    assert m.peak_rss_bytes == pytest.approx(12 * 2**30, abs=2)
    assert m.peak_locked_bytes == pytest.approx(6 * 2**30, abs=2)


def test_failed_run_is_an_error(good_pair):
    res = evaluate(CFG, good_pair[0], None, golden=None, tol=TOL, errors=["memascend: exit 1"])
    assert not res.ok and res.errors


def test_golden_within_tolerance_passes_and_beyond_fails():
    base = make_report(rss_gib=6.4, locked_gib=2.9, step_s=7.0, losses=LOSSES)
    mine = make_report(rss_gib=2.0, locked_gib=0.6, step_s=7.1, losses=LOSSES)
    gold = golden_entry(RunMetrics.from_report(base), RunMetrics.from_report(mine))
    assert evaluate(CFG, base, mine, golden=gold, tol=TOL).ok
    # 4 % more RSS: inside memory_rel 5 % and the ratio grows by 0.0125 < 0.03: passes.
    slightly = make_report(rss_gib=2.0 * 1.04, locked_gib=0.6, step_s=7.1, losses=LOSSES)
    assert evaluate(CFG, base, slightly, golden=gold, tol=TOL).ok
    # 8 % more RSS: still under the 40 % threshold, but worse than golden beyond 5 %.
    worse = make_report(rss_gib=2.0 * 1.08, locked_gib=0.6, step_s=7.1, losses=LOSSES)
    res = evaluate(CFG, base, worse, golden=gold, tol=TOL)
    assert res.check("peak_rss_ratio").ok
    assert "golden.peak_rss_bytes" in _failed(res)
    # A slower host slows both engines: the same-run ratio holds, the golden passes.
    slower = make_report(rss_gib=2.0, locked_gib=0.6, step_s=7.1 * 1.4, losses=LOSSES)
    base_slow = make_report(rss_gib=6.4, locked_gib=2.9, step_s=7.0 * 1.4, losses=LOSSES)
    assert evaluate(CFG, base_slow, slower, golden=gold, tol=TOL).ok
    # memascend alone 1.4x slower: the ratio 1.42 is 40 % above the golden's 1.014.
    mine_slow = make_report(rss_gib=2.0, locked_gib=0.6, step_s=7.1 * 1.4, losses=LOSSES)
    res = evaluate(CFG, base, mine_slow, golden=gold, tol=TOL)
    assert "golden.step_time_ratio" in _failed(res)
    assert res.check("golden.step_time_ratio").measured == pytest.approx(1.42, rel=1e-6)
    drift = [x * (1 + 1e-2) for x in LOSSES]
    res = evaluate(CFG, make_report(rss_gib=6.4, locked_gib=2.9, step_s=7.0, losses=drift),
                   make_report(rss_gib=2.0, locked_gib=0.6, step_s=7.1, losses=drift), golden=gold, tol=TOL)
    assert _failed(res) == {"golden.losses"}


def test_a_golden_without_stock_checks_memascend_alone():
    """An entry recorded where stock did not run (base ``None``) has no ratios; checked against a
    full pair it compares memascend's peaks and losses only, and a full entry checked against a run
    whose stock was stopped does the same."""
    base = make_report(rss_gib=6.4, locked_gib=2.9, step_s=7.0, losses=LOSSES)
    mine = RunMetrics.from_report(make_report(rss_gib=2.0, locked_gib=0.6, step_s=7.1, losses=LOSSES))
    alone = golden_entry(None, mine)
    assert alone["baseline"] is None and alone["peak_rss_ratio"] is alone["peak_locked_ratio"] is None
    names = {c.name for c in compare_golden(alone, RunMetrics.from_report(base), mine, TOL)}
    assert names == {"golden.peak_rss_bytes", "golden.peak_locked_bytes", "golden.losses"}
    full = golden_entry(RunMetrics.from_report(base), mine)
    assert {c.name for c in compare_golden(full, None, mine, TOL)} == names
    fatter = RunMetrics.from_report(make_report(rss_gib=2.0 * 1.08, locked_gib=0.6, step_s=7.1, losses=LOSSES))
    assert [c.name for c in compare_golden(alone, None, fatter, TOL) if not c.ok] == ["golden.peak_rss_bytes"]


def test_golden_losses_are_compared_only_on_the_same_cpu_kernels():
    base = make_report(rss_gib=6.4, locked_gib=2.9, step_s=7.0, losses=LOSSES)
    mine = make_report(rss_gib=2.0, locked_gib=0.6, step_s=7.1, losses=LOSSES)
    gold = golden_entry(RunMetrics.from_report(base), RunMetrics.from_report(mine), "avx512+amx")
    assert gold["cpu_isa"] == "avx512+amx"
    drift = [x * (1 + 1e-2) for x in LOSSES]
    drifted = (make_report(rss_gib=6.4, locked_gib=2.9, step_s=7.0, losses=drift),
               make_report(rss_gib=2.0, locked_gib=0.6, step_s=7.1, losses=drift))
    same = evaluate(CFG, *drifted, golden=gold, tol=TOL, cpu_isa="avx512+amx")
    assert _failed(same) == {"golden.losses"}
    other = evaluate(CFG, *drifted, golden=gold, tol=TOL, cpu_isa="avx2")
    assert other.ok and "not compared" in other.check("golden.losses").detail
    # memory is still held to the golden result on another CPU
    fatter = make_report(rss_gib=2.0 * 1.08, locked_gib=0.6, step_s=7.1, losses=drift)
    assert _failed(evaluate(CFG, drifted[0], fatter, golden=gold, tol=TOL, cpu_isa="avx2")) == {"golden.peak_rss_bytes"}


def test_cpu_isa_names_torch_kernel_level():
    import torch

    from memascend.regress.golden import cpu_isa

    assert cpu_isa().split("+")[0] == torch.backends.cpu.get_cpu_capability().lower()


def test_fit_line_recovers_slope_and_intercept():
    rng = np.random.default_rng(0)
    xs = rng.uniform(1e7, 3e9, size=8).tolist()
    ys = [18.5 * x + 1.2e9 for x in xs]
    slope, icept = fit_line(xs, ys)
    assert slope == pytest.approx(18.5, rel=1e-9)
    assert icept == pytest.approx(1.2e9, rel=1e-6)
    with pytest.raises(ValueError):
        fit_line([1.0], [2.0])
    with pytest.raises(ValueError):
        fit_line([1.0, 1.0], [2.0, 3.0])


def test_step_time_detail_shows_page_faults_when_both_reports_count_them(good_pair):
    base, mine = good_pair
    assert "page faults" not in evaluate(CFG, base, mine, golden=None, tol=TOL).check("step_time_ratio").detail
    base["median_minor_faults"], mine["median_minor_faults"] = 120_000, 480_000
    detail = evaluate(CFG, base, mine, golden=None, tol=TOL).check("step_time_ratio").detail
    assert detail.endswith("; page faults/step 480,000 / 120,000")
    mine["median_minor_faults"] = None  # a report from before they were counted
    assert "page faults" not in evaluate(CFG, base, mine, golden=None, tol=TOL).check("step_time_ratio").detail


def _two_node_report(rss_gib: tuple[float, float], locked_gib: tuple[float, float]) -> dict:
    """A report of two nodes of one rank each: every rank's sum and the largest node's differ."""
    rep = make_report(rss_gib=sum(rss_gib), locked_gib=sum(locked_gib), step_s=5.0, losses=LOSSES, ranks=2)
    ranks = [{"rank": n, "node_rank": n, "peak_rss_bytes": int(r * 2**30), "peak_locked_bytes": int(lk * 2**30)}
             for n, (r, lk) in enumerate(zip(rss_gib, locked_gib, strict=True))]
    nodes = [{"node_rank": r["rank"], "ranks": [r["rank"]], "sum_rank_peak_rss_bytes": r["peak_rss_bytes"],
              "sum_rank_peak_locked_bytes": r["peak_locked_bytes"]} for r in ranks]
    rep["memory"].update(ranks=ranks, nodes=nodes,
                         sum_rank_peak_rss_bytes=sum(r["peak_rss_bytes"] for r in ranks),
                         sum_rank_peak_locked_bytes=sum(r["peak_locked_bytes"] for r in ranks),
                         max_node_peak_rss_bytes=max(n["sum_rank_peak_rss_bytes"] for n in nodes),
                         max_node_peak_locked_bytes=max(n["sum_rank_peak_locked_bytes"] for n in nodes))
    return rep


def test_simulated_nodes_compare_memory_per_node_and_say_so():
    """Two-node config: the ratios use the largest node's peaks (not both nodes' sum), the checks and
    the golden entry say so; a one-node config of the same reports keeps every rank's sum."""
    cfg = MATRICES["cpu-full"].select("smollm2-shakespeare-2nodes-r1")[0]
    # baseline nodes 3.0 + 3.0 GiB, memascend 1.8 + 0.6 GiB: per node 1.8 / 3.0 = 0.6 fails the row's
    # 0.50, every rank summed (2.4 / 6.0 = 0.4) would pass
    base, mine = _two_node_report((3.0, 3.0), (1.0, 1.0)), _two_node_report((1.8, 0.6), (0.1, 0.2))
    res = evaluate(cfg, base, mine, golden=None, tol=TOL)
    assert cfg.thresholds.max_peak_rss_ratio == 0.50
    assert res.memascend.per_node and res.memascend.peak_rss_bytes == int(1.8 * 2**30)
    assert res.check("peak_rss_ratio").measured == pytest.approx(0.6, rel=1e-6)
    assert _failed(res) == {"peak_rss_ratio"}
    assert res.check("peak_locked_ratio").measured == pytest.approx(0.2 / 1.0, rel=1e-6)
    assert "per node (largest of 2)" in res.check("peak_rss_ratio").detail
    assert "per node (largest of 2)" in res.check("peak_locked_ratio").detail
    assert golden_entry(res.baseline, res.memascend)["memory_per_node"] is True
    one_node = evaluate(CFG, base, mine, golden=None, tol=TOL)
    assert not one_node.memascend.per_node and one_node.memascend.peak_rss_bytes == int(1.8 * 2**30) + int(0.6 * 2**30)
    assert one_node.check("peak_rss_ratio").measured == pytest.approx(0.4, rel=1e-6)
    assert "per node" not in one_node.check("peak_rss_ratio").detail
    assert "memory_per_node" not in golden_entry(one_node.baseline, one_node.memascend)


def test_swap_bytes_ratio_is_checked_only_where_a_limit_is_set():
    base = make_report(rss_gib=6.4, locked_gib=2.9, step_s=10.0, losses=LOSSES)
    mine = make_report(rss_gib=6.0, locked_gib=0.6, step_s=5.0, losses=LOSSES)
    base["swap_io"] = {"median_step": {"read_bytes": 600 << 20, "write_bytes": 400 << 20}}
    cfg = BenchConfig(name="x", thresholds=Thresholds(max_peak_rss_ratio=1.0, max_swap_bytes_ratio=0.30))
    mine["swap_io"] = {"median_step": {"read_bytes": 200 << 20, "write_bytes": 100 << 20}}  # 0.30
    res = evaluate(cfg, base, mine, golden=None, tol=TOL)
    assert res.ok and res.check("swap_bytes_ratio").measured == pytest.approx(0.30)
    mine["swap_io"] = {"median_step": {"read_bytes": 200 << 20, "write_bytes": 110 << 20}}  # 0.31
    assert _failed(evaluate(cfg, base, mine, golden=None, tol=TOL)) == {"swap_bytes_ratio"}
    del mine["swap_io"]  # not measured: a failure, not a pass
    assert _failed(evaluate(cfg, base, mine, golden=None, tol=TOL)) == {"swap_bytes_ratio"}
    unlimited = BenchConfig(name="x", thresholds=Thresholds(max_peak_rss_ratio=1.0))
    assert evaluate(unlimited, base, mine, golden=None, tol=TOL).check("swap_bytes_ratio") is None
