"""--deepspeed-config against flags and --config (memascend/config/user_ds.py): a value the user set and a
different JSON value stop the run naming both; a JSON value nobody else set becomes the run's and is
reported; the same value twice is fine."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from memascend.config import build_run_config
from memascend.errors import UserError

DS = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": "auto"}},
      "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
      "zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/fast/swap"},
                            "offload_optimizer": {"device": "cpu", "nvme_path": "/fast/swap"}},
      "bf16": {"enabled": False}}


@pytest.fixture
def ds(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    return str(path)


def test_json_values_nobody_set_become_the_run_s_and_are_reported(ds):
    cfg = build_run_config({}, {"deepspeed_config": ds})
    t, o = cfg.train, cfg.offload
    assert (t.lr, t.micro_batch, t.grad_accum, t.dtype, t.weight_decay) == (3e-4, 2, 4, "fp32", 0.0)
    assert (o.param, o.optimizer, o.nvme_path) == ("nvme", "cpu", "/fast/swap")
    notes = "\n".join(cfg.ds_config_notes)
    for text in ("optimizer.params.lr = 0.0003 is the run's --lr (default 0.0001)",
                 "train_micro_batch_size_per_gpu = 2 is the run's --micro-batch (default 4)",
                 "zero_optimization.offload_optimizer.device = cpu is the run's --offload-optimizer (default nvme)",
                 "make the run's --dtype fp32 (default bf16)", "nvme_path = /fast/swap is the run's --nvme-path"):
        assert text in notes
    assert "weight_decay" not in notes  # "auto": not set
    # a JSON value equal to memascend's default is the JSON's all the same: said too
    assert "zero_optimization.offload_param.device = nvme is the run's --offload-param (the default as well)" in notes
    assert "ds_config_notes" not in cfg.to_dict()


@pytest.mark.parametrize("overrides, message", [
    ({"train": {"lr": 1e-4}}, "--lr 0.0001 disagrees with --deepspeed-config {ds}: optimizer.params.lr = 0.0003"),
    ({"train": {"micro_batch": 4}}, "--micro-batch 4 disagrees with --deepspeed-config {ds}: "
                                    "train_micro_batch_size_per_gpu = 2"),
    ({"offload": {"nvme_path": "/other"}}, "--nvme-path /other disagrees with --deepspeed-config {ds}: "
                                           "zero_optimization.offload_param.nvme_path = /fast/swap"),
    ({"offload": {"optimizer": "nvme"}}, "--offload-optimizer nvme disagrees with"),
    ({"train": {"dtype": "bf16"}}, "--dtype bf16 disagrees with --deepspeed-config {ds}: bf16/fp16 'enabled' allow"),
])
def test_a_flag_that_disagrees_stops_the_run_naming_both(ds, overrides, message):
    with pytest.raises(UserError) as exc:
        build_run_config({}, {"deepspeed_config": ds, **overrides})
    assert message.format(ds=ds) in str(exc.value) and "(give one of them)" in str(exc.value)


def test_a_note_names_the_flag_that_sets_the_value(tmp_path):
    """The flag comes from the schema: gradient_clipping is set by --max-grad-norm."""
    path = tmp_path / "clip.json"
    path.write_text(json.dumps({"gradient_clipping": 0.5}))
    cfg = build_run_config({}, {"deepspeed_config": str(path)})
    assert cfg.train.gradient_clipping == 0.5
    assert cfg.ds_config_notes == (f"{path}: gradient_clipping = 0.5 is the run's --max-grad-norm (default 1)",)


def test_a_config_file_value_counts_as_set_and_agreeing_values_pass(ds):
    with pytest.raises(UserError, match=r"^run.toml: train.lr 0.0001 disagrees with"):
        build_run_config({"train": {"lr": 1e-4}}, {"deepspeed_config": ds}, file_name="run.toml")
    cfg = build_run_config({}, {"deepspeed_config": ds, "train": {"lr": 3e-4, "micro_batch": 2, "dtype": "fp32"},
                                "offload": {"nvme_path": "/fast/swap/"}})
    assert cfg.train.lr == 3e-4 and "--lr" not in "".join(cfg.ds_config_notes)


def test_two_nvme_paths_in_the_json_are_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"offload_param": {"nvme_path": "/a"},
                                                      "offload_optimizer": {"nvme_path": "/b"}}}))
    with pytest.raises(UserError, match="differ; memascend swaps both to one --nvme-path"):
        build_run_config({}, {"deepspeed_config": str(path)})


def test_a_json_value_of_the_wrong_type_names_the_json_key(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2.5}))
    with pytest.raises(UserError, match=r"ds.json: train_micro_batch_size_per_gpu: Input should be a valid integer"):
        build_run_config({}, {"deepspeed_config": str(path)})


def test_the_rendered_json_is_what_the_run_config_says(ds):
    from memascend.config.render import ModelShape, resolve

    cfg = build_run_config({}, {"deepspeed_config": ds, "model": {"from_scratch": "llama-tiny"}})
    run = resolve(cfg, ModelShape(1000, (600, 400), (1, 1)), world_size=1)
    assert run.ds_config["optimizer"]["params"]["lr"] == cfg.train.lr == 3e-4
    assert (run.micro_batch, run.grad_accum) == (cfg.train.micro_batch, cfg.train.grad_accum) == (2, 4)


def test_plan_prints_the_notes(ds):
    from memascend.cli.main import cli

    res = CliRunner().invoke(cli, ["plan", "--from-scratch", "llama-tiny", "--deepspeed-config", ds, "--json"])
    assert res.exit_code == 0, res.output
    assert "memascend: note: " in res.stderr and "is the run's --lr" in res.stderr
    json.loads(res.stdout)


@pytest.mark.parametrize("value, micro, accum, world", [
    (3, 4, 1, 1), (4, 4, 1, 1), (8, 4, 2, 1), (4, 4, 1, 2), (8, 4, 1, 1), (16, 2, 4, 1), (12, 2, 3, 1),
    (12, 2, 3, 2), (8, 2, 2, 2), (0, 4, 1, 1), (-4, 4, 1, 1)])
def test_train_batch_size_follows_deepspeed_s_batch_rule(tmp_path, value, micro, accum, world):
    """A ``train_batch_size`` in the JSON is refused exactly where DeepSpeed's own config fails its
    batch assertion (micro-batch x grad-accum x ranks): at build time what fails for every rank count,
    when the DeepSpeed config is rendered what fails for this one; one line naming the JSON."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from memascend.config.render import ModelShape, render_ds_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": value}))
    overrides = {"deepspeed_config": str(path), "train": {"micro_batch": micro, "grad_accum": accum}}
    try:
        cfg = build_run_config({}, overrides)
        render_ds_config(cfg, ModelShape(4096, (4096,), (1,)), world)
        refused = None
    except UserError as exc:
        refused = str(exc)
        assert refused.startswith(f"--deepspeed-config {path}: train_batch_size ") and "\n" not in refused
    assert (refused is None) == (value == micro * accum * world), refused
    if world == 1:  # DeepSpeed outside a process group counts one rank: its own check agrees
        batch = {"train_batch_size": value, "train_micro_batch_size_per_gpu": micro,
                 "gradient_accumulation_steps": accum}
        if refused is None:
            DeepSpeedConfig(batch)
        else:
            with pytest.raises(AssertionError):
                DeepSpeedConfig(batch)


@pytest.mark.parametrize("value", [2.0, "4", True, [4]])
def test_train_batch_size_that_is_not_a_whole_number_is_refused(tmp_path, value):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": value}))
    with pytest.raises(UserError, match=r'train_batch_size must be a whole number >= 1 \(or "auto"\), got '):
        build_run_config({}, {"deepspeed_config": str(path)})
    path.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2}))
    assert build_run_config({}, {"deepspeed_config": str(path)}).train.micro_batch == 2
