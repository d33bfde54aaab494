"""End to end: ``memascend finetune`` with gradient clipping takes stage 3's per-parameter fp64
gradient norms with exact_norm (no fp64 copy of a partition) and gives stock DeepSpeed's losses
(``--engine baseline``, same command, run live) bit for bit: llama-tiny, bf16, 3 steps of 2 x 32
tokens, once with the default ``--max-grad-norm 1.0`` and once clipping at 0.01 (every step clipped,
so the clip coefficient, computed from the norms, scales every update).
"""

from __future__ import annotations

import pytest

from memascend.integrations.deepspeed.exact_norm import transient_bytes
from tests.conftest import finetune_report

pytest.importorskip("deepspeed")

ARGS = ["--from-scratch", "llama-tiny", "--grad-accum", "1", "--steps", "3", "--seq-len", "32", "--micro-batch", "2",
        "--eval-blocks", "0", "--no-save-model", "--report-to", "none"]


@pytest.mark.parametrize("max_grad_norm", [pytest.param("1.0", marks=pytest.mark.slow), "0.01"])  # 0.01: every step clips, so the norm scales every update
def test_exact_norm_runs_and_gives_stock_losses(tmp_path, max_grad_norm):
    ours = finetune_report(tmp_path, "memascend", ARGS, "--max-grad-norm", max_grad_norm)
    stock = finetune_report(tmp_path, "baseline", ARGS, "--max-grad-norm", max_grad_norm, "--engine", "baseline")
    grads = ours["memory_breakdown"]["gradient_buffers"]
    assert grads["grad_norm_path"] == "exact_chunked"
    assert grads["grad_norm_copy_bytes"] == transient_bytes(ours["model"]["largest_param_numel"])
    assert stock["memory_breakdown"]["gradient_buffers"]["grad_norm_path"] == "stock_copy"
    assert stock["memory_breakdown"]["gradient_buffers"]["grad_norm_copy_bytes"] == \
        8 * stock["model"]["largest_param_numel"]
    assert ours["deepspeed_config"]["gradient_clipping"] == float(max_grad_norm)
    assert ours["losses_hex"] == stock["losses_hex"]
