"""End to end: ``memascend finetune`` with the streamed gradients stored 16-bit (grad_store), one
micro step per step (llama-tiny, bf16, 3 steps of 2 x 32 tokens): the per-step losses are stock
DeepSpeed's (``--engine baseline``, same command, run live) bit for bit, on one rank and on two, and
the report says the files were bf16 and what that saved. The gradient-accumulation fallback to fp32
files is checked in test_grad_stream_e2e (its runs accumulate 2 micro steps); fp16 does not run on a
CPU (DeepSpeed refuses the dtype there), so it has no end-to-end case here.
"""

from __future__ import annotations

import pytest

from tests.conftest import finetune_report

pytest.importorskip("deepspeed")

ARGS = ["--from-scratch", "llama-tiny", "--grad-accum", "1", "--steps", "3", "--seq-len", "32", "--micro-batch", "2",
        "--eval-blocks", "0", "--no-save-model", "--report-to", "none"]


def _finetune(tmp_path, name: str, *extra: str) -> dict:
    return finetune_report(tmp_path, name, ARGS, *extra)


def _check_16bit(report: dict) -> None:
    files = report["memory_breakdown"]["gradient_buffers"]["swap_files"]
    assert report["memascend_settings"]["enable_16bit_gradient_swap"] is True
    assert files["stored_dtype"] == "bfloat16" and files["files_16bit"] > 0 and files["files_fp32"] == 0
    assert 0 < files["saved_write_bytes"] <= files["written_16bit_bytes"] + 4096 * files["files_16bit"]


def test_one_rank_16bit_gradient_files_give_stock_losses(tmp_path):
    ours = _finetune(tmp_path, "memascend")
    stock = _finetune(tmp_path, "baseline", "--engine", "baseline")
    _check_16bit(ours)
    assert stock["memory_breakdown"]["gradient_buffers"]["swap_files"] is None
    assert ours["losses_hex"] == stock["losses_hex"]


def test_two_ranks_16bit_gradient_files_give_stock_losses(tmp_path):
    """Two ranks reduce-scatter in bf16 (each partition is the bf16 mean), so the files are still
    exact."""
    ours = _finetune(tmp_path, "memascend", "--nproc", "2")
    stock = _finetune(tmp_path, "baseline", "--nproc", "2", "--engine", "baseline")
    _check_16bit(ours)
    assert ours["losses_hex"] == stock["losses_hex"]
    assert [s["rank_losses"] for s in ours["steps"]] == [s["rank_losses"] for s in stock["steps"]]
