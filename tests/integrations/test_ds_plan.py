"""``auto_sub_group_numel``: the smallest sub-group size under which no sub-group stays in DRAM."""

from hypothesis import given, settings
from hypothesis import strategies as st

from memascend.integrations.deepspeed.grad_norm import stock_sub_groups
from memascend.integrations.deepspeed.plan import MIN_SWAPPABLE_BYTES, auto_sub_group_numel

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
