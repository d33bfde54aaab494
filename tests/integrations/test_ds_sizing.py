"""``auto_sub_group_numel``: the smallest sub-group size under which no sub-group stays in DRAM;
``auto_param_dram_numel``: no DRAM copy of a large model's parameters; ``auto_param_pool_bytes``: the
parameter pool bounded by the largest layer."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memascend.config.ds_defaults import MIN_SWAPPABLE_BYTES
from memascend.config.settings import MemAscendSettings
from memascend.config.sizing import (
    BUCKETLESS_MIN_REDUCE_BUCKET_NUMEL,
    auto_chunked_sub_group_numel,
    auto_param_dram_numel,
    auto_param_pool_bytes,
    auto_reduce_bucket_numel,
    auto_sub_group_numel,
    bucketless_reduce_applies,
    largest_layer_numel,
    largest_layer_param_numel,
    layer_param_count,
    prepare_ds_config,
    stock_sub_groups,
)

_MIN_NUMEL = MIN_SWAPPABLE_BYTES // 4


def test_llama_tiny_remainder_is_merged_instead_of_left_in_dram():
    # llama-tiny (3,277,120 parameters): a 3.1 M embedding, then 131,392 elements (513 KiB of fp32).
    numels = [3_145_728] + [4096, 4096, 4096, 4096, 16384, 16384, 16384, 64, 64] * 2 + [64]
    assert sum(numels) == 3_277_120
    size = auto_sub_group_numel(numels)
    groups = stock_sub_groups(numels, size, int)
    assert len(groups) == 1 and size == sum(numels)
    # SmolLM2-like: the remainder is large enough, the size stays the largest parameter.
    big = [28_311_552] + [331_776, 110_592, 884_736] * 30
    assert auto_sub_group_numel(big) == 28_311_552


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=3_000_000), min_size=1, max_size=40),
       st.integers(min_value=1, max_value=4))
def test_every_sub_group_is_swappable_or_there_is_one(numels, world_size):
    parts = [-(-n // world_size) for n in numels]
    size = auto_sub_group_numel(numels, world_size)
    assert size >= max(parts)  # never splits a parameter
    groups = stock_sub_groups(parts, size, int)
    assert len(groups) == 1 or all(sum(g) >= _MIN_NUMEL for g in groups)
    assert size <= max(sum(parts), max(parts))  # grows no further than one sub-group
    if size > max(parts):  # it grew only because the largest-partition size left a small sub-group
        at_largest = stock_sub_groups(parts, max(parts), int)
        assert min(sum(g) for g in at_largest) < _MIN_NUMEL


def _nvme_config(dtype: str = "bf16", **offload_param) -> dict:
    return {dtype: {"enabled": True} if dtype != "fp32" else {"enabled": False},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/swap", **offload_param},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": "/swap"}}}


@pytest.mark.parametrize(("dtype", "param_numel", "world_size", "expected"), [
    ("bf16", 1_004_000_000, 1, 0),       # llama-1b: 1.87 GiB of bf16 partitions
    ("bf16", 452_000_000, 1, 0),         # llama-0.5b: 862 MiB of bf16 partitions
    ("bf16", 268_000_000, 1, None),      # 511 MiB, the copy is kept
    ("bf16", 135_000_000, 1, None),      # SmolLM2-135M: 257 MiB
    ("bf16", 113_000_000, 1, None),      # llama-0.1b: 216 MiB
    ("fp32", 300_000_000, 1, 0),         # 1.12 GiB of fp32
    ("fp32", 130_000_000, 1, None),      # 496 MiB of fp32
    ("bf16", 520_000_000, 2, None),      # 496 MiB per rank
    ("bf16", 1_004_000_000, 2, 0),       # 957 MiB per rank
])
def test_auto_param_dram_drops_the_copy_of_a_large_model_only(dtype, param_numel, world_size, expected):
    numels = [param_numel // 4] * 4
    assert auto_param_dram_numel(_nvme_config(dtype), numels, world_size) == expected
    ds, resolved = prepare_ds_config(_nvme_config(dtype), MemAscendSettings(), param_numels=numels,
                                     world_size=world_size)
    assert resolved.param_dram_numel == expected
    written = ds["zero_optimization"]["offload_param"].get("max_in_cpu")
    assert written == expected  # None: DeepSpeed's default (the whole model) stays


def test_auto_param_dram_keeps_an_explicit_max_in_cpu_and_other_devices():
    numels = [500_000_000, 504_000_000]
    assert auto_param_dram_numel(_nvme_config(max_in_cpu=2_000_000_000), numels) is None
    ds, _ = prepare_ds_config(_nvme_config(max_in_cpu=2_000_000_000), MemAscendSettings(), param_numels=numels)
    assert ds["zero_optimization"]["offload_param"]["max_in_cpu"] == 2_000_000_000
    cpu = _nvme_config()
    cpu["zero_optimization"]["offload_param"] = {"device": "cpu"}
    assert auto_param_dram_numel(cpu, numels) is None
    assert auto_param_dram_numel(_nvme_config(), None) is None
    # The baseline never drops stock's copy.
    assert MemAscendSettings.baseline().param_dram_numel is None


def _llama_numels(vocab=49152, hidden=2048, layers=20, inter=5632, kv=512):
    layer = [hidden * hidden, hidden * kv, hidden * kv, hidden * hidden, inter * hidden, inter * hidden,
             hidden * inter, hidden, hidden]
    return [vocab * hidden] + layer * layers + [hidden]


def test_largest_layer_is_one_repeated_block_without_the_embedding():
    numels = _llama_numels()
    assert layer_param_count(numels) == 9
    assert largest_layer_numel(numels) == sum(numels[1:10])
    assert largest_layer_numel(numels, world_size=2) == sum(-(-n // 2) for n in numels[1:10])
    # Untied: lm_head after the final norm is not a layer either.
    assert largest_layer_numel(numels + [49152 * 2048]) == sum(numels[1:10])
    assert auto_param_pool_bytes(numels, 2) == (numels[0] + 2 * sum(numels[1:10])) * 2


def test_auto_param_pool_bounds_the_reuse_window_only_without_a_dram_copy():
    numels = _llama_numels()  # ~1.0 B parameters: 1.87 GiB in bf16, the copy is dropped
    ds, resolved = prepare_ds_config(_nvme_config("bf16"), MemAscendSettings(), param_numels=numels)
    assert resolved.param_dram_numel == 0
    assert resolved.param_pool_bytes == auto_param_pool_bytes(numels, 2)
    assert ds["zero_optimization"]["stage3_max_reuse_distance"] == resolved.param_pool_bytes // 2
    # A small model keeps its DRAM copy: the pool is not used, the config is left as it was.
    small = _llama_numels(layers=2)
    ds, resolved = prepare_ds_config(_nvme_config("bf16"), MemAscendSettings(), param_numels=small)
    assert resolved.param_pool_bytes is None
    assert "stage3_max_reuse_distance" not in ds["zero_optimization"]
    # A count of partitions (None) keeps today's reuse distance; the baseline never sets one.
    ds, _ = prepare_ds_config(_nvme_config("bf16"), MemAscendSettings(param_pool_bytes=None), param_numels=numels)
    assert "stage3_max_reuse_distance" not in ds["zero_optimization"]
    assert MemAscendSettings.baseline().param_pool_bytes is None
    # An explicit smaller reuse distance wins.
    cfg = _nvme_config("bf16")
    cfg["zero_optimization"]["stage3_max_reuse_distance"] = 1000
    ds, _ = prepare_ds_config(cfg, MemAscendSettings(param_pool_bytes=1 << 30), param_numels=numels)
    assert ds["zero_optimization"]["stage3_max_reuse_distance"] == 1000


def test_chunked_sub_groups_do_not_balloon_behind_an_untied_lm_head():
    from memascend.config.sizing import auto_chunked_sub_group_numel

    # embedding, 8 layers of 2.1 M, final norm, untied lm_head (the mistral-0.07b shape).
    embed, layer = 49152 * 512, 2_100_000
    numels = [embed] + [layer] * 8 + [512, embed]
    old = auto_sub_group_numel(numels)
    new = auto_chunked_sub_group_numel(numels, 8 << 20)
    largest = {size: max(sum(g) for g in stock_sub_groups(numels, size, int)) for size in (old, new)}
    assert largest[old] > 1.6 * embed  # the layers before lm_head join it
    assert largest[new] == embed + 512  # only the final norm does
    groups = stock_sub_groups(numels, new, int)
    assert min(sum(g) for g in groups) * 4 >= MIN_SWAPPABLE_BYTES  # every sub-group swapped
    # Nothing to gain: the unchunked size is kept (a tiny model, one sub-group).
    assert auto_chunked_sub_group_numel([64_000, 4096], 8 << 20, 2) == auto_sub_group_numel([64_000, 4096], 2)


def test_auto_chunk_scales_with_the_rank_partition():
    """The chunked step's chunk is a power of two of at most a sixteenth of the rank's partitions,
    between 1 Mi and 8 Mi elements: a 16 M model steps in 1 Mi chunks (36 MiB of chunk buffers, not
    the 8 Mi chunk's 288 MiB), SmolLM2-135M keeps 8 Mi on one rank and halves to 4 Mi on two."""
    from memascend.config.sizing import AUTO_CHUNK_MIN_NUMEL, AUTO_CHUNK_NUMEL, auto_chunk_numel

    mi = 1 << 20
    assert auto_chunk_numel([16_004_608]) == mi == AUTO_CHUNK_MIN_NUMEL
    assert auto_chunk_numel([134_515_008]) == 8 * mi == AUTO_CHUNK_NUMEL
    assert auto_chunk_numel([134_515_008], world_size=2) == 4 * mi
    assert auto_chunk_numel([10**10]) == AUTO_CHUNK_NUMEL
    assert auto_chunk_numel([1000]) == AUTO_CHUNK_MIN_NUMEL
    assert auto_chunk_numel([16 * 3 * mi]) == 2 * mi  # 3 Mi: the power of two below
    numels = [16_004_608 - 12_582_912, 12_582_912]
    _, resolved = prepare_ds_config(_nvme_config(), MemAscendSettings(), param_numels=numels)
    assert resolved.optimizer_chunk_numel == mi
    _, unknown = prepare_ds_config(_nvme_config(), MemAscendSettings())
    assert unknown.optimizer_chunk_numel == "auto"  # the model unknown: the 8 Mi chunk where it is used
    cpu = {**_nvme_config(), "zero_optimization": {**_nvme_config()["zero_optimization"],
                                                   "offload_optimizer": {"device": "cpu"}}}
    assert prepare_ds_config(cpu, MemAscendSettings(), param_numels=numels)[1].optimizer_chunk_numel == "auto"
    given = MemAscendSettings(optimizer_chunk_numel=4 * mi)
    assert prepare_ds_config(_nvme_config(), given, param_numels=numels)[1].optimizer_chunk_numel == 4 * mi


def test_the_optimizer_sizes_come_from_the_trainable_parameters_only():
    """With a frozen base (LoRA) the optimizer holds the adapters: its chunk and sub-groups are sized
    from them, the reduce bucket and the parameter pool from every parameter."""
    mi = 1 << 20
    base = [49_152 * 576] + [576 * 576, 576 * 1536] * 30  # SmolLM2-shaped base weights
    adapters = [16 * 576, 576 * 16, 16 * 1536, 1536 * 16] * 30
    numels = base + adapters
    full_ds, full = prepare_ds_config(_nvme_config("bf16"), MemAscendSettings(), param_numels=numels)
    lora_ds, lora = prepare_ds_config(_nvme_config("bf16"), MemAscendSettings(), param_numels=numels,
                                      optimizer_numels=adapters)
    assert full.optimizer_chunk_numel == 2 * mi and lora.optimizer_chunk_numel == mi
    assert lora.optimizer_sub_group_numel == auto_chunked_sub_group_numel(adapters, mi)
    assert lora.optimizer_sub_group_numel < sum(adapters) < full.optimizer_sub_group_numel
    assert lora_ds["zero_optimization"]["reduce_bucket_size"] == full_ds["zero_optimization"]["reduce_bucket_size"]
    assert lora.param_pool_bytes == full.param_pool_bytes and lora.param_dram_numel == full.param_dram_numel
    same = prepare_ds_config(_nvme_config("bf16"), MemAscendSettings(), param_numels=numels, optimizer_numels=numels)
    assert same == (full_ds, full)


_LLAMA_1B = [49_152 * 2048] + ([2048 * 2048, 2048 * 512, 2048 * 512, 2048 * 2048, 2048 * 5632, 2048 * 5632,
                                5632 * 2048, 2048, 2048] * 20) + [2048]
"""llama-1b's parameters in registration order (tied embedding, 20 layers, final norm)."""


def test_bucketless_reduce_turns_contiguous_gradients_off_and_the_bucket_to_a_layer_parameter():
    """Default settings: no IPG bucket buffer (``contiguous_gradients`` false, reduce-scatter on) and
    the reduce bucket is the largest layer parameter (the MLP's 2048 x 5632) raised to the 16 Mi-element
    floor, not the embedding."""
    ds, resolved = prepare_ds_config(_nvme_config(), MemAscendSettings(), param_numels=_LLAMA_1B)
    zero = ds["zero_optimization"]
    assert zero["contiguous_gradients"] is False and resolved.enable_bucketless_reduce is True
    assert zero["reduce_bucket_size"] == resolved.reduce_bucket_numel == BUCKETLESS_MIN_REDUCE_BUCKET_NUMEL
    assert largest_layer_param_numel(_LLAMA_1B) == 2048 * 5632 < BUCKETLESS_MIN_REDUCE_BUCKET_NUMEL
    # a layer parameter over the floor is the bucket; the floor never passes the largest parameter
    wide = [49_152 * 4096] + [4096 * 14336, 4096 * 4096] * 2
    assert auto_reduce_bucket_numel(wide, 500_000_000, bucketless=True) == 4096 * 14336
    small = [1000] + [300, 200] * 2
    assert auto_reduce_bucket_numel(small, 500_000_000, bucketless=True) == 1000
    # without the buffer's copy nothing needs to hold the embedding's gradient whole
    assert auto_reduce_bucket_numel(_LLAMA_1B, 500_000_000, bucketless=False) == 49_152 * 2048
    assert auto_reduce_bucket_numel(_LLAMA_1B, 1_000_000, bucketless=True) == 1_000_000  # the config's is smaller
    assert largest_layer_param_numel([7, 3]) == 7 and largest_layer_param_numel([]) == 0  # nothing repeats


@pytest.mark.parametrize(("zero", "bucketless"), [
    ({"contiguous_gradients": True}, False),          # the user's own value stands
    ({"contiguous_gradients": False}, True),          # already off: no buffer either way
    ({"contiguous_gradients": "auto"}, True),
    ({"reduce_scatter": False}, False),               # stock reduces from the buffer: keep it
    ({"reduce_scatter": True}, True),
])
def test_a_contiguous_gradients_or_reduce_scatter_of_the_users_json_stands(zero, bucketless):
    config = _nvme_config()
    config["zero_optimization"].update(zero)
    ds, resolved = prepare_ds_config(config, MemAscendSettings(), param_numels=_LLAMA_1B)
    assert bucketless_reduce_applies(config) is bucketless
    assert resolved.enable_bucketless_reduce is bucketless
    expected = zero.get("contiguous_gradients", True) if not bucketless else False
    assert ds["zero_optimization"].get("contiguous_gradients", True) is expected
    assert ds["zero_optimization"]["reduce_bucket_size"] == (BUCKETLESS_MIN_REDUCE_BUCKET_NUMEL if bucketless
                                                             else 49_152 * 2048)
    assert prepare_ds_config(ds, resolved, param_numels=_LLAMA_1B) == (ds, resolved)  # idempotent


def test_bucketless_reduce_off_keeps_stocks_buffer_and_the_largest_parameter():
    ds, resolved = prepare_ds_config(_nvme_config(), MemAscendSettings(enable_bucketless_reduce=False),
                                     param_numels=_LLAMA_1B)
    assert "contiguous_gradients" not in ds["zero_optimization"] and resolved.enable_bucketless_reduce is False
    assert ds["zero_optimization"]["reduce_bucket_size"] == 49_152 * 2048
    assert MemAscendSettings.baseline().enable_bucketless_reduce is False
