"""The one table of DeepSpeed's defaults (:mod:`memascend.config.ds_defaults`) against the installed
DeepSpeed: every entry is read from the source it names."""

from __future__ import annotations

import importlib

import pytest

from memascend.config import ds_defaults
from memascend.config.ds_defaults import DS_DEFAULTS, ds_default, ds_value


def _installed(source: str) -> int:
    module_name, _, attr = source.partition(":")
    module = importlib.import_module(module_name)
    if "." not in attr:
        return getattr(module, attr)
    class_name, field_name = attr.split(".")
    return getattr(module, class_name).model_fields[field_name].default


@pytest.mark.parametrize("path", sorted(DS_DEFAULTS))
def test_each_default_is_the_installed_deepspeeds(path):
    assert ds_default(path) == _installed(DS_DEFAULTS[path].source), DS_DEFAULTS[path].source


def test_the_installed_deepspeed_is_the_one_the_table_describes():
    import deepspeed

    assert deepspeed.__version__.startswith("0.19.8")


def test_a_config_value_wins_over_the_default():
    cfg = {"zero_optimization": {"sub_group_size": 123, "offload_param": {"buffer_count": 7}}}
    assert ds_value(cfg, "zero_optimization.sub_group_size") == 123
    assert ds_value(cfg, "zero_optimization.offload_param.buffer_count") == 7
    assert ds_value(cfg, "zero_optimization.offload_param.max_in_cpu") == ds_defaults.MAX_IN_CPU_NUMEL
    assert ds_value({"zero_optimization": None}, "zero_optimization.reduce_bucket_size") == 500_000_000
    with pytest.raises(KeyError):
        ds_default("zero_optimization.no_such_key")


def test_min_swappable_is_deepspeeds_rule():
    from deepspeed.runtime.swap_tensor.constants import AIO_BLOCK_SIZE_DEFAULT
    from deepspeed.runtime.swap_tensor.utils import MIN_AIO_BYTES

    assert ds_defaults.MIN_SWAPPABLE_BYTES == max(MIN_AIO_BYTES, AIO_BLOCK_SIZE_DEFAULT)
