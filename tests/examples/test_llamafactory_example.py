"""examples/llamafactory/: LLaMA-Factory's own YAML, ``dataset_info.json`` and a local alpaca file, with
examples/ds_zero3_nvme.json; ``memascend run -- llamafactory-cli train ...`` trains to the same
per-step losses as the same command without it, and (``-m slow``, SmolLM2-135M, 4 x up to 256
tokens) with far less host memory.

LLaMA-Factory runs from its own venv (tests/examples/frameworks.py); the run tests skip, naming the
import error, where it does not import. llamafactory 0.9.5 imports torchaudio, which has no build on
the package index for a CPU-only torch 2.13: the venv gets a stand-in torchaudio whose import
succeeds and whose every use raises (text fine-tuning never uses it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.examples.frameworks import framework_python
from tests.examples.launch import EXAMPLES, run_measured
from tests.examples.test_trl_example import tiny_model

LF = EXAMPLES / "llamafactory"
YAML = LF / "sft_full_zero3_nvme.yaml"


def test_the_yaml_names_the_deepspeed_json_and_a_local_alpaca_dataset():
    cfg = yaml.safe_load(YAML.read_text())
    assert (cfg["stage"], cfg["finetuning_type"], cfg["do_train"]) == ("sft", "full", True)
    assert (EXAMPLES.parent / cfg["deepspeed"]).resolve() == (EXAMPLES / "ds_zero3_nvme.json").resolve()
    info = json.loads((EXAMPLES.parent / cfg["dataset_dir"] / "dataset_info.json").read_text())
    rows = json.loads((LF / info[cfg["dataset"]]["file_name"]).read_text())
    assert len(rows) >= 16 and all(set(r) == {"instruction", "input", "output"} for r in rows)


def _command(python: Path, tmp_path: Path, name: str, port: int, model: Path, *overrides: str) -> list[str]:
    cfg = json.loads((EXAMPLES / "ds_zero3_nvme.json").read_text())
    swap = tmp_path / f"{name}-swap"
    swap.mkdir()
    for key in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][key]["nvme_path"] = str(swap)
    (tmp_path / f"{name}-ds.json").write_text(json.dumps(cfg))
    # one process without a launcher: DeepSpeed's rendezvous variables; use_cpu for bf16 on a CPU host
    return ["env", "DS_ACCELERATOR=cpu", "RANK=0", "WORLD_SIZE=1", "LOCAL_RANK=0", "MASTER_ADDR=127.0.0.1",
            f"MASTER_PORT={port}", str(python.parent / "llamafactory-cli"), "train", str(YAML),
            f"model_name_or_path={model}", f"deepspeed={tmp_path / f'{name}-ds.json'}", f"dataset_dir={LF}",
            "use_cpu=true", f"output_dir={tmp_path / name}", *overrides]


def run_pair(python: Path, tmp_path: Path, model: Path, *overrides: str) -> dict:
    """The same ``llamafactory-cli train`` under ``memascend run`` and without it, at once: per name its
    run (as :func:`run_measured`) and ``losses`` (``trainer_state.json``'s, full precision)."""
    from memascend.train.dist import free_port

    commands = [[sys.executable, "-m", "memascend", "run", "--",
                 *_command(python, tmp_path, "memascend", free_port(), model, *overrides)],
                _command(python, tmp_path, "stock", free_port(), model, *overrides)]
    runs = run_measured(commands, EXAMPLES.parent, [tmp_path / "memascend.log", tmp_path / "stock.log"], 1800)
    out = {}
    for name, run in zip(("memascend", "stock"), runs, strict=True):
        assert run["returncode"] == 0, run["log"][-4000:]
        history = json.loads((tmp_path / name / "trainer_state.json").read_text())["log_history"]
        run["losses"] = [entry["loss"] for entry in history if "loss" in entry]
        run["applied_lines"] = [ln for ln in run["log"].splitlines() if ln.startswith("memascend: applied")]
        out[name] = run
    return out


def test_llamafactory_under_memascend_run_trains_as_without_it(tmp_path, smollm2_tokenizer):
    python = framework_python("llamafactory", build=False)
    pair = run_pair(python, tmp_path, tiny_model(tmp_path / "tiny", smollm2_tokenizer), "max_steps=2",
                    "cutoff_len=64")
    ma, stock = pair["memascend"], pair["stock"]
    assert len(ma["losses"]) == 2 and [x.hex() for x in ma["losses"]] == [x.hex() for x in stock["losses"]]
    assert len(ma["applied_lines"]) == 1 and not stock["applied_lines"]


@pytest.mark.slow
def test_llamafactory_smollm2_peak_memory_against_the_same_command_without_memascend_run(tmp_path):
    from memascend.config import ModelConfig
    from memascend.models.loading import resolve_model

    python = framework_python("llamafactory", build=True)
    model = resolve_model(ModelConfig(name_or_path="smollm2-135m")).hf_dir
    pair = run_pair(python, tmp_path, model, "max_steps=3", "per_device_train_batch_size=4")
    ma, stock = pair["memascend"], pair["stock"]
    print(f"LLaMA-Factory SmolLM2-135M: peak RSS {ma['peak_rss_kib']} / {stock['peak_rss_kib']} KiB, "
          f"locked {ma['peak_locked_kib']} / {stock['peak_locked_kib']} KiB; losses {ma['losses']}")
    assert [x.hex() for x in ma["losses"]] == [x.hex() for x in stock["losses"]] and len(ma["losses"]) == 3
    assert len(ma["applied_lines"]) == 1
    assert ma["peak_rss_kib"] <= 0.40 * stock["peak_rss_kib"]
    assert ma["peak_locked_kib"] <= 0.25 * stock["peak_locked_kib"]
