"""End to end: ``memascend finetune --swap-activations`` writes the forward pass's saved tensors to the
swap folder and reads them back in the backward pass (memascend.io.activation_swap through the engine's
forward, memascend.integrations.deepspeed.activations): the per-step losses are stock DeepSpeed's bit for
bit (``baseline_losses_hex``: llama-tiny, gradient accumulation 2), the report counts the bytes moved,
and the store file is gone after the run."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.integrations.test_grad_stream_e2e import ARGS

pytest.importorskip("deepspeed")


def test_swapped_activations_give_stock_losses(tmp_path, baseline_losses_hex):
    out, swap = tmp_path / "out", tmp_path / "swap"
    proc = run_cli(["finetune", *ARGS, "--swap-activations", "--output", str(out), "--nvme-path", str(swap)],
                   tmp_path, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["memascend_settings"]["enable_activation_swap"] is True
    assert [step["loss"].hex() for step in report["steps"]] == baseline_losses_hex
    moved = report["memory_breakdown"]["activation_swap"]
    # 2 steps x 2 micro-batches, each saving at least its fp32 logits (2 x 32 tokens x 49152 x 4 bytes)
    assert moved["swapped_tensors"] >= 4 and moved["written_bytes"] >= 4 * 64 * 49152 * 4
    # autograd saves each micro-batch's fp32 logits twice: the second save is restored from the one write
    assert moved["deduplicated_tensors"] >= 4 and moved["deduplicated_bytes"] >= 4 * 64 * 49152 * 4
    assert 0 < moved["read_bytes"] <= moved["written_bytes"] and moved["kept_bytes"] == 0
    assert not list(swap.rglob("memascend-activations-*"))
    # the swap I/O meter counts them: the forward writes nothing else, the backward reads them back
    forward_written = sum(step["phase_io"]["forward_s"]["write_bytes"] for step in report["steps"])
    assert forward_written == moved["written_bytes"]
    assert sum(step["phase_io"]["backward_s"]["read_bytes"] for step in report["steps"]) >= moved["read_bytes"]



def test_a_dram_allowance_reaches_the_swapper_and_gives_stock_losses(tmp_path, baseline_losses_hex):
    # The "memascend" section's activation_dram_bytes: at these sizes a micro-batch saves one eligible
    # tensor (its 12 MiB of fp32 logits), which the allowance keeps in DRAM, so nothing is written;
    # which tensors of a longer pass stay and which go is tests/io/test_activation_swap.py's.
    allowance = 64 << 20
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"memascend": {"enable_activation_swap": True, "activation_dram_bytes": allowance}}))
    out, swap = tmp_path / "out", tmp_path / "swap"
    proc = run_cli(["finetune", *ARGS, "--deepspeed-config", str(ds), "--output", str(out), "--nvme-path", str(swap)],
                   tmp_path, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["memascend_settings"]["activation_dram_bytes"] == allowance
    assert [step["loss"].hex() for step in report["steps"]] == baseline_losses_hex
    moved = report["memory_breakdown"]["activation_swap"]
    assert moved["dram_allowance_bytes"] == allowance and moved["forwards"] == 4
    assert moved["dram_bytes"] >= 4 * 64 * 49152 * 4 and moved["max_forward_dram_bytes"] <= allowance
    assert moved["written_bytes"] == moved["read_bytes"] == moved["max_forward_swapped_bytes"] == 0
    assert not list(swap.rglob("memascend-activations-*"))
