"""Which optimizer settings a resumed run trains with (in-process; the runs are in
tests/cli/test_resume_settings.py)."""

from __future__ import annotations

import json

import pytest

from memascend.config import TrainConfig, build_run_config
from memascend.errors import UserError
from memascend.train.resume_schedule import resumed_train, schedule_record

SAVED = schedule_record(TrainConfig(lr=1e-4, weight_decay=0.0, lr_scheduler="linear", warmup_steps=3), None)


def test_settings_left_out_continue_the_checkpoint_s():
    cfg = build_run_config({}, {"train": {"steps": 8}})
    train, note = resumed_train(cfg.train, cfg.train_given, SAVED, user_ds_config=None, where="ck")
    assert (train.lr, train.lr_scheduler, train.warmup_steps, train.steps) == (1e-4, "linear", 3, 8)
    assert note is None


def test_a_deepspeed_config_lr_counts_as_given(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 5e-3}}}))
    cfg = build_run_config({}, {"deepspeed_config": str(ds)})
    train, note = resumed_train(cfg.train, cfg.train_given, SAVED, user_ds_config=cfg.user_ds_config, where="ck")
    assert (train.lr, train.lr_scheduler) == (5e-3, "linear")
    assert note.startswith("--resume ck: lr 0.0001 -> 0.005 (given for this run) apply from the first resumed step")


def test_a_config_file_value_counts_as_given_and_an_equal_one_is_no_change():
    cfg = build_run_config({"train": {"lr_scheduler": "constant", "lr": 1e-4}}, {}, file_name="run.toml")
    train, note = resumed_train(cfg.train, cfg.train_given, SAVED, user_ds_config=None, where="ck")
    assert (train.lr_scheduler, train.warmup_steps) == ("constant", 3)
    assert note == ("--resume ck: lr schedule linear -> constant (given for this run) apply from the first resumed "
                    "step; the optimizer's moments and step count are the checkpoint's")


def test_a_checkpoint_without_the_record_resumes_with_this_run_s_settings():
    cfg = build_run_config({}, {"train": {"lr": 3e-4}})
    assert resumed_train(cfg.train, cfg.train_given, None, user_ds_config=None, where="ck") == (cfg.train, None)


def test_between_a_deepspeed_scheduler_and_memascend_s_is_refused():
    cfg = build_run_config({}, {})
    with pytest.raises(UserError, match="its learning-rate schedule came from memascend, this run's from the "
                                        "DeepSpeed config's \"scheduler\""):
        resumed_train(cfg.train, (), SAVED, user_ds_config={"scheduler": {"type": "WarmupLR"}}, where="ck")
