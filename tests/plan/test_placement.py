"""DRAM as a cache: the planned NVMe bytes per step against the swap I/O meter of recorded runs, the
fill order of ``--host-memory-budget`` and its choice over a range of budgets, and ``auto`` read from
a fake ``/proc/meminfo`` and memory cgroup. Planning only: nothing is trained."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from memascend.cli.main import cli
from memascend.config import build_run_config
from memascend.config.settings import MemAscendSettings
from memascend.errors import UserError
from memascend.plan import budget as budget_mod
from memascend.plan import host_fit
from memascend.plan.budget import BUDGET_HEADROOM_FRACTION, choose_for_budget, dram_fill_order, usable_bytes
from memascend.plan.model import plan_for_report
from memascend.plan.placement import measured_step_bytes
from memascend.plan.shapes import model_dims
from memascend.units import GIB

SWAP_IO = sorted((Path(__file__).parent / "data" / "swap-io").glob("*.json"))
"""Reports with the swap I/O meter's per-step bytes (``swap_io.median_step``, rank 0), bf16, params and
optimizer on NVMe (a swap folder): SmolLM2 4 x 256 stock and memascend (``memascend regress --matrix
speed``), SmolLM2 with ``param_dram_numel`` 0, llama-0.1b 1 x 256 with activation checkpointing and
``param_dram_numel`` 0, llama-tiny 2 x 128 with ``param_dram_numel`` 0, mistral-0.07b (untied) 2 x 256,
SmolLM2 on two ranks (``memascend finetune`` / the regress runner, 3-4 steps), and SmolLM2 with its first 7
of 13 optimizer sub-groups and 92 M parameter elements in DRAM (``optimizer_dram_numel`` 83182464,
``param_dram_numel`` 92032704, the seam's implementation of the setting, 3 steps), and the default job and
llama-1b 1 x 256 with 16-bit gradient files (``enable_16bit_gradient_swap``; the ``speed`` matrix's lean
rows, ``baselines/cpu-2c-24g/speed/sixteen-bit-gradients*``)."""
KEPT = Path(__file__).parent / "data" / "swap-io" / "smollm2-bf16-256x4-optimizer-dram-7of13-memascend.json"
TOLERANCE = 0.15


@pytest.mark.parametrize("path", SWAP_IO, ids=[p.stem for p in SWAP_IO])
def test_planned_nvme_bytes_per_step_within_15_percent_of_the_meter(path):
    report = json.loads(path.read_text())
    read_bytes, write_bytes = measured_step_bytes(report)
    p = plan_for_report(report).placement
    assert abs(p.read_bytes - read_bytes) <= TOLERANCE * read_bytes, (p.read_bytes, read_bytes)
    assert abs(p.write_bytes - write_bytes) <= TOLERANCE * write_bytes, (p.write_bytes, write_bytes)


def test_kept_optimizer_sub_groups_planned_within_15_percent_of_the_measured_peaks():
    report = json.loads(KEPT.read_text())
    plan = plan_for_report(report)
    assert plan.placement.optimizer_kept_groups == len(report["memory_breakdown"]["optimizer_dram"]["kept_sub_groups"])
    assert plan.placement.optimizer_kept_bytes == report["memory_breakdown"]["optimizer_dram"]["dram_bytes"]
    mem = report["memory"]
    for planned, measured in ((plan.peak_rss_bytes, mem["sum_rank_peak_rss_bytes"]),
                              (plan.peak_locked_bytes, mem["sum_rank_peak_locked_bytes"])):
        assert abs(planned - measured) <= TOLERANCE * measured, (planned, measured)


def test_at_least_two_recorded_reports_move_parameters_and_optimizer_state():
    assert len(SWAP_IO) >= 2
    moved = [json.loads(p.read_text()) for p in SWAP_IO]
    assert sum(plan_for_report(r).placement.param_read_bytes > 0 for r in moved) >= 2


@pytest.fixture(scope="module")
def llama_01b():
    cfg = build_run_config({}, {"model": {"from_scratch": "llama-0.1b"}, "train": {"micro_batch": 1,
                                "activation_checkpointing": True}, "data": {"seq_len": 256}})
    return cfg, model_dims(cfg)


def test_dram_is_filled_one_sub_group_at_a_time_in_benefit_order(llama_01b):
    cfg, dims = llama_01b
    order = dram_fill_order(cfg, 1, dims)
    assert order[0] == {"param_dram_numel": 0, "optimizer_dram_numel": 0}
    planner = budget_mod._Planner(cfg, dims, 1, None)
    for before, after in zip(order, order[1:], strict=False):
        moved = [k for k in before if after[k] != before[k]]
        assert len(moved) == 1 and after[moved[0]] > before[moved[0]]
    # The first move is the one that removes more NVMe bytes per byte of DRAM, as planned.
    here = planner(order[0])[2].placement
    gains = {}
    for key in order[0]:
        step = next(o[key] for o in order if o[key])
        there = planner({**order[0], key: step})[2].placement
        added = there.param_dram_bytes + there.optimizer_kept_bytes - here.param_dram_bytes - here.optimizer_kept_bytes
        gains[key] = (here.nvme_step_bytes - there.nvme_step_bytes) / added
    first = next(k for k in order[1] if order[1][k])
    assert gains[first] == max(gains.values())
    last = planner(order[-1])[2].placement
    assert last.nvme_step_bytes == 0 and last.optimizer_kept_groups == last.optimizer_groups


def test_a_bigger_budget_never_plans_more_nvme_bytes_nor_exceeds_its_usable_part(llama_01b):
    cfg, dims = llama_01b
    previous = None
    for gib in (2.5, 3, 4, 6, 8):
        choice = choose_for_budget(cfg, int(gib * GIB), dims=dims)
        assert choice.plan.peak_rss_bytes <= usable_bytes(int(gib * GIB))
        step = choice.plan.placement.nvme_step_bytes
        assert previous is None or step <= previous, f"{gib} GiB plans {step} NVMe bytes, more than {previous}"
        previous = step
    assert previous == 0  # 8 GiB holds all of llama-0.1b's state


def test_a_huge_budget_plans_no_optimizer_nvme_bytes(llama_01b):
    cfg, dims = llama_01b
    p = choose_for_budget(cfg, 256 * GIB, dims=dims).plan.placement
    assert p.optimizer_read_bytes == p.optimizer_write_bytes == p.optimizer_nvme_numel == 0


def test_a_refused_budget_names_the_smallest_that_fits(llama_01b):
    cfg, dims = llama_01b
    with pytest.raises(UserError) as err:
        choose_for_budget(cfg, GIB // 2, dims=dims)
    smallest_gib = float(str(err.value).split("smallest workable budget ")[1].split(" GiB")[0])
    choice = choose_for_budget(cfg, int((smallest_gib + 0.01) * GIB), dims=dims)
    assert choice.plan.peak_rss_bytes <= (1 - BUDGET_HEADROOM_FRACTION) * (smallest_gib + 0.01) * GIB


def _fake_host(tmp_path: Path, meminfo_kib: int, version: int | None, files: dict[str, str]) -> tuple[Path, Path]:
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {meminfo_kib} kB\n")
    line = {2: "0::/job\n", 1: "5:memory:/job\n", None: ""}[version]
    (proc / "self" / "cgroup").write_text(line)
    folder = cg / ("memory/job" if version == 1 else "job")
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return proc, cg


def test_auto_takes_mem_available_less_the_margin_without_a_cgroup_limit(tmp_path):
    proc, cg = _fake_host(tmp_path, 12 * 1024 * 1024, 2, {"memory.max": "max\n", "memory.current": "1000\n"})
    found = host_fit.auto_budget(proc, cg)
    assert found.limit_bytes == 12 * GIB - host_fit.AUTO_BUDGET_MARGIN_BYTES and "MemAvailable" in found.source


@pytest.mark.parametrize("version,files", [
    (2, {"memory.max": f"{8 * GIB}\n", "memory.current": f"{3 * GIB}\n", "memory.stat": f"inactive_file {GIB}\n"}),
    (1, {"memory.limit_in_bytes": f"{8 * GIB}\n", "memory.usage_in_bytes": f"{3 * GIB}\n",
         "memory.stat": f"total_inactive_file {GIB}\n"}),
], ids=["cgroup-v2", "cgroup-v1"])
def test_auto_takes_a_cgroup_limit_less_its_usage_beyond_page_cache(tmp_path, version, files):
    proc, cg = _fake_host(tmp_path, 20 * 1024 * 1024, version, files)
    found = host_fit.auto_budget(proc, cg)
    assert found.limit_bytes == 6 * GIB - host_fit.AUTO_BUDGET_MARGIN_BYTES  # 8 - (3 - 1) GiB, less the margin
    assert "cgroup limit" in found.source


def test_auto_with_nothing_left_is_refused_in_one_line(tmp_path):
    proc, cg = _fake_host(tmp_path, 512 * 1024, None, {})
    with pytest.raises(UserError, match="--host-memory-budget auto: only 0.50 GiB available"):
        host_fit.auto_budget(proc, cg)


def test_auto_is_a_setting_and_a_flag_resolved_before_planning(monkeypatch, tmp_path):
    assert MemAscendSettings(host_memory_budget="auto").host_memory_budget == "auto"
    with pytest.raises(UserError, match='a size such as "4GiB" or "auto"'):
        MemAscendSettings(host_memory_budget=True)
    monkeypatch.setattr(host_fit, "auto_budget", lambda: host_fit.HostMemory(6 * GIB, "a fake host"))
    cfg = build_run_config({}, {"model": {"from_scratch": "llama-tiny"}, "host_memory_budget": "auto"})
    resolved = budget_mod.resolve_auto_budget(cfg)
    assert resolved.memascend.host_memory_budget == 6 * GIB
    assert budget_mod.resolve_auto_budget(dataclasses.replace(cfg, memascend=MemAscendSettings())).memascend \
        .host_memory_budget is None
    res = CliRunner().invoke(cli, ["plan", "--from-scratch", "llama-tiny", "--micro-batch", "1", "--seq-len", "64",
                                   "--host-memory-budget", "auto", "--json"])
    assert res.exit_code == 0, res.output
    assert "host memory budget auto: 6.00 GiB (a fake host)" in res.stderr
    assert "host memory budget 6.00 GiB: param_dram_numel=" in res.stderr
    ds = tmp_path / "ds.json"
    ds.write_text('{"memascend": {"host_memory_budget": "auto"}}')
    assert build_run_config({}, {"deepspeed_config": str(ds)}).memascend.host_memory_budget == "auto"


def test_finetune_resolves_auto_once_and_hands_the_bytes_and_the_choice_on(monkeypatch, capsys):
    from memascend.cli.finetune import _with_budget_choice

    monkeypatch.setattr(host_fit, "auto_budget", lambda: host_fit.HostMemory(6 * GIB, "a fake host"))
    cfg = build_run_config({}, {"model": {"from_scratch": "llama-tiny"}, "train": {"micro_batch": 1},
                                "data": {"seq_len": 64}, "host_memory_budget": "auto"})
    with pytest.raises(UserError, match="resolved by the process that starts the ranks"):
        _with_budget_choice(cfg, None, say=False)  # a rank another launcher started
    chosen = _with_budget_choice(cfg, None, say=True)
    err = capsys.readouterr().err
    assert "memascend: host memory budget auto: 6.00 GiB (a fake host)" in err
    assert "memascend: host memory budget 6.00 GiB: param_dram_numel=" in err and "NVMe per step" in err
    assert chosen.memascend.host_memory_budget == 6 * GIB
    assert isinstance(chosen.memascend.optimizer_dram_numel, int) and isinstance(chosen.memascend.param_dram_numel, int)


def test_a_measured_bandwidth_prices_the_same_bytes(llama_01b):
    cfg, dims = llama_01b
    report = json.loads(next(p for p in SWAP_IO if "param-dram-0" in p.name).read_text())
    measured = budget_mod.Bandwidth.from_report(report)
    assert measured is not None and measured.read_bytes_per_s == report["swap_io"]["bandwidth"]["read_bytes_per_s"]
    assert budget_mod.Bandwidth.from_report({}) is None
    slow = budget_mod.Bandwidth(measured.read_bytes_per_s / 4, measured.write_bytes_per_s / 4)
    nominal = choose_for_budget(cfg, int(2.5 * GIB), dims=dims)
    priced = choose_for_budget(cfg, int(2.5 * GIB), dims=dims, bandwidth=slow)
    # a slower disk makes every byte dearer: the best choice costs more, and moves no more bytes
    assert priced.step_cost_s > nominal.step_cost_s
    assert priced.plan.placement.nvme_step_bytes <= nominal.plan.placement.nvme_step_bytes
