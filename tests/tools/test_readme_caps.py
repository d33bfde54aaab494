"""The README's cap table and bytes-per-parameter fit (tools/readme_caps.py)."""

from __future__ import annotations

import pytest

from memascend.regress.compare import ConfigResult, RunMetrics
from memascend.regress.matrix import get_matrix
from tests.regress.bench_reports import LOSSES, make_report
from tools.readme_caps import FIT_MIN_NUMEL, bytes_per_param_fit

GIB = 1 << 30


def _result(name: str, numel: int, rss: dict[str, float | None]) -> ConfigResult:
    cfg = get_matrix("scaling").select(name)[0]
    metrics = {e: None if g is None else RunMetrics.from_report(
        make_report(rss_gib=g, locked_gib=0.1, step_s=1.0, losses=LOSSES, param_numel=numel)) for e, g in rss.items()}
    return ConfigResult(config=cfg, **metrics)


def test_fit_leaves_out_models_below_a_tenth_of_a_billion_and_engines_with_one_size():
    # memascend: 1 GiB + 0.5 byte/param exactly from 0.1 B up; llama-tiny far off the line is left out.
    sizes = {"llama-tiny-bf16-256x1": 3_277_120, "llama-0.1b-bf16-256x1": 113_274_432,
             "llama-1b-bf16-256x1": 1_002_522_624, "llama-3b-bf16-256x1": 2_768_403_456}
    results = [_result(name, n, {"baseline": 2.0 + 30 * n / GIB if n < 2e8 else None,
                                 "memascend": 5.0 if n < FIT_MIN_NUMEL else 1.0 + 0.5 * n / GIB})
               for name, n in sizes.items()]
    fit = bytes_per_param_fit(results)
    slope, icept, pts = fit["memascend"]
    assert slope == pytest.approx(0.5, rel=1e-6) and icept == pytest.approx(GIB, rel=1e-6)
    assert [n for n, _ in pts] == [113_274_432, 1_002_522_624, 2_768_403_456]
    assert "baseline" not in fit  # one size of at least 0.1 B: no line
