"""Fused has_overflow/_has_inf_or_nan against stock stage 3 on the same inputs."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("deepspeed")

from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3  # noqa: E402

from memascend.integrations.deepspeed.overflow import (  # noqa: E402
    load_checker,
    make_has_inf_or_nan,
    make_has_overflow,
)

BAD = [None, float("inf"), float("-inf"), float("nan")]


@pytest.fixture(scope="module")
def checker():
    return load_checker()  # the real memascend.ops.overflow_check op


@pytest.fixture(autouse=True)
def _single_rank_collectives(monkeypatch):
    from deepspeed import comm

    monkeypatch.setattr(comm, "all_reduce", lambda tensor, op=None, group=None, async_op=False: None)


def fake_optimizer(flat, tracker_value=False):
    obj = types.SimpleNamespace(
        grad_partitions_flat_buffer=flat,
        inf_or_nan_tracker=torch.tensor([tracker_value]),
        reduce_and_partition_stream=None,
        dp_process_group=None,
    )
    obj._model_parallel_all_reduce = lambda tensor, op: None
    return obj


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       numel=st.integers(1, 5000), pos=st.integers(0, 10**6), bad=st.sampled_from(BAD),
       preset=st.booleans())
def test_has_overflow_matches_stock(checker, dtype, numel, pos, bad, preset):
    flat = torch.randn(numel).to(dtype)
    if bad is not None:
        flat[pos % numel] = bad
    ours_fn = make_has_overflow(Stage3.has_overflow, checker)
    stock_obj, ours_obj = fake_optimizer(flat.clone(), preset), fake_optimizer(flat.clone(), preset)
    expected = Stage3.has_overflow(stock_obj, True)
    got = ours_fn(ours_obj, True)
    assert type(got) is bool and got == expected == (bad is not None or preset)
    assert not ours_obj.inf_or_nan_tracker.any() and not stock_obj.inf_or_nan_tracker.any()
    # The gradients themselves are untouched.
    assert torch.allclose(ours_obj.grad_partitions_flat_buffer.float(), flat.float(), rtol=0, atol=0, equal_nan=True)


def test_serial_path_is_the_stock_one(checker):
    calls = []

    def original(self, partition_gradients=True):
        calls.append(partition_gradients)
        return True

    assert make_has_overflow(original, checker)(object(), False) is True and calls == [False]


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       shape=st.sampled_from([(0,), (7,), (33, 5), (4, 4, 9)]), pos=st.integers(0, 10**6),
       bad=st.sampled_from(BAD), transpose=st.booleans())
def test_has_inf_or_nan_matches_stock(checker, dtype, shape, pos, bad, transpose):
    x = torch.randn(shape).to(dtype)
    if bad is not None and x.numel():
        x.view(-1)[pos % x.numel()] = bad
    if transpose and x.dim() >= 2:
        x = x.transpose(0, 1)
    ours = make_has_inf_or_nan(checker).__func__
    expected = Stage3._has_inf_or_nan(x)
    got = ours(x)
    assert isinstance(got, torch.Tensor) and got.dim() == 0 and bool(got) == bool(expected)


def test_has_inf_or_nan_sparse(checker):
    ours = make_has_inf_or_nan(checker).__func__
    i = torch.tensor([[0, 3], [1, 2]])
    for v, want in ((torch.tensor([1.0, 2.0]), False), (torch.tensor([1.0, float("nan")]), True)):
        sp = torch.sparse_coo_tensor(i, v, (5, 5))
        assert bool(ours(sp)) == bool(Stage3._has_inf_or_nan(sp)) == want
