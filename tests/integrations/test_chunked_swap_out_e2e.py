"""End to end: gradients and the initial fp32 write-out streamed through a chunk-sized window
(chunked_swap_out) while the largest partition spans many chunks, with gradient accumulation 2.

One run in the default suite: llama-tiny (its 49152 x 64 embedding is 48 chunks of 64 Ki elements)
on a raw-store file; its per-step losses are stock DeepSpeed's (``--engine baseline``, recorded in
the ``baseline_losses_hex`` fixture) and the locked window is one chunk. The slow test
runs the same on a swap folder.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.integrations.test_grad_stream_e2e import ARGS

pytest.importorskip("deepspeed")

CHUNK_NUMEL = 64 * 1024
EMBEDDING_NUMEL = 49152 * 64
"""llama-tiny's largest parameter (one rank: its whole partition)."""


def _finetune(tmp_path, nvme: str, **section) -> dict:
    config = tmp_path / "chunk.json"
    config.write_text(json.dumps({"memascend": {"optimizer_chunk_numel": CHUNK_NUMEL, **section}}))
    out = tmp_path / "out"
    proc = run_cli(["finetune", *ARGS, "--deepspeed-config", str(config), "--output", str(out),
                    "--nvme-path", str(tmp_path / nvme)], tmp_path, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    report["losses_hex"] = [step["loss"].hex() for step in report["steps"]]
    return report


def _check(report: dict, backend: str, baseline_losses_hex: list[str]) -> None:
    assert report["nvme"]["backend"] == backend
    assert report["memascend_settings"]["optimizer_chunk_numel"] == CHUNK_NUMEL
    assert report["losses_hex"] == baseline_losses_hex
    locked = report["memory_breakdown"]["locked"]
    assert locked["optimizer_chunk_buffers_bytes"] > 0  # the step ran in chunks
    # Gradients and the fp32 write-out went through one chunk, not through the largest partition.
    assert locked["optimizer_window_bytes"] == CHUNK_NUMEL * 4 < EMBEDDING_NUMEL * 4 / 40
    # initialize_optimizer_states skipped its value-preserving round trips (chunked_step
    # make_initialize_optimizer_states): no buffer of the largest sub-group was ever handed out.
    # The manager's locked peak is then the window alone.
    assert locked["optimizer_swap_buffers"] == 0
    assert locked["optimizer_swap_buffers_bytes"] == locked["optimizer_window_bytes"]


@pytest.fixture(scope="module")
def on_raw_store(tmp_path_factory):
    return _finetune(tmp_path_factory.mktemp("chunked-swap-out"), "run.store")


def test_raw_store_chunk_window_and_stock_losses(on_raw_store, baseline_losses_hex):
    _check(on_raw_store, "raw_store", baseline_losses_hex)


@pytest.mark.slow
def test_swap_folder_chunk_window_and_stock_losses(tmp_path, baseline_losses_hex):
    _check(_finetune(tmp_path, "swap"), "folder", baseline_losses_hex)


def test_params_on_nvme_only_lean_init_and_stock_losses(tmp_path, baseline_losses_hex):
    """No DRAM copy of the 16-bit parameters (``param_dram_numel`` 0): the lean
    ``initialize_optimizer_states`` also skips stock's initial write of every partition to its swap
    file (the fp32 master narrowed back, the bytes already there), and the losses stay stock's."""
    report = _finetune(tmp_path, "swap", param_dram_numel=0)
    _check(report, "folder", baseline_losses_hex)
    assert report["memascend_settings"]["param_dram_numel"] == 0
    assert report["memory_breakdown"]["locked"]["param_writeback_buffer_bytes"] == 0  # never taken
