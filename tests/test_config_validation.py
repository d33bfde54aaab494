"""Every field of every config section is checked against its type (pydantic, strict: memascend/config/validate.py),
so a value from a --config file or a flag can never reach the run unchecked: non-finite numbers (nan, inf)
in any float field, a non-integer in an int field, a string where a number goes, a number where a string
goes. The checks are generic (from the dataclass annotations), so fields added later are covered too, and
every error names the field: the flag (``--lr: ...``) or the file and key (``run.toml: train.lr: ...``)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing

import pytest

from memascend.config import (
    MAX_EPOCHS,
    MAX_SEED,
    MAX_STEPS,
    build_run_config,
    load_config_file,
    parse_from_scratch,
)
from memascend.config.schema import SECTIONS
from memascend.errors import UserError


def _fields_of(kind) -> list[tuple[str, str]]:
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
            if hint is kind or (union and kind in typing.get_args(hint)):
                out.append((section, f.name))
    return out


FLOAT_FIELDS = _fields_of(float)
INT_FIELDS = _fields_of(int)
STR_FIELDS = _fields_of(str)
BOOL_FIELDS = _fields_of(bool)


def _flag(section: str, name: str) -> str:
    from memascend.config.schema import flag_name

    return flag_name(section, name)


def test_the_sections_have_float_and_int_fields():
    assert ("train", "lr") in FLOAT_FIELDS and ("train", "epochs") in FLOAT_FIELDS
    assert ("data", "seq_len") in INT_FIELDS and ("train", "steps") in INT_FIELDS


@pytest.mark.parametrize("section, name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_float_is_refused_naming_the_flag(section, name, value):
    with pytest.raises(UserError, match=rf"^{_flag(section, name)}: Input should be a finite number, got {value}$"):
        build_run_config({}, {section: {name: value}})


@pytest.mark.parametrize("section, name", FLOAT_FIELDS)
@pytest.mark.parametrize("value, message", [("1e-4", "a valid number"), (math.nan, "a finite number"),
                                            (True, "a valid number")])
def test_float_field_from_a_file_names_the_file_and_key(section, name, value, message):
    with pytest.raises(UserError, match=rf"^run.toml: {section}\.{name}: Input should be {message}, got "):
        build_run_config({section: {name: value}}, {}, file_name="run.toml")


@pytest.mark.parametrize("section, name", INT_FIELDS)
@pytest.mark.parametrize("value", [1.5, 2.0, "7", True])
def test_int_field_takes_only_integers(section, name, value):
    with pytest.raises(UserError, match=rf"^{_flag(section, name)}: Input should be a valid integer, got {value!r}$"):
        build_run_config({}, {section: {name: value}})
    with pytest.raises(UserError, match=rf"^run.toml: {section}\.{name}: Input should be a valid integer"):
        build_run_config({section: {name: value}}, {}, file_name="run.toml")


@pytest.mark.parametrize("section, name", STR_FIELDS)
def test_str_field_takes_only_strings(section, name):
    with pytest.raises(UserError, match=rf"^c.yaml: {section}\.{name}: Input should be a valid string, got 3$"):
        build_run_config({section: {name: 3}}, {}, file_name="c.yaml")


@pytest.mark.parametrize("section, name", BOOL_FIELDS)
@pytest.mark.parametrize("value", [1, "yes"])
def test_bool_field_takes_only_true_or_false(section, name, value):
    with pytest.raises(UserError, match=rf"^c.yaml: {section}\.{name}: Input should be a valid boolean"):
        build_run_config({section: {name: value}}, {}, file_name="c.yaml")


def test_an_integer_is_a_number_and_a_flag_wins_over_the_file():
    assert build_run_config({"train": {"lr": 1}}, {}).train.lr == 1.0
    cfg = build_run_config({"train": {"lr": "1e-4"}}, {"train": {"lr": 3e-4}}, file_name="run.toml")
    assert cfg.train.lr == 3e-4  # the bad file value is never used: the flag replaced it


def test_unknown_keys_and_wrong_shapes_name_the_field():
    with pytest.raises(UserError, match=r"^run.toml: train.bogus: Unexpected keyword argument$"):
        build_run_config({"train": {"bogus": 1}}, {}, file_name="run.toml")
    with pytest.raises(UserError, match=r"^run.toml: engine: Input should be 'baseline' or 'memascend', got 'fast'$"):
        build_run_config({"engine": "fast"}, {}, file_name="run.toml")
    with pytest.raises(UserError, match=r"^--dtype: Input should be 'bf16', 'fp16' or 'fp32', got 'fp8'$"):
        build_run_config({}, {"train": {"dtype": "fp8"}})


def test_toml_nan_and_inf_literals_are_refused(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[train]\nlr = nan\n")
    with pytest.raises(UserError, match=r"run.toml: train.lr: Input should be a finite number, got nan"):
        build_run_config(load_config_file(f), {}, file_name=f)
    f.write_text("[data]\neval_blocks = -inf\n")
    with pytest.raises(UserError, match=r"run.toml: data.eval_blocks: Input should be a valid integer, got -inf"):
        build_run_config(load_config_file(f), {}, file_name=f)


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
    with pytest.raises(UserError, match="^--from-scratch: hidden_size: Input should be a valid integer, got 'wide'"):
        build_run_config({}, {"model": {"from_scratch": {"hidden_size": "wide", "num_layers": 2, "num_heads": 4}}})
    with pytest.raises(UserError, match=r"^--from-scratch: hidden_size: Field required$"):
        build_run_config({}, {"model": {"from_scratch": {"hidden": 64}}})


def test_defaults_still_valid():
    cfg = build_run_config({}, {})
    assert cfg.train.lr == 1e-4 and cfg.offload.nvme_path
