"""Every field of every config section is checked against its type, so a value from a --config TOML
file or a flag can never reach the run unchecked: non-finite numbers (nan, inf) in any float field,
a non-integer in an int field, a string where a number goes. The checks are generic (from the
dataclass annotations), so fields added later are covered too."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from memascend.config import (
    _SECTIONS,
    MAX_EPOCHS,
    MAX_SEED,
    MAX_STEPS,
    build_run_config,
    load_toml,
    parse_from_scratch,
)
from memascend.errors import UserError


def _fields_of(kind) -> list[tuple[str, str]]:
    out = []
    for section, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if kind in typing.get_args(hints[f.name]) or hints[f.name] is kind:
                out.append((section, f.name))
    return out


FLOAT_FIELDS = _fields_of(float)
INT_FIELDS = _fields_of(int)


def test_the_sections_have_float_and_int_fields():
    assert ("train", "lr") in FLOAT_FIELDS and ("train", "epochs") in FLOAT_FIELDS
    assert ("data", "seq_len") in INT_FIELDS and ("train", "steps") in INT_FIELDS


@pytest.mark.parametrize("section, name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_float_is_refused_naming_the_field(section, name, value):
    with pytest.raises(UserError, match=rf"\[{section}\] {name}\)? must be a finite number, got {value}"):
        build_run_config({}, {section: {name: value}})


@pytest.mark.parametrize("section, name", INT_FIELDS)
@pytest.mark.parametrize("value", [1.5, "7", True])
def test_int_field_takes_only_integers(section, name, value):
    with pytest.raises(UserError, match=rf"\[{section}\] {name}\)? must be a whole number"):
        build_run_config({}, {section: {name: value}})


def test_toml_nan_and_inf_literals_are_refused(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[train]\nlr = nan\n")
    with pytest.raises(UserError, match=r"--lr \(\[train\] lr\) must be a finite number, got nan"):
        build_run_config(load_toml(f), {})
    f.write_text("[train]\ngradient_clipping = -inf\n")
    with pytest.raises(UserError, match=r"\[train\] gradient_clipping must be a finite number, got -inf"):
        build_run_config(load_toml(f), {})


def test_bounds():
    with pytest.raises(UserError, match="--epochs must be at most"):
        build_run_config({}, {"train": {"epochs": MAX_EPOCHS * 10.0}})
    with pytest.raises(UserError, match="--steps must be at most"):
        build_run_config({}, {"train": {"steps": MAX_STEPS + 1}})
    assert build_run_config({}, {"train": {"steps": MAX_STEPS}}).train.steps == MAX_STEPS
    for seed in (-1, MAX_SEED + 1):
        with pytest.raises(UserError, match="--seed must be between 0 and"):
            build_run_config({}, {"train": {"seed": seed}})
    assert build_run_config({}, {"train": {"seed": MAX_SEED}}).train.seed == MAX_SEED


def test_from_scratch_values_are_checked():
    with pytest.raises(UserError, match="not a finite number: 'inf'"):
        parse_from_scratch("hidden=inf,layers=2,heads=4")
    with pytest.raises(UserError, match="from-scratch model: hidden_size must be a whole number"):
        build_run_config({}, {"model": {"from_scratch": {"hidden_size": "wide", "num_layers": 2, "num_heads": 4}}})
    with pytest.raises(UserError, match=r"invalid \[model\] settings"):
        build_run_config({}, {"model": {"from_scratch": {"hidden": 64}}})


def test_defaults_still_valid():
    cfg = build_run_config({}, {})
    assert cfg.train.lr == 1e-4 and cfg.offload.nvme_path
