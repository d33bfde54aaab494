"""The planner on every model family: recorded memascend runs of GPT-NeoX, Mistral, Phi, Qwen2,
SmolLM2 (bf16 and fp32) and llama-0.1b within 10 % of their measured peak RSS and locked memory, and
the activation terms of each family's block against the tensors autograd keeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memascend.plan import activation_parts, plan_for_report

REPO = Path(__file__).resolve().parents[2]
FAMILY_REPORTS = sorted((REPO / "baselines" / "cpu-2c-24g" / "planner" / "reports").glob("*-memascend.json"))
"""memascend runs of cpu-full's rows at one commit (baselines/cpu-2c-24g/planner/README.md)."""
TOLERANCE = 0.10


def _family(report: dict) -> str:
    fs = report["config"]["model"]["from_scratch"]
    return (fs or {}).get("arch", "llama") if fs else "smollm2"


def test_family_reports_cover_every_family_and_fp32():
    reports = [json.loads(p.read_text()) for p in FAMILY_REPORTS]
    assert {_family(r) for r in reports} >= {"gpt_neox", "mistral", "phi", "qwen2", "smollm2", "llama"}
    assert any(r["config"]["train"]["dtype"] == "fp32" for r in reports)
    untied = [r for r in reports if r["config"]["model"]["from_scratch"]
              and not r["config"]["model"]["from_scratch"]["tie_word_embeddings"]]
    assert len(untied) >= 3


@pytest.mark.parametrize("path", FAMILY_REPORTS, ids=[p.stem for p in FAMILY_REPORTS])
def test_plan_within_10_percent_on_every_family(path):
    report = json.loads(path.read_text())
    plan = plan_for_report(report)
    rss = report["memory"]["sum_rank_peak_rss_bytes"]
    locked = report["memory"]["sum_rank_peak_locked_bytes"]
    assert abs(plan.peak_rss_bytes - rss) <= TOLERANCE * rss, (
        f"{path.stem}: planned RSS {plan.peak_rss_bytes / 2**30:.3f} GiB vs measured {rss / 2**30:.3f} GiB")
    assert abs(plan.peak_locked_bytes - locked) <= TOLERANCE * locked, (
        f"{path.stem}: planned locked {plan.peak_locked_bytes / 2**30:.3f} GiB vs measured {locked / 2**30:.3f} GiB")


@pytest.mark.parametrize("path", [p for p in FAMILY_REPORTS if "256x2" in p.name],
                         ids=lambda p: p.stem)
def test_planned_param_pool_is_the_measured_one(path):
    """The pool's slots (locked from the build on): an untied output projection shares the input
    embedding's slot, so the pool is no larger than measured by a vocabulary-sized partition."""
    report = json.loads(path.read_text())
    measured = report["memory_breakdown"]["locked"]["param_swap_buffers_bytes"]
    pool = [c for c in plan_for_report(report).components if c.name.startswith("param pool")]
    assert len(pool) == 1 and abs(pool[0].bytes - measured) <= 0.10 * measured, (pool, measured)


def _saved_bytes(spec: str, dtype, micro_batch: int, seq_len: int) -> tuple[int, object]:
    """Bytes of the tensors autograd keeps for backward (saved-tensor hooks, each storage once,
    parameters, the token ids and the loss's fp32 log-softmax left out) and the HF config."""
    import torch
    from transformers import AutoModelForCausalLM

    from memascend.config.presets import parse_from_scratch
    from memascend.models.loading import from_scratch_config

    hf_cfg = from_scratch_config(parse_from_scratch(spec))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa").to(dtype).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.dtype != torch.int64:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, hf_cfg.vocab_size, (micro_batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    return sum(seen.values()) - micro_batch * seq_len * hf_cfg.vocab_size * 4, hf_cfg


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gpt_neox", "phi", "gpt2"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_terms_match_autograds_saved_tensors(arch, dropout):
    import torch

    from memascend.config import build_run_config
    from memascend.plan import model_dims

    kv = ",kv_heads=2" if arch in ("mistral", "qwen2", "llama") else ""
    spec = f"arch={arch},hidden=128,layers=2,heads=4,vocab=1024,dropout={dropout}{kv}"
    dims = model_dims(build_run_config({"model": {"from_scratch": spec}}, {}))
    for dtype, elem_bytes in ((torch.bfloat16, 2), (torch.float32, 4)):
        measured, _ = _saved_bytes(spec, dtype, 2, 64)
        planned = activation_parts(dims, 2, 64, elem_bytes, checkpointing=False).saved
        assert abs(planned - measured) <= 0.01 * measured, (spec, dtype, planned, measured)
