"""The drop-in resolves memascend's "auto" sizes when DeepSpeed builds the engine (no extra call).

The end-to-end check builds a tiny Llama the way an HF Trainer script does, in its own process
(``init_resolve_worker.py``); the wrapper's argument handling is checked in-process against a
stand-in for ``deepspeed.initialize``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memascend.config import ds_defaults, sizing
from memascend.config.settings import MemAscendSettings
from memascend.integrations.deepspeed import init_resolve

WORKER = Path(__file__).with_name("init_resolve_worker.py")


def _user_config(nvme: str = "/nvme", section: dict | None = None) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme},
                                 "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    if section is not None:
        cfg["memascend"] = section
    return cfg


def _stock_initialize(args=None, model=None, optimizer=None, model_parameters=None, config=None,
                      config_params=None, mpu=None):
    """Stands in for deepspeed.initialize: returns what it was given."""
    return {"args": args, "model": model, "config": config, "config_params": config_params}


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 64)  # 64,000 elements: the largest
        self.proj = torch.nn.Linear(64, 64, bias=False)
        self.head = self.embed  # tied: counted once


@pytest.fixture()
def wrapped():
    resolved: list[MemAscendSettings] = []
    state = {"settings": MemAscendSettings()}
    initialize = init_resolve.make_initialize(_stock_initialize, lambda: state["settings"], resolved.append)
    return initialize, state, resolved


def test_config_params_dict_is_resolved_from_the_model(wrapped, monkeypatch):
    initialize, _, resolved = wrapped
    world = 2
    monkeypatch.setenv("WORLD_SIZE", str(world))
    model = _Model()
    given = _user_config(section={})
    got = initialize(model=model, config_params=given)
    numels = [64_000, 64 * 64]
    expected, settings = sizing.prepare_ds_config(given, MemAscendSettings(), param_numels=numels, world_size=world)
    assert got["config"] == expected and got["config_params"] is None
    zero = got["config"]["zero_optimization"]
    assert zero["sub_group_size"] == sizing.auto_sub_group_numel(numels, world) and zero["reduce_bucket_size"] == 64_000
    assert resolved == [settings] and settings.grad_norm_sub_group_numel == ds_defaults.SUB_GROUP_NUMEL
    assert given == _user_config(section={})  # the caller's dict is left as it was


def test_a_json_path_in_args_is_read_and_handed_on_as_a_dict(wrapped, tmp_path, monkeypatch):
    initialize, _, _ = wrapped
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_user_config(section={})))
    args = argparse.Namespace(deepspeed_config=str(path), local_rank=0)
    got = initialize(args=args, model=_Model())
    assert got["args"].deepspeed_config is None and args.deepspeed_config == str(path)  # a copy
    assert got["args"].local_rank == 0 and got["config"]["zero_optimization"]["reduce_bucket_size"] == 64_000


def test_param_dram_auto_drops_the_dram_copy_of_a_large_model(wrapped, monkeypatch):
    initialize, _, _ = wrapped
    monkeypatch.setattr(sizing, "PARAM_DRAM_AUTO_MAX_BYTES", 1000)
    got = initialize(model=_Model(), config=_user_config(section={}))
    assert got["config"]["zero_optimization"]["offload_param"]["max_in_cpu"] == 0


def test_a_resolved_config_without_section_passes_unchanged(wrapped):
    initialize, state, resolved = wrapped
    # what memascend finetune gives: the sizes already written, no section
    state["settings"] = MemAscendSettings(optimizer_sub_group_numel=4096, reduce_bucket_numel=4096,
                                          param_dram_numel=None, param_pool_bytes=None)
    given = _user_config()
    got = initialize(model=_Model(), config=given)
    assert got["config"] is given and resolved == []


def test_not_applied_passes_through(wrapped):
    initialize, state, resolved = wrapped
    state["settings"] = None
    given = _user_config(section={})
    assert initialize(model=_Model(), config=given)["config"] is given and resolved == []


def test_what_cannot_be_resolved_is_said_on_stderr(wrapped, capsys):
    initialize, _, resolved = wrapped
    base64_config = "eyJ0cmFpbl9iYXRjaF9zaXplIjogMX0="
    assert initialize(model=_Model(), config=base64_config)["config"] == base64_config
    empty = torch.nn.Module()
    given = _user_config(section={})
    assert initialize(model=empty, config=given)["config"] is given
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all(line.startswith("memascend: warning: ") for line in lines)
    assert "cannot read the DeepSpeed config" in lines[0] and "without parameters" in lines[1]
    assert resolved == []


def test_a_section_other_than_the_applied_settings_is_said(wrapped, capsys):
    initialize, _, _ = wrapped
    initialize(model=_Model(), config=_user_config(section={"enable_param_pool": False}))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "differs from the settings applied" in err


def test_an_hf_style_engine_gets_the_sizes_memascend_finetune_resolves(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    proc = subprocess.run([sys.executable, str(WORKER), "--nvme", str(nvme)], capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("INIT_RESOLVE_REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    report = json.loads(lines[0].split(" ", 1)[1])
    assert report["engine"] == report["finetune"]
    assert report["engine"]["sub_group_size"] < ds_defaults.SUB_GROUP_NUMEL  # not DeepSpeed's 1e9
    assert report["norm_patched"] and report["user_config_untouched"] and report["reverted"]


def test_a_frozen_base_sizes_the_optimizer_from_the_trainable_parameters(wrapped, monkeypatch):
    """LoRA under the drop-in: the optimizer's chunk and sub-groups come from the parameters with
    ``requires_grad``, the reduce bucket from every parameter."""
    initialize, _, resolved = wrapped
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = _Model()
    model.embed.weight.requires_grad_(False)
    given = _user_config(section={})
    got = initialize(model=model, config_params=given)
    expected, settings = sizing.prepare_ds_config(given, MemAscendSettings(), param_numels=[64_000, 64 * 64],
                                                  optimizer_numels=[64 * 64])
    assert got["config"] == expected and resolved == [settings]
    assert got["config"]["zero_optimization"]["sub_group_size"] == sizing.auto_chunked_sub_group_numel(
        [64 * 64], sizing.AUTO_CHUNK_MIN_NUMEL)
    assert got["config"]["zero_optimization"]["reduce_bucket_size"] == 64_000
    assert init_resolve.model_param_numels(model, trainable_only=True) == [64 * 64]
