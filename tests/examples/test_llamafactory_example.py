"""examples/llamafactory/: LLaMA-Factory's own YAMLs (full fine-tune and LoRA), ``dataset_info.json`` and
a local alpaca file, with examples/ds_zero3_nvme.json; ``memascend run -- llamafactory-cli train ...`` trains to the same
per-step losses as the same command without it, and (``-m slow``, SmolLM2-135M, 4 x up to 256
tokens) with far less host memory.

LLaMA-Factory runs from its own venv (tests/examples/frameworks.py); the run tests skip, naming the
import error, where it does not import. llamafactory 0.9.5 imports torchaudio, which has no build on
the package index for a CPU-only torch 2.13: the venv gets a stand-in torchaudio whose import
succeeds and whose every use raises (text fine-tuning never uses it).
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.examples.frameworks import framework_python
from tests.examples.launch import EXAMPLES
from tests.examples.pairs import LF, check_slow, measure, run_pair
from tests.examples.test_trl_example import tiny_model


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_yaml_names_the_deepspeed_json_and_a_local_alpaca_dataset(method):
    cfg = yaml.safe_load((LF / f"sft_{method}_zero3_nvme.yaml").read_text())
    assert (cfg["stage"], cfg["finetuning_type"], cfg["do_train"]) == ("sft", method, True)
    if method == "lora":
        assert (cfg["lora_rank"], cfg["lora_target"], cfg["use_reentrant_gc"]) == (8, "all", False)
    assert (EXAMPLES.parent / cfg["deepspeed"]).resolve() == (EXAMPLES / "ds_zero3_nvme.json").resolve()
    info = json.loads((EXAMPLES.parent / cfg["dataset_dir"] / "dataset_info.json").read_text())
    rows = json.loads((LF / info[cfg["dataset"]]["file_name"]).read_text())
    assert len(rows) >= 16 and all(set(r) == {"instruction", "input", "output"} for r in rows)


@pytest.mark.parametrize("name", ["llamafactory-full", "llamafactory-lora"])
def test_llamafactory_one_step_under_memascend_run_trains_as_without_it(name, tmp_path, smollm2_tokenizer):
    python = framework_python("llamafactory", build=False)
    pair = run_pair(name, tmp_path, tiny_model(tmp_path / "tiny", smollm2_tokenizer), python=python,
                    shape={"micro_batch": 1, "seq_len": 64, "steps": 1}, timeout_s=600)
    ma, stock = pair["memascend"], pair["stock"]
    assert ma["returncode"] == stock["returncode"] == 0, ma["log"][-3000:] + stock["log"][-3000:]
    assert len(ma["losses"]) == 1 and [x.hex() for x in ma["losses"]] == [x.hex() for x in stock["losses"]]
    assert len(ma["applied_lines"]) == 1 and not stock["applied_lines"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llamafactory-full", "llamafactory-lora"])
def test_llamafactory_smollm2_peak_memory_against_the_same_command_without_memascend_run(name, tmp_path):
    """SmolLM2-135M 4 x up to 256 tokens, 3 steps: the record ``python3 -m tests.examples.pairs`` commits."""
    record = measure(name, tmp_path)
    print(f"{name}: peak RSS {record['peak_rss_ratio']:.3f}x, locked {record['peak_locked_ratio']:.3f}x")
    check_slow(name, record)
