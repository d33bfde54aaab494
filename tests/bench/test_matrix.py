"""Matrix definitions: thresholds from the issue texts, identical runs except the engine."""

from __future__ import annotations

import pytest

from memascend.bench.matrix import MATRICES, BenchConfig, get_matrix
from memascend.errors import UserError


def test_named_matrices_exist_and_smoke_is_smollm2_one_and_two_ranks():
    assert set(MATRICES) == {"smoke", "cpu-full", "gpu"}
    smoke = get_matrix("smoke")
    assert {c.data for c in smoke.configs} == {"shakespeare", "chitchat"}
    assert {c.nproc for c in smoke.configs} == {1, 2}
    assert all(c.model == "smollm2-135m" and c.from_scratch is None for c in smoke.configs)


def test_issue3_thresholds_are_data():
    issue3 = get_matrix("cpu-full").select("smollm2-shakespeare-*-256x4")
    assert len(issue3) == 2
    for c in issue3:
        assert (c.thresholds.max_peak_rss_ratio, c.thresholds.max_peak_locked_ratio,
                c.thresholds.max_step_time_ratio, c.thresholds.bitwise_losses) == (0.40, 0.25, 1.05, True)
    # The smoke gate: bitwise losses and the locked bound stay; RSS and time are looser (see SMOKE_THRESHOLDS).
    for c in get_matrix("smoke").configs:
        assert c.thresholds.bitwise_losses and c.thresholds.max_peak_locked_ratio == 0.25
        assert c.thresholds.max_peak_rss_ratio <= 0.50 and c.thresholds.max_step_time_ratio <= 1.30
    one_b = next(c for c in get_matrix("cpu-full").configs if c.from_scratch == "llama-1b")
    assert one_b.thresholds.max_peak_rss_ratio == 0.45


def test_cpu_full_spans_models_and_sequence_lengths():
    full = get_matrix("cpu-full")
    assert {"llama-0.1b", "llama-1b", "llama-3b"} <= {c.from_scratch for c in full.configs}
    assert min(c.seq_len for c in full.configs) == 256 and max(c.seq_len for c in full.configs) == 4096
    assert {c.dtype for c in get_matrix("gpu").configs} == {"bf16", "fp16"}


def test_engines_get_identical_arguments_except_engine_and_output():
    cfg = get_matrix("smoke").configs[2]
    a = cfg.finetune_args(engine="baseline", output_dir="o/b", nvme_path="swap")
    b = cfg.finetune_args(engine="memascend", output_dir="o/m", nvme_path="swap")
    diff = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    assert diff == [("baseline", "memascend"), ("o/b", "o/m")]
    assert a[a.index("--nproc") + 1] == "2" and "--no-save-model" in a


def test_select_and_errors():
    smoke = get_matrix("smoke")
    assert [c.name for c in smoke.select("*-r2")] == ["smollm2-shakespeare-r2", "smollm2-chitchat-r2"]
    # several comma-separated patterns; the matrix's order is kept
    assert [c.name for c in smoke.select("*shakespeare-r2, smollm2-chitchat-r1")] == [
        "smollm2-chitchat-r1", "smollm2-shakespeare-r2"]
    with pytest.raises(UserError):
        smoke.select("nothing*")
    with pytest.raises(UserError):
        get_matrix("huge")
    with pytest.raises(ValueError):
        BenchConfig(name="x", steps=2)
