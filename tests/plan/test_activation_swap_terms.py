"""The activation swap's plan terms (memascend/plan/activation_swap_terms.py): the per-tensor list adds
up to activation_parts' per-layer term, small saved tensors are those under the swapper's min_bytes,
the cache packs blocks into regions, the DRAM allowance raises the plan by what it keeps, and the plan
of full fine-tunes with the swap is within 10 % of their measured peaks."""

from __future__ import annotations

import pytest

from memascend.config import build_run_config
from memascend.plan import plan_run
from memascend.plan.activation_swap_terms import (
    cache_regions_bytes,
    layer_saved_tensor_bytes,
    small_saved_bytes,
)
from memascend.plan.shapes import activation_parts, model_dims

MIB = 1 << 20
LORA = {"lora": {"rank": 16, "target_modules": ["all-linear"]}}


def test_the_tensor_list_adds_up_to_the_activation_term():
    for overrides in ({}, {"model": {"from_scratch": "gpt-neox-0.1b"}}, {"model": {"from_scratch": "phi-0.1b"}}):
        dims = model_dims(build_run_config({}, overrides))
        for e in (2, 4):
            act = activation_parts(dims, 2, 256, e, False)
            h = dims.hidden_size
            final_norm = 512 * ((2 * e * h + 2 * e) if dims.layer_norm else (2 * e * h + 4 * h))
            dropout = 512 * e * h if dims.hidden_dropout > 0 else 0
            per_layer = sum(layer_saved_tensor_bytes(dims, e, 256, False)) * 512
            assert dims.num_layers * per_layer + final_norm + dropout == act.saved, overrides


def test_small_saved_tensors_are_those_under_min_bytes():
    dims = model_dims(build_run_config({}, LORA))
    # SmolLM2 at 4 x 256 tokens, bf16: per layer the key and value projections (384 KiB each), the
    # log-sum-exp (36 KiB) and 7 adapters' rank-16 outputs (32 KiB each)
    assert small_saved_bytes(dims, 4, 256, 2, False, MIB, lora_rank=16) == 30 * (2 * 384 + 36 + 7 * 32) * 1024
    assert small_saved_bytes(dims, 4, 256, 2, False, MIB) == 30 * (2 * 384 + 36) * 1024
    assert small_saved_bytes(dims, 4, 256, 2, False, 1) == 0


def test_the_cache_packs_blocks_into_regions():
    region = 64 * MIB
    assert cache_regions_bytes([]) == 0
    assert cache_regions_bytes([200 * MIB]) == 200 * MIB  # a block of a region or more: its own size
    assert cache_regions_bytes([48 * MIB] * 3, region) == 4 * region  # one each, plus one
    # the 16 MiB left beside each 48 MiB block takes the small ones first
    assert cache_regions_bytes([48 * MIB] * 3 + [4 * MIB] * 12, region) == 4 * region
    assert cache_regions_bytes([48 * MIB] * 3 + [4 * MIB] * 13, region) == 5 * region


def test_the_dram_allowance_raises_the_plan_by_what_it_keeps():
    cfg = build_run_config({}, {**LORA, "train": {"loss_chunk_tokens": 256}})

    def plan(section):
        return plan_run(cfg, memascend_settings={"enable_activation_swap": True, **section})["memascend"]

    none, some = plan({}), plan({"activation_dram_bytes": 256 * MIB})
    everything = plan({"activation_dram_bytes": 64 << 30})
    assert 256 * MIB <= some.peak_rss_bytes - none.peak_rss_bytes <= 256 * MIB + 2 * 64 * MIB
    assert some.peak_rss_bytes < everything.peak_rss_bytes
    # keeping every eligible tensor plans at least what the run without the swap keeps in the cache
    off = plan_run(cfg)["memascend"]
    assert everything.peak_rss_bytes >= off.peak_rss_bytes * 0.9


def test_the_region_size_is_the_caches():
    from memascend.memory.host_cache import DEFAULT_REGION_BYTES
    from memascend.plan.calibration import HOST_BLOCK_CACHE_REGION_BYTES

    assert HOST_BLOCK_CACHE_REGION_BYTES == DEFAULT_REGION_BYTES


@pytest.mark.parametrize(("flags", "measured_bytes"), [
    # the small saved tensors (the key and value projections, the log-sum-exp: 18.8 MiB) and their heap
    # term (89.5 MiB) on a second family and length: 1.339 GiB planned
    ({"data": {"seq_len": 1024}, "train": {"micro_batch": 1, "loss_chunk_tokens": 256}}, 1_378_062_336),
    # activation checkpointing: every saved tensor is a layer input of at least 1 MiB, the fp32 logits
    # dominate; 3.371 GiB planned
    ({"data": {"seq_len": 1024}, "train": {"activation_checkpointing": True}}, 3_486_564_352),
])
def test_full_fine_tunes_with_the_swap_plan_within_10_percent(flags, measured_bytes):
    # measured: ``memascend finetune --from-scratch llama-0.1b --seq-len 1024 --swap-activations --steps 3
    # --eval-blocks 0 --no-save-model`` with --micro-batch 1 --loss-chunk-tokens 256, or with
    # --activation-checkpointing (micro-batch 4), under a 5 GiB cgroup: report.json's peak RSS
    cfg = build_run_config({}, {"model": {"from_scratch": "llama-0.1b"}, **flags})
    plan = plan_run(cfg, memascend_settings={"enable_activation_swap": True})["memascend"]
    assert abs(plan.peak_rss_bytes / measured_bytes - 1) < 0.10
