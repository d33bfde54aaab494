"""The resolved run a supervising parent hands to its job (memascend.train.handover): the config makes
the JSON round trip whole, the file is read back as written, and ``memascend finetune``'s first process
hands the job the run it resolved (output folder, budget choice) without the user's flags."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from memascend.config import build_run_config
from memascend.train import handover as ho
from memascend.train.run_state import STATE_DIR_ENV


def _configs(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
                              "memascend": {"param_prefetch_slots": 8, "optimizer_sub_group_numel": "auto"}}))
    yield build_run_config({}, {})
    yield build_run_config({}, {"model": {"from_scratch": "llama-tiny"}, "train": {"lr": 3e-4, "epochs": 1.5},
                                "offload": {"nvme_path": str(tmp_path / "a.store")}})
    yield build_run_config({"data": {"format": "chat", "columns": {"messages": "conv"}}},
                           {"deepspeed_config": str(ds), "train": {"resume": "auto", "steps": 7},
                            "host_memory_budget": 8 << 30, "output_dir": str(tmp_path / "out")})


def test_the_config_makes_the_json_round_trip_whole(tmp_path):
    for cfg in _configs(tmp_path):
        doc = json.loads(json.dumps(ho.config_to_json(cfg)))
        back = ho.config_from_json(type(cfg), doc)
        assert back == cfg
        # the fields equality leaves out, and the derived ones
        assert (back.ds_config_notes, back.train_given, back.user_ds_config) == \
            (cfg.ds_config_notes, cfg.train_given, cfg.user_ds_config)
        assert back.offload.swap_target == cfg.offload.swap_target and back.memascend == cfg.memascend
        assert isinstance(back.train_given, tuple) and isinstance(back.train.lr, float)


def test_a_dataclass_value_json_cannot_hold_is_refused():
    with pytest.raises(TypeError, match="cannot hand over"):
        ho.config_to_json({"x": object()})


def test_the_file_is_read_back_as_written(tmp_path, monkeypatch):
    cfg = next(_configs(tmp_path))
    assert ho.read_handover(tmp_path) is None
    path = ho.write_handover(tmp_path, ho.Handover(cfg=cfg, fresh_output=True, run_start_s=1000.25))
    assert path == tmp_path / ho.HANDOVER_NAME and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert ho.read_handover(tmp_path) == ho.Handover(cfg=cfg, fresh_output=True, run_start_s=1000.25)
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path))
    assert ho.handed_over().cfg == cfg
    monkeypatch.delenv(STATE_DIR_ENV)
    assert ho.handed_over() is None
    path.write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="format 99"):
        ho.read_handover(tmp_path)


def test_the_first_process_hands_the_job_the_resolved_run(tmp_path, monkeypatch, capsys):
    """In process, up to where the first process starts the job: the job's command carries none of the
    user's flags, and the handover holds the parsed config with its fresh output folder settled."""
    from memascend.cli.main import cli
    from memascend.train import supervisor

    started = []

    def supervise(cmd, handover=None):
        started.append((cmd, handover, os.path.isdir(handover.cfg.output_dir)))
        return 0

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", supervisor.SUPERVISED_ENV, STATE_DIR_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(supervisor, "supervise", supervise)
    monkeypatch.chdir(tmp_path)
    args = ["finetune", "--from-scratch", "llama-tiny", "--steps", "3", "--lr", "0.002", "--nvme-path", "swap"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(args=args, prog_name="memascend")
    assert exit_.value.code == 0, capsys.readouterr().err
    (cmd, handed, existed), = started
    assert cmd == [sys.executable, "-m", "memascend", "finetune"]
    assert handed.fresh_output and existed and handed.cfg.output_dir.startswith("runs/")
    want = build_run_config({}, {"model": {"from_scratch": "llama-tiny"}, "train": {"steps": 3, "lr": 0.002},
                                 "offload": {"nvme_path": "swap"}})
    assert handed.cfg == dataclasses.replace(want, output_dir=handed.cfg.output_dir)
    assert handed.cfg.train_given == want.train_given and 0 < handed.run_start_s
