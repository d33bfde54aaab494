"""The planner's term for the chunked build of the fp32 master weights
(:mod:`memascend.integrations.deepspeed.chunked_init`): planned only where a report says the build
ran chunk by chunk (``memory_breakdown.optimizer_init.fp32_partitions``); reports from before that
key plan as before."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from memascend.integrations.deepspeed.chunk_plan import grad_slab_numel
from memascend.plan import plan_for_report

REPORT = Path(__file__).parent / "data" / "heldout-caps" / "llama-1b-bf16-256x1-memascend.json"
"""A chunked run with every 16-bit partition on NVMe, recorded before the chunked build."""
SLAB = "16-bit read slab of the chunked fp32 master-weight build"


def _with_init(report: dict, path: str) -> dict:
    report = copy.deepcopy(report)
    report["memory_breakdown"]["optimizer_init"] = {"fp32_partitions": path}
    return report


def test_read_slab_planned_only_where_the_chunked_build_ran():
    report = json.loads(REPORT.read_text())
    assert "optimizer_init" not in report["memory_breakdown"]
    before = plan_for_report(report)
    assert not [c for c in before.components if c.name == SLAB]
    assert plan_for_report(_with_init(report, "stock")).components == before.components
    chunked = plan_for_report(_with_init(report, "chunked"))
    (slab,) = [c for c in chunked.components if c.name == SLAB]
    window = report["memory_breakdown"]["locked"]["optimizer_window_bytes"] // 4
    assert (slab.bytes, slab.phase, slab.locked) == (grad_slab_numel(window, False) * 4, "initialize", True)
    assert sorted(c.name for c in chunked.components if c.name != SLAB) == sorted(c.name for c in before.components)
