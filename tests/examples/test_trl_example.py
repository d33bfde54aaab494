"""examples/trl_sft.py with examples/ds_zero3_nvme.json: TRL's SFTTrainer, no memascend code, under
``memascend run`` trains to the same losses as the same command without it, and (``-m slow``,
SmolLM2-135M 4 x 256) with far less host memory.

TRL runs from its own venv (tests/examples/frameworks.py): the default-suite test skips when it is
absent, the slow test builds it. Peaks as in tests/examples/launch.py (``VmHWM``, ``VmLck`` polled over
the process tree).
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from memascend.config import DS_CONFIG_SECTION, MemAscendSettings
from tests.examples.frameworks import framework_python
from tests.examples.launch import EXAMPLES, result_line, run_measured

SCRIPT = EXAMPLES / "trl_sft.py"
DS_CONFIG = EXAMPLES / "ds_zero3_nvme.json"
MARKER = "TRL_SFT_RESULT"
_WORDS = ("the of and to a in that is was he for it with as his on be at by this had not are but from or have an "
          "they which one you were her all she there would their we him been has when who will more no if out so "
          "said what up its about into than them can only other new some could time these two may then do first").split()


def test_the_deepspeed_config_is_zero3_nvme_with_a_default_section():
    cfg = json.loads(DS_CONFIG.read_text())
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "nvme"
    assert MemAscendSettings.from_mapping(cfg[DS_CONFIG_SECTION]) == MemAscendSettings()


def chat_jsonl(path: Path, rows: int = 64) -> Path:
    """``rows`` two-turn conversations of seeded random words, as ``{"messages": [...]}`` lines."""
    rng = random.Random(7)

    def sentence(lo: int, hi: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))

    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": sentence(8, 24)},
                                                     {"role": "assistant", "content": sentence(16, 48)}]}) + "\n"
                            for _ in range(rows)))
    return path


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


def run_pair(python: Path, tmp_path: Path, model: Path, *extra: str, timeout_s: float = 900) -> dict:
    """The same command under ``memascend run`` and without it, at once: per name its run (as
    :func:`run_measured`) and ``result``."""
    data = chat_jsonl(tmp_path / "chat.jsonl")

    def command(name: str) -> list[str]:
        return [str(python), str(SCRIPT), "--model", str(model), "--data", str(data), "--deepspeed", str(DS_CONFIG),
                "--nvme-path", str(tmp_path / f"{name}-swap"), "--output", str(tmp_path / name), *extra]

    commands = [[sys.executable, "-m", "memascend", "run", "--", *command("memascend")], command("stock")]
    runs = run_measured(commands, tmp_path, [tmp_path / "memascend.log", tmp_path / "stock.log"], timeout_s)
    out = {}
    for name, run in zip(("memascend", "stock"), runs, strict=True):
        run["result"] = result_line(run["log"], MARKER)
        assert run["returncode"] == 0 and run["result"] is not None, run["log"][-4000:]
        out[name] = run
    return out


def _applied_lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if ln.startswith("memascend: applied")]


def test_sft_trainer_under_memascend_run_trains_as_without_it(tmp_path, smollm2_tokenizer):
    python = framework_python("trl", build=False)
    pair = run_pair(python, tmp_path, tiny_model(tmp_path / "tiny", smollm2_tokenizer), "--steps", "2",
                    "--seq-len", "64")
    ma, stock = pair["memascend"]["result"], pair["stock"]["result"]
    assert len(ma["losses_hex"]) == 2 and ma["losses_hex"] == stock["losses_hex"]
    assert ma["applied"] and ma["param_swapper"] == "PooledParamSwapper" and ma["sub_group_size"] < 10_000_000
    assert not stock["applied"] and stock["param_swapper"] == "AsyncPartitionedParameterSwapper"
    assert len(_applied_lines(pair["memascend"]["log"])) == 1 and not _applied_lines(pair["stock"]["log"])


def test_sft_trainer_lora_trains_under_memascend_run(tmp_path, smollm2_tokenizer):
    """LoRA (PEFT) adapters on every linear layer, the frozen base under ZeRO-3 on NVMe: one run
    under memascend run (stock DeepSpeed 0.19.8 stops at SmolLM2's first forward with "Not enough
    buffers 0 for swapping 1", so there is no stock pair to compare with)."""
    python = framework_python("trl", build=False)
    if subprocess.run([str(python), "-c", "import peft"], capture_output=True).returncode != 0:
        pytest.skip(f"no peft in {python}")
    data = chat_jsonl(tmp_path / "chat.jsonl")
    model = tiny_model(tmp_path / "tiny", smollm2_tokenizer)
    run = run_measured([[sys.executable, "-m", "memascend", "run", "--", str(python), str(SCRIPT), "--model",
                         str(model), "--data", str(data), "--deepspeed", str(DS_CONFIG), "--nvme-path",
                         str(tmp_path / "swap"), "--output", str(tmp_path / "out"), "--steps", "2", "--seq-len", "64",
                         "--lora-rank", "8"]], tmp_path, [tmp_path / "lora.log"])[0]
    result = result_line(run["log"], MARKER)
    assert run["returncode"] == 0 and result is not None, run["log"][-4000:]
    assert result["applied"] and len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])
    assert len(_applied_lines(run["log"])) == 1


@pytest.mark.slow
def test_sft_trainer_smollm2_peak_memory_against_the_same_command_without_memascend_run(tmp_path):
    from memascend.config import ModelConfig
    from memascend.models.loading import resolve_model

    python = framework_python("trl", build=True)
    model = resolve_model(ModelConfig(name_or_path="smollm2-135m")).hf_dir
    pair = run_pair(python, tmp_path, model, "--micro-batch", "4", "--seq-len", "256", "--steps", "3",
                    timeout_s=1800)
    ma, stock = pair["memascend"], pair["stock"]
    print(f"TRL SFTTrainer SmolLM2-135M: peak RSS {ma['peak_rss_kib']} / {stock['peak_rss_kib']} KiB, "
          f"locked {ma['peak_locked_kib']} / {stock['peak_locked_kib']} KiB; losses {ma['result']['losses']}")
    assert ma["result"]["losses_hex"] == stock["result"]["losses_hex"] and len(ma["result"]["losses_hex"]) == 3
    assert ma["result"]["applied"] and not stock["result"]["applied"]
    assert ma["peak_rss_kib"] <= 0.40 * stock["peak_rss_kib"]
    assert ma["peak_locked_kib"] <= 0.25 * stock["peak_locked_kib"]
