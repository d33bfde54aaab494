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
