"""examples/trl_sft.py with examples/ds_zero3_nvme.json: TRL's SFTTrainer, no memascend code, full
fine-tuning and LoRA (PEFT), under ``memascend run`` trains to the same losses as the same command
without it, and (``-m slow``, SmolLM2-135M 4 x 256) with far less host memory (tests/examples/pairs.py
runs the pairs).

TRL runs from its own venv (tests/examples/frameworks.py): the default-suite tests skip when it is
absent, the slow tests build it. Peaks as in tests/examples/launch.py (``VmHWM``, ``VmLck`` polled over
the process tree).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from memascend.config import DS_CONFIG_SECTION, MemAscendSettings
from tests.examples.frameworks import framework_python
from tests.examples.pairs import DS_CONFIG, PAIRS, check_slow, measure, run_pair


def test_the_deepspeed_config_is_zero3_nvme_with_a_default_section():
    cfg = json.loads(DS_CONFIG.read_text())
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    assert MemAscendSettings.from_mapping(cfg[DS_CONFIG_SECTION]) == MemAscendSettings()
    # what lets stock DeepSpeed 0.19.8 train LoRA with parameters on NVMe (docs/usage.md)
    assert zero["stage3_max_reuse_distance"] == zero["stage3_prefetch_bucket_size"] == 0


def tiny_model(folder: Path, tokenizer) -> Path:
    """memascend's ``llama-tiny`` preset (random weights, seeded) with SmolLM2's tokenizer, saved."""
    import torch
    from transformers import AutoModelForCausalLM

    from memascend.config import parse_from_scratch
    from memascend.models.loading import llama_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(llama_config(parse_from_scratch("llama-tiny"))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", ["trl-full", "trl-lora"])
def test_sft_trainer_one_step_under_memascend_run_trains_as_without_it(name, tmp_path, smollm2_tokenizer):
    """One step on memascend's llama-tiny (LoRA: PEFT adapters on every linear layer, the frozen base
    on NVMe), with and without ``memascend run``: equal loss, memascend applied once, only there."""
    python = framework_python("trl", build=False)
    if PAIRS[name].lora_rank and subprocess.run([str(python), "-c", "import peft"], capture_output=True).returncode:
        pytest.skip(f"no peft in {python}")
    pair = run_pair(name, tmp_path, tiny_model(tmp_path / "tiny", smollm2_tokenizer), python=python,
                    shape={"micro_batch": 1, "seq_len": 64, "steps": 1}, timeout_s=600)
    ma, stock = pair["memascend"], pair["stock"]
    assert ma["returncode"] == stock["returncode"] == 0, ma["log"][-3000:] + stock["log"][-3000:]
    assert len(ma["losses"]) == 1 and [x.hex() for x in ma["losses"]] == [x.hex() for x in stock["losses"]]
    assert ma["result"]["applied"] and ma["result"]["param_swapper"] == "PooledParamSwapper"
    assert not stock["result"]["applied"] and stock["result"]["param_swapper"] == "AsyncPartitionedParameterSwapper"
    assert len(ma["applied_lines"]) == 1 and not stock["applied_lines"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["trl-full", "trl-lora"])
def test_sft_trainer_smollm2_peak_memory_against_the_same_command_without_memascend_run(name, tmp_path):
    """SmolLM2-135M 4 x 256, 3 steps: the record ``python3 -m tests.examples.pairs`` commits."""
    record = measure(name, tmp_path)
    print(f"{name}: peak RSS {record['peak_rss_ratio']:.3f}x, locked {record['peak_locked_ratio']:.3f}x")
    check_slow(name, record)
