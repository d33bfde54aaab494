"""Fixtures of the regression-suite tests."""

from __future__ import annotations

import pytest
from bench_reports import LOSSES, make_report


@pytest.fixture
def good_pair() -> tuple[dict, dict]:
    """Baseline 6.4 GiB / 2.9 GiB locked; memascend 2.4 / 0.6 GiB, same losses, same speed."""
    return (make_report(rss_gib=6.4, locked_gib=2.9, step_s=7.0, losses=LOSSES),
            make_report(rss_gib=2.4, locked_gib=0.6, step_s=7.1, losses=LOSSES))
