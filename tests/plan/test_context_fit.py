"""``memascend plan --cap-gib``: the longest ``--seq-len`` and the largest ``--micro-batch`` that fit,
against the recorded ``context`` search (``baselines/cpu-2c-24g/context``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from memascend.plan.context_fit import (
    SEQ_LENS,
    largest_micro_batch_under_cap,
    longest_seq_len_under_cap,
)
from memascend.units import GIB

CONTEXT = Path(__file__).resolve().parents[2] / "baselines" / "cpu-2c-24g" / "context" / "runs"


def _searched(engine: str, cap: str) -> dict[int, bool]:
    """``{tokens: trained under the cap}`` of the recorded search's runs of ``engine`` under ``cap``."""
    out = {}
    for path in CONTEXT.glob(f"llama-0.1b-bf16-*x1-{engine}-{cap}.cap.json"):
        tokens = int(path.name.split("-bf16-")[1].split("x1-")[0])
        out[tokens] = json.loads(path.read_text())["fit"]
    return out


def _searched_config():
    from memascend.config import build_run_config

    report = json.loads((CONTEXT / "llama-0.1b-bf16-1024x1-memascend-3g.json").read_text())
    return build_run_config({**report["config"], "deepspeed_config": None}, {})


@pytest.fixture(scope="module")
def context_run():
    from memascend.plan import model_dims

    cfg = _searched_config()
    return cfg, model_dims(cfg)


@pytest.mark.parametrize("cap", ["3g", "8g"])
def test_longest_seq_len_within_one_step_of_the_recorded_search(context_run, cap):
    """Each engine's planned longest length is at most one step from the longest the search trained
    (none: one step below 1K); where the search stopped at an OOM kill that bounds it from above,
    where it ran out of rows (e.g. 16K and 32K not run) only from below."""
    cfg, dims = context_run
    planned = longest_seq_len_under_cap(cfg, int(cap[:-1]) * GIB, 1, dims)
    steps = (None, *SEQ_LENS)
    checked = 0
    for engine in ("baseline", "memascend"):
        searched = _searched(engine, cap)
        assert searched, f"no recorded {engine} run under {cap}"
        fitted = [n for n in sorted(searched) if searched[n]]
        longest = fitted[-1] if fitted else None
        oom = any(not ok for ok in searched.values())
        got = planned[engine] and planned[engine].value
        lo, hi = steps.index(longest) - 1, steps.index(longest) + 1
        assert steps.index(got) >= lo, f"{engine} under {cap}: planned {got}, search trained {longest}"
        if oom:
            assert steps.index(got) <= hi, f"{engine} under {cap}: planned {got}, search OOM above {longest}"
        checked += 1
    assert checked == 2


def test_stock_under_8_gib_is_planned_within_one_step_of_its_oom(context_run):
    """Stock's glibc heap at long sequences (its free chunks, STOCK_HEAP_BYTES_PER_LAYER_TOKEN_SQ) is
    planned: at 8K within 5 % of the peak of the run that fit there at the cap's edge (8.05 GiB,
    ``runs/earlier-8g/``), and the longest planned length under 8 GiB is the search's 4K or the 8K it
    was OOM-killed at (a run at the cap's edge goes either way)."""
    from memascend.plan import plan_run

    cfg, dims = context_run
    planned = longest_seq_len_under_cap(cfg, 8 * GIB, 1, dims)["baseline"]
    searched = _searched("baseline", "8g")
    assert searched[8192] is False and searched[4096] is True
    assert planned is not None and planned.value in (4096, 8192)
    measured = json.loads((CONTEXT / "earlier-8g" / "llama-0.1b-bf16-8192x1-baseline-8g.json").read_text())
    at_8k = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=8192))
    assert abs(plan_run(at_8k, 1, dims)["baseline"].peak_rss_bytes / measured["memory"]["peak_rss_bytes"] - 1) < 0.05


def test_stock_fits_no_length_under_3_gib_as_searched(context_run):
    cfg, dims = context_run
    assert _searched("baseline", "3g") == {1024: False}
    assert longest_seq_len_under_cap(cfg, 3 * GIB, 1, dims)["baseline"] is None


def test_largest_micro_batch_is_the_boundary(context_run):
    """The answer fits and one more sequence does not (planned), for both engines."""
    from memascend.plan import plan_run

    cfg, dims = context_run
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=2048))
    cap = 8 * GIB
    found = largest_micro_batch_under_cap(cfg, cap, 1, dims)
    for engine, fit in found.items():
        assert fit is not None and fit.value >= 1
        for mb, fits in ((fit.value, True), (fit.value + 1, False)):
            sized = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch=mb))
            peak = plan_run(sized, 1, dims)[engine].peak_rss_bytes
            assert (peak <= cap) is fits, (engine, mb, peak)
    assert found["memascend"].value > found["baseline"].value


def test_lengths_stop_at_the_models_positions(context_run):
    cfg, dims = context_run
    short = dataclasses.replace(dims, max_positions=4096)
    assert longest_seq_len_under_cap(cfg, 64 * GIB, 1, short)["memascend"].value == 4096


def test_plan_cli_prints_the_longest_seq_len_and_micro_batch():
    from memascend.cli.main import cli

    args = ["plan", "--from-scratch", "llama-tiny", "--micro-batch", "1", "--activation-checkpointing",
            "--loss-chunk-tokens", "256", "--cap-gib", "4"]
    text = CliRunner().invoke(cli, args, terminal_width=200)
    assert text.exit_code == 0, text.output
    lines = [ln for ln in text.output.splitlines() if ln.startswith(("longest --seq-len", "largest --micro-batch"))]
    assert len(lines) == 2 and "(1024-8192 tokens, micro-batch 1)" in lines[0], lines
    doc = json.loads(CliRunner().invoke(cli, [*args, "--json"]).output)
    assert doc["longest_seq_len_under_cap"]["memascend"] == 8192
    assert doc["largest_micro_batch_under_cap"]["cap_bytes"] == 4 * GIB
    assert doc["largest_micro_batch_under_cap"]["memascend"] >= doc["largest_micro_batch_under_cap"]["baseline"]
