"""``--host-memory-budget``: the planner fills DRAM with what would be swapped, in the order that
removes the most NVMe bytes per byte, picks the sizing knobs that fit, fastest first, or refuses with
the smallest workable budget (memascend.plan.budget); nothing is trained here (the run under a cgroup
cap equal to the budget is tests/host/test_budget_cap.py, -m slow)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from memascend.cli.main import cli
from memascend.config import build_run_config
from memascend.config.settings import MemAscendSettings
from memascend.errors import UserError
from memascend.plan import budget as budget_mod
from memascend.plan.budget import (
    BUDGET_HEADROOM_FRACTION,
    apply_host_memory_budget,
    choose_for_budget,
    knobs_available,
    plan_candidates,
    smallest_workable_budget_bytes,
)
from memascend.plan.shapes import model_dims
from memascend.units import GIB


def _cfg(preset: str, **memascend):
    cfg = build_run_config({}, {"model": {"from_scratch": preset}, "train": {"micro_batch": 1,
                                "activation_checkpointing": True}, "data": {"seq_len": 256}})
    return dataclasses.replace(cfg, memascend=MemAscendSettings(**memascend)) if memascend else cfg


@pytest.fixture(scope="module")
def llama_1b():
    cfg = _cfg("llama-1b")
    return cfg, model_dims(cfg)


def test_a_generous_budget_keeps_everything_in_dram_with_the_fastest_knobs(llama_1b):
    cfg, dims = llama_1b
    choice = choose_for_budget(cfg, 64 * GIB, dims=dims)
    p = choice.plan.placement
    assert p.optimizer_kept_groups == p.optimizer_groups and p.nvme_step_bytes == 0
    assert choice.values["optimizer_dram_numel"] == choice.values["param_dram_numel"] == p.optimizer_kept_numel
    assert choice.values["param_pool_bytes"] is None and choice.step_cost_s == 0


def test_a_tight_budget_bounds_the_pool_and_fits_with_headroom(llama_1b):
    cfg, dims = llama_1b
    planned = plan_candidates(cfg, dims=dims)  # everything on NVMe
    fastest_peak = planned[0][2].peak_rss_bytes
    # Between the smallest workable budget and what the fastest settings need: something is given up.
    budget = (smallest_workable_budget_bytes(planned) + int(fastest_peak / (1 - BUDGET_HEADROOM_FRACTION))) // 2
    choice = choose_for_budget(cfg, budget, dims=dims)
    assert choice.plan.peak_rss_bytes <= (1 - BUDGET_HEADROOM_FRACTION) * budget
    first = {k.name: k.candidates(dims, cfg, 1)[0] for k in knobs_available()}
    assert isinstance(choice.values["param_pool_bytes"], int) or choice.values != first
    assert "host memory budget" in choice.describe() and "param_pool_bytes=" in choice.describe()
    assert "NVMe per step: read" in choice.describe()
    # Of everything that fits with everything on NVMe, nothing is expected to be faster.
    fitting = [c for c in planned if c[2].peak_rss_bytes <= (1 - BUDGET_HEADROOM_FRACTION) * budget]
    assert choice.step_cost_s <= min(c[3] for c in fitting)


def test_a_budget_nothing_fits_is_refused_with_the_smallest_workable_one(llama_1b):
    cfg, dims = llama_1b
    smallest = smallest_workable_budget_bytes(plan_candidates(cfg, dims=dims))
    with pytest.raises(UserError) as err:
        choose_for_budget(cfg, GIB, dims=dims)
    message = str(err.value)
    assert message.startswith("--host-memory-budget 1GiB is below the smallest workable budget "
                              f"{smallest / GIB:.2f} GiB for llama-1b (bf16, 1 x 256 tokens")
    assert "\n" not in message
    choose_for_budget(cfg, smallest, dims=dims)  # the budget it names fits


def test_a_knob_this_version_lacks_is_skipped(monkeypatch):
    fake = budget_mod.Knob("no_such_setting", lambda dims, cfg, w: (1, 2))
    monkeypatch.setattr(budget_mod, "KNOBS", (*budget_mod.KNOBS, fake))
    assert fake not in knobs_available()
    assert knobs_available()[0].name == "param_pool_bytes"


def test_no_budget_or_the_baseline_leaves_the_run_as_it_is():
    cfg = _cfg("llama-tiny")
    assert apply_host_memory_budget(cfg) is cfg
    capped = _cfg("llama-tiny", host_memory_budget="4GiB")
    assert apply_host_memory_budget(dataclasses.replace(capped, engine="baseline")).memascend == capped.memascend


def test_the_flag_wins_over_the_sections_key(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"memascend": {"host_memory_budget": "2GiB"}}')
    cfg = build_run_config({}, {"deepspeed_config": str(ds)})
    assert cfg.memascend.host_memory_budget == 2 * GIB
    cfg = build_run_config({}, {"deepspeed_config": str(ds), "host_memory_budget": 3 * GIB})
    assert cfg.memascend.host_memory_budget == 3 * GIB


def test_plan_prints_the_choice_and_plans_with_it():
    res = CliRunner().invoke(cli, ["plan", "--from-scratch", "llama-0.1b", "--micro-batch", "1", "--seq-len", "256",
                                   "--host-memory-budget", "8GiB", "--json"])
    assert res.exit_code == 0, res.output
    assert "memascend: host memory budget 8.00 GiB: param_dram_numel=" in res.stderr
    assert "optimizer_dram_numel=" in res.stderr and "NVMe per step" in res.stderr
    placement = json.loads(res.stdout)["memascend"]["placement"]
    assert placement["optimizer_kept_groups"] == placement["optimizer_groups"]  # 0.1b fits 8 GiB whole


def test_the_choice_in_a_forked_process_matches_and_refuses_alike():
    cfg = _cfg("llama-tiny", host_memory_budget="8GiB")
    values, line = budget_mod.choose_values_isolated(cfg)
    assert values == choose_for_budget(cfg, 8 * GIB).values and line.startswith("host memory budget 8.00 GiB")
    with pytest.raises(UserError, match="is below the smallest workable budget"):
        budget_mod.choose_values_isolated(_cfg("llama-tiny", host_memory_budget="1MiB"))


def test_with_the_activation_swap_the_headroom_keeps_activations_in_dram():
    cfg = build_run_config({}, {"lora": {"rank": 16, "target_modules": ["all-linear"]}, "train": {"loss_chunk_tokens": 256}})
    dims = model_dims(cfg)
    swap = dataclasses.replace(cfg, memascend=MemAscendSettings(enable_activation_swap=True))
    budget = 2 * GIB
    choice = choose_for_budget(swap, budget, dims=dims)
    allowance = choice.values["activation_dram_bytes"]
    usable = (1 - BUDGET_HEADROOM_FRACTION) * budget
    assert choice.settings.activation_dram_bytes == allowance > 0
    assert choice.plan.peak_rss_bytes <= usable < choice.plan.peak_rss_bytes + 2 * 64 * (1 << 20)  # the rest: rounding
    assert f"activation_dram_bytes={allowance}" in choice.describe()
    # the same placement and knobs as without the allowance: it only takes what they leave
    without = choose_for_budget(dataclasses.replace(cfg, memascend=MemAscendSettings(
        enable_activation_swap=True, activation_dram_bytes=0)), budget, dims=dims)
    assert {k: v for k, v in choice.values.items() if k != "activation_dram_bytes"} == without.values
    assert "activation_dram_bytes" not in without.values and without.settings.activation_dram_bytes == 0
    # without the swap nothing is added
    assert "activation_dram_bytes" not in choose_for_budget(cfg, budget, dims=dims).values
