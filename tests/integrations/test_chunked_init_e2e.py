"""End to end: ``memascend finetune`` with every 16-bit partition on NVMe (``param_dram_numel: 0``)
builds the fp32 master weights chunk by chunk (:mod:`memascend.integrations.deepspeed.chunked_init`)
and registers the gradient hooks without gathering the partitioned parameters
(:mod:`memascend.integrations.deepspeed.grad_hook_setup`), and trains to stock DeepSpeed's losses
bit for bit: llama-tiny, bf16, the gradient-streaming test's two steps (compared with its recorded
``--engine baseline`` losses; ``slow``: with a live baseline run too, and on the raw store).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import finetune_report, run_cli
from tests.integrations.test_grad_stream_e2e import ARGS

pytest.importorskip("deepspeed")


def _no_dram_copy(tmp_path):
    config = tmp_path / "no-dram-copy.json"
    config.write_text(json.dumps({"memascend": {"param_dram_numel": 0}}))
    return str(config)


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chunked-init")
    return finetune_report(tmp, "memascend", ARGS, "--deepspeed-config", _no_dram_copy(tmp))


def test_chunked_build_gives_stock_losses(chunked, baseline_losses_hex):
    init = chunked["memory_breakdown"]["optimizer_init"]
    assert chunked["memory_breakdown"]["param_dram_copy"]["allocated_bytes"] == 0
    assert init["fp32_partitions"] == "chunked" and init["chunked_sub_groups"] >= 1
    assert 0 < init["read_slab_bytes"] <= (init["window_numel"] + 2048) * 4
    assert init["hook_setup_gathers_skipped"] >= 1
    assert chunked["losses_hex"] == baseline_losses_hex


@pytest.mark.slow
def test_live_baseline_and_the_dram_copy(tmp_path, chunked):
    stock = finetune_report(tmp_path, "baseline", ARGS, "--engine", "baseline")
    dram = finetune_report(tmp_path, "dram", ARGS)  # the default DRAM copy holds every partition: stock's build
    assert stock["memory_breakdown"]["optimizer_init"] == {"fp32_partitions": "stock",
                                                            "hook_setup_gathers_skipped": None}
    assert dram["memory_breakdown"]["optimizer_init"]["fp32_partitions"] == "stock"
    assert stock["losses_hex"] == chunked["losses_hex"] == dram["losses_hex"]


@pytest.mark.slow
def test_chunked_build_on_the_raw_store(tmp_path, baseline_losses_hex):
    """The 16-bit partitions read and the fp32 keys written through the raw store's ranged I/O."""
    out = tmp_path / "store"
    proc = run_cli(["finetune", *ARGS, "--deepspeed-config", _no_dram_copy(tmp_path), "--output", str(out),
                    "--nvme-path", str(tmp_path / "run.store")], tmp_path, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["memory_breakdown"]["optimizer_init"]["fp32_partitions"] == "chunked"
    assert [s["loss"].hex() for s in report["steps"]] == baseline_losses_hex
