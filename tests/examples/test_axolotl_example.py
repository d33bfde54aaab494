"""examples/axolotl/: axolotl's own YAMLs (full fine-tune and LoRA) with examples/ds_zero3_nvme.json and
the alpaca file of the LLaMA-Factory example; ``memascend run -- torchrun --nproc-per-node 2 -m
axolotl.cli.train ...`` trains (``-m slow``, SmolLM2-135M, 4 x up to 256 tokens per rank) to the same
per-step losses as the same command without it, with far less host memory.

axolotl runs from its own venv (tests/examples/frameworks.py); the run tests skip, naming the import
error, where it does not import. Two ranks: with one, axolotl initialises NCCL, which a CPU-only
torch lacks. Both commands of a pair carry the harness's observer plugin
(tests/examples/axolotl_result.py: the losses at full precision, the parameter swapper's class).
"""

from __future__ import annotations

import json
import math

import pytest
import yaml

from tests.examples.frameworks import framework_python
from tests.examples.launch import EXAMPLES
from tests.examples.pairs import AXOLOTL, check_slow, measure, run_pair
from tests.examples.test_trl_example import tiny_model


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_yaml_names_the_deepspeed_json_a_local_alpaca_file_and_the_cpu_plugin(method):
    cfg = yaml.safe_load((AXOLOTL / f"sft_{method}_zero3_nvme.yaml").read_text())
    assert (EXAMPLES.parent / cfg["deepspeed"]).resolve() == (EXAMPLES / "ds_zero3_nvme.json").resolve()
    assert cfg["plugins"] == ["examples.axolotl.cpu_host.UseCpuPlugin"] and (AXOLOTL / "cpu_host.py").is_file()
    (dataset,) = cfg["datasets"]
    assert (dataset["type"], dataset["ds_type"], cfg["bf16"], cfg["save_strategy"]) == ("alpaca", "json", True, "no")
    rows = json.loads((EXAMPLES.parent / dataset["path"]).read_text())
    assert len(rows) >= 24 and all(set(r) == {"instruction", "input", "output"} for r in rows)
    if method == "lora":
        assert (cfg["adapter"], cfg["lora_r"], cfg["lora_target_linear"]) == ("lora", 8, True)
        # axolotl's fused LoRA kernels are CUDA-only: turned off for a CPU host
        assert not any(cfg[f"lora_{k}_kernel"] for k in ("mlp", "qkv", "o", "embedding"))
    else:
        assert "adapter" not in cfg


@pytest.mark.parametrize("name", ["axolotl-full", pytest.param("axolotl-lora", marks=pytest.mark.slow)])
def test_axolotl_one_step_under_memascend_run(name, tmp_path, smollm2_tokenizer):
    """One step on memascend's llama-tiny, two ranks, under ``memascend run`` only (about a minute on
    two cores, most of it axolotl's start-up; LoRA with ``-m slow``; the pairs are the slow tests):
    it trains, memascend is applied once (rank 0's line) and DeepSpeed's parameters go through
    memascend's swapper."""
    python = framework_python("axolotl", build=False)
    run = run_pair(name, tmp_path, tiny_model(tmp_path / "tiny", smollm2_tokenizer), python=python,
                   shape={"micro_batch": 1, "seq_len": 64, "steps": 1}, timeout_s=600,
                   engines=("memascend",))["memascend"]
    assert run["returncode"] == 0, run["log"][-4000:]
    assert len(run["losses"]) == 1 and math.isfinite(run["losses"][0]), run["result"]
    assert run["result"]["applied"] and run["result"]["param_swapper"] == "PooledParamSwapper"
    assert run["result"]["bf16"] and run["result"]["use_cpu"]
    assert len(run["applied_lines"]) == 1 and "(2 ranks;" in run["applied_lines"][0], run["applied_lines"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["axolotl-full", "axolotl-lora"])
def test_axolotl_smollm2_peak_memory_against_the_same_command_without_memascend_run(name, tmp_path):
    """SmolLM2-135M 4 x up to 256 tokens per rank, 2 ranks, 3 steps: the record
    ``python3 -m tests.examples.pairs`` commits."""
    record = measure(name, tmp_path)
    print(f"{name}: peak RSS {record['peak_rss_ratio']:.3f}x, locked {record['peak_locked_ratio']:.3f}x")
    check_slow(name, record)
