"""exact_norm: stage 3's per-parameter fp64 gradient norm from bounded pieces, bit-identical to
``x.to(torch.float64).norm(2)`` (and so to DeepSpeed 0.19.8's ``_constant_buffered_norm2``)."""

from __future__ import annotations

import math
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memascend.integrations.deepspeed import exact_norm
from memascend.integrations.deepspeed.exact_norm import (
    exact_norm2,
    make_constant_buffered_norm2,
    self_check,
    transient_bytes,
)

pytest.importorskip("deepspeed")


def _bits(t: torch.Tensor) -> int:
    assert t.dtype == torch.float64 and t.dim() == 0 and t.device.type == "cpu"
    return t.view(torch.int64).item()


def _assert_same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    if math.isnan(ref.item()):
        assert math.isnan(ours.item())
    else:
        assert _bits(ours) == _bits(ref), (ours.item().hex(), ref.item().hex())


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fresh_check():
    exact_norm._reset_self_check()
    yield
    exact_norm._reset_self_check()


def _wide(n: int, seed: int, spread: float = 8.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * spread)).float()


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 20_000), seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([0.0, 1.0, 8.0, 20.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       chunk=st.sampled_from([exact_norm.EXACT_NORM_CHUNK_NUMEL, 4, 8, 12, 4096]))
def test_bit_identical_to_torch_on_random_vectors(n, seed, spread, dtype, chunk):
    x = _wide(n, seed, spread)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    x = x.to(dtype)
    _assert_same(exact_norm2(x, chunk), x.to(torch.float64).norm(2))


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("base", [0, 4, 16_384, 16_384 * 3 + 8, 1_000_000])
@pytest.mark.parametrize("tail", [0, 1, 2, 3])
def test_every_tail_across_pieces(threads, num_threads, base, tail):
    torch.set_num_threads(num_threads)
    n = base + tail
    if n == 0:
        pytest.skip("empty")
    for seed in range(3):
        x = _wide(n, seed * 7 + n)
        _assert_same(exact_norm2(x), x.to(torch.float64).norm(2))
        b = x.to(torch.bfloat16)
        _assert_same(exact_norm2(b), b.to(torch.float64).norm(2))


def test_large_vectors_and_two_dim(threads):
    torch.set_num_threads(2)
    for n in (10_000_001, 40_000_003):
        x = _wide(n, n)
        _assert_same(exact_norm2(x), x.to(torch.float64).norm(2))
    m = _wide(4097 * 3, 5).view(4097, 3)
    _assert_same(exact_norm2(m), m.to(torch.float64).norm(2))


@pytest.mark.parametrize("values", [
    [0.0] * 9, [-0.0] * 5, [0.0, -0.0, 0.0], [1e-45] * 7, [1e-40, -3e-39, 2e-44, 5.0],
    [float("inf")] * 5, [float("-inf"), 1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 2.0, float("nan"), 4.0],
    [float("nan")], [float("inf"), float("nan")], [3.0e38] * 8, [1.0] * 4 + [float("-inf")],
])
def test_special_values(values):
    x = torch.tensor(values, dtype=torch.float32)
    for chunk in (4, exact_norm.EXACT_NORM_CHUNK_NUMEL):
        _assert_same(exact_norm2(x, chunk), x.to(torch.float64).norm(2))


def test_rejects_what_it_cannot_compute():
    with pytest.raises(ValueError, match="contiguous"):
        exact_norm2(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="floating"):
        exact_norm2(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 4"):
        exact_norm2(torch.ones(8), chunk_numel=6)


def test_transient_bytes_is_the_piece_buffer():
    chunk = exact_norm.EXACT_NORM_CHUNK_NUMEL
    assert transient_bytes(3) == 0
    assert transient_bytes(8) == 8 * 4 * 3
    assert transient_bytes(250_000_000) == transient_bytes(chunk + 3) == 8 * (chunk + 4)


def _stock():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    return getattr(stage3._constant_buffered_norm2, "__wrapped__", stage3._constant_buffered_norm2)


def test_patched_method_is_bit_identical_to_deepspeed(fresh_check):
    stock = _stock()
    patched = make_constant_buffered_norm2(stock)
    for n, buffer_size in ((100_003, 250_000_000), (100_003, 30_001), (9, 4), (40_000_002, 250_000_000)):
        for dtype in (torch.float32, torch.bfloat16):
            g = _wide(n, n + buffer_size).to(dtype)
            _assert_same(patched(None, g, buffer_size), stock(None, g, buffer_size))
    assert exact_norm.norm_path() == "exact_chunked"


def test_self_check_fallback_uses_stock(monkeypatch, fresh_check):
    calls = []
    stock = _stock()

    def spy(self, input, buffer_size=250000000):
        calls.append(input.numel())
        return stock(self, input, buffer_size)

    patched = make_constant_buffered_norm2(spy)
    good = exact_norm2
    # one vector of the check off by one ulp: the whole run falls back to stock's copy
    monkeypatch.setattr(exact_norm, "exact_norm2",
                        lambda t, chunk=exact_norm.EXACT_NORM_CHUNK_NUMEL: torch.nextafter(
                            good(t, chunk), torch.tensor(math.inf, dtype=torch.float64))
                        if t.numel() == 4097 else good(t, chunk))
    assert self_check() is False and exact_norm.norm_path() == "stock_copy"
    g = _wide(1000, 1)
    _assert_same(patched(None, g), stock(None, g))
    assert calls == [1000]


def test_passes_through_non_cpu_non_fp64_and_integers(monkeypatch, fresh_check):
    import deepspeed.runtime.zero.utils as zero_utils

    calls = []

    def original(self, input, buffer_size=250000000):
        calls.append((input.device.type, input.dtype))
        return torch.tensor(1.0)

    patched = make_constant_buffered_norm2(original)
    meta = torch.empty(16, device="meta")
    patched(None, meta)
    patched(None, torch.ones(4, dtype=torch.int64))
    monkeypatch.setattr(zero_utils, "get_norm_dtype", lambda: torch.float32)
    patched(None, torch.ones(8))
    assert calls == [("meta", torch.float32), ("cpu", torch.int64), ("cpu", torch.float32)]
    assert exact_norm.norm_path() is None  # no CPU fp64 norm asked for: never checked


def test_apply_patches_and_revert_restores(monkeypatch):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3

    from memascend.integrations import deepspeed as seam

    original = stage3._constant_buffered_norm2
    assert getattr(original, "__wrapped__", None) is None
    seam.apply()
    try:
        patched = stage3._constant_buffered_norm2
        assert patched is not original and patched.__wrapped__ is original
        g = _wide(5003, 2).to(torch.bfloat16)
        opt = types.SimpleNamespace()
        _assert_same(patched(opt, g), original(opt, g))
    finally:
        seam.revert()
    assert stage3._constant_buffered_norm2 is original
