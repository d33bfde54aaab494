import pytest

from memascend.config import build_run_config
from memascend.config.ds_defaults import PARAM_BUFFER_SIZE_NUMEL
from memascend.config.render import ModelShape, render_ds_config
from memascend.config.user_ds import read_ds_config
from memascend.errors import UserError

SMALL = ModelShape(total_numel=10_000, param_numels=(5_000, 5_000), module_param_counts=(1, 1))


def test_stock_defaults_are_left_alone_when_they_work():
    ds, derived = render_ds_config(build_run_config({}, {}), SMALL, 1, "/swap")
    z = ds["zero_optimization"]
    assert derived == []
    assert "buffer_size" not in z["offload_param"] and "buffer_count" not in z["offload_param"]
    assert z["offload_param"]["nvme_path"] == "/swap" and z["offload_optimizer"]["device"] == "nvme"
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False


def test_buffer_size_derived_from_largest_partition_per_rank():
    big = ModelShape(total_numel=3 * 10**8, param_numels=(2 * 10**8, 10**8), module_param_counts=(1, 1))
    ds, derived = render_ds_config(build_run_config({}, {}), big, 1, "/swap")
    assert ds["zero_optimization"]["offload_param"]["buffer_size"] >= 2 * 10**8
    assert derived[0].stock_value == PARAM_BUFFER_SIZE_NUMEL and "3506" in derived[0].reason
    # with 2 ranks each partition is half as large and the stock size suffices
    _, derived2 = render_ds_config(build_run_config({}, {}), big, 2, "/swap")
    assert derived2 == []


def test_buffer_count_derived_for_modules_with_many_parameters():
    many = ModelShape(total_numel=100, param_numels=(10,) * 10, module_param_counts=(4,))
    ds, derived = render_ds_config(build_run_config({}, {}), many, 1, "/swap")
    assert ds["zero_optimization"]["offload_param"]["buffer_count"] == 9
    assert any("3062" in d.reason for d in derived)


def test_user_config_values_win_and_auto_is_filled(tmp_path):
    user = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "buffer_count": 8}},
        "memascend": {"enable_param_pool": True},
    }
    cfg = build_run_config({}, {"train": {"micro_batch": 3}})
    ds, _ = render_ds_config(cfg, SMALL, 1, "/swap", user)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_clipping"] == 0.5 and ds["optimizer"]["params"]["lr"] == 3e-3
    assert ds["zero_optimization"]["offload_param"]["buffer_count"] == 8
    assert "memascend" not in ds


def test_contradictions_are_user_errors(tmp_path):
    cfg = build_run_config({}, {})
    with pytest.raises(UserError, match="stage 2"):
        render_ds_config(cfg, SMALL, 1, "/swap", {"zero_optimization": {"stage": 2}})
    with pytest.raises(UserError, match="both bf16 and fp16"):
        render_ds_config(cfg, SMALL, 1, "/swap", {"fp16": {"enabled": True}})
    bad = tmp_path / "ds.json"
    bad.write_text("{\n  'single quotes': 1\n}")
    with pytest.raises(UserError, match="not valid JSON: line 2"):
        read_ds_config(str(bad))
