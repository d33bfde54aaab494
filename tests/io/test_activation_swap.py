"""The activation swapper (memascend.io.activation_swap): saved tensors written to a store file in the
forward pass and read back in the backward pass give the same gradients bit for bit; what is not
eligible stays with autograd; extents are freed with the graph; a full store keeps tensors in memory."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from memascend.io.activation_swap import ActivationSwapper, covers_storage

MIB = 1 << 20


def _mlp(seed: int = 0) -> list[torch.nn.Linear]:
    torch.manual_seed(seed)
    return [torch.nn.Linear(256, 256) for _ in range(6)]


def _step(layers, x, swapper=None):
    """Forward (under the swapper's hooks when given) and backward; the loss and every gradient."""
    for layer in layers:
        layer.zero_grad()

    def forward():
        h = x
        for layer in layers:
            h = torch.nn.functional.gelu(layer(h))
        return torch.log_softmax(h, -1).sum()

    if swapper is None:
        loss = forward()
    else:
        with swapper.hooks():
            loss = forward()
    loss.backward()
    return loss.detach(), [p.grad.clone() for layer in layers for p in layer.parameters()]


@pytest.fixture()
def swapper(tmp_path):
    sw = ActivationSwapper(tmp_path / "act.store", 64 * MIB, min_bytes=64 << 10, write_behind_bytes=MIB,
                           read_ahead_bytes=MIB)
    yield sw
    sw.close()


def test_gradients_are_bit_identical_and_the_store_is_emptied(swapper, tmp_path):
    layers, x = _mlp(), torch.randn(512, 256)
    want_loss, want_grads = _step(layers, x)
    for _ in range(2):  # twice: the freed extents are reused
        loss, grads = _step(layers, x, swapper)
        assert torch.equal(loss, want_loss) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    gc.collect()
    stats = swapper.stats
    # per step: 6 linear inputs and 6 GELU inputs of 512 x 256 fp32 (512 KiB each) and the log-softmax output
    assert stats.swapped_tensors >= 12 and stats.written_bytes >= 12 * (512 << 10)
    assert stats.read_bytes > 0 and stats.kept_bytes == 0
    assert swapper.store.used_bytes == 0 and swapper._stored_bytes == 0
    assert stats.peak_stored_bytes <= stats.written_bytes // 2 + (512 << 10)  # per step, not accumulated
    path = swapper.path
    swapper.close()
    assert not path.exists()


def test_parameters_small_and_non_owning_tensors_are_left_to_autograd(swapper):
    weight = torch.nn.Parameter(torch.randn(512, 512))
    big = torch.randn(1024, 512, requires_grad=True)
    small = torch.randn(8, 8, requires_grad=True)
    with swapper.hooks():
        out = (big[:512] @ weight).sum() + (small * small).sum()  # big[:512] is a view of half its storage
    assert swapper.stats.swapped_tensors == 0
    out.backward()
    want = torch.autograd.grad((big[:512] @ weight).sum(), weight)[0]
    assert torch.equal(weight.grad, want) and torch.equal(small.grad, 2 * small.detach())


def test_a_tensor_saved_by_several_ops_is_written_once(swapper):
    torch.manual_seed(1)
    x = torch.randn(1024, 256)
    ws = [torch.randn(256, 256, requires_grad=True) for _ in range(3)]

    def grads(hooks):
        for w in ws:
            w.grad = None
        h = x * 2  # owns its storage; saved by the three products below
        if hooks:
            with swapper.hooks():
                loss = sum((h @ w).sum() for w in ws)
        else:
            loss = sum((h @ w).sum() for w in ws)
        del h
        loss.backward()
        return [w.grad.clone() for w in ws]

    want = grads(False)
    got = grads(True)
    assert swapper.stats.swapped_tensors == 1 and swapper.stats.written_bytes == x.numel() * 4
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_full_store_keeps_tensors_in_memory(tmp_path):
    sw = ActivationSwapper(tmp_path / "small.store", 8 * MIB, min_bytes=64 << 10)
    try:
        layers, x = _mlp(), torch.randn(2048, 256)  # 2 MiB per saved tensor: only a few fit
        want_loss, want_grads = _step(layers, x)
        loss, grads = _step(layers, x, sw)
        assert torch.equal(loss, want_loss) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))
        assert sw.stats.kept_bytes > 0 and sw.stats.written_bytes > 0
    finally:
        sw.close()


def _tally_pack(swapper):
    """Wrap the swapper's pack hook: the bytes and handle of each storage handed over, in pack order."""
    sizes, pack = [], swapper._pack

    def tally(t):
        out = pack(t)
        if out is not t and all(out.handle is not handle for _, handle in sizes):
            sizes.append((t.untyped_storage().nbytes(), out.handle))
        return out

    swapper._pack = tally
    return sizes


def test_a_dram_allowance_keeps_the_latest_tensors_and_writes_the_rest(tmp_path):
    allowance = 3 * (512 << 10)  # three of the 512 KiB saved tensors of _mlp at 512 x 256
    sw = ActivationSwapper(tmp_path / "act.store", 64 * MIB, min_bytes=64 << 10, write_behind_bytes=MIB,
                           read_ahead_bytes=MIB, dram_bytes=allowance)
    try:
        layers, x = _mlp(), torch.randn(512, 256)
        want_loss, want_grads = _step(layers, x)
        sizes = _tally_pack(sw)
        for layer in layers:
            layer.zero_grad()
        h = x
        with sw.hooks():
            for layer in layers:
                h = torch.nn.functional.gelu(layer(h))
            loss = torch.log_softmax(h, -1).sum()
        handles = [out for _, out in sizes]
        total = sum(n for n, _ in sizes)
        # the tail of the pass stays in DRAM, within the allowance; everything before it was written
        tail, in_dram = 0, []
        for n, handle in reversed(sizes):
            if tail + n > allowance:
                break
            tail += n
            in_dram.append(handle)
        assert tail > 0 and all(hd.key is None and hd.tensor is not None for hd in in_dram)
        written = [hd for hd in handles if all(hd is not k for k in in_dram)]
        assert written and all(hd.key is not None for hd in written)
        assert sw.stats.max_forward_dram_bytes == tail and sw.stats.dram_bytes == tail
        assert sw.stats.max_forward_swapped_bytes == sw.stats.written_bytes == total - tail
        assert sw.stats.forwards == 1 and sw.stats.dram_allowance_bytes == allowance
        loss.backward()
        assert torch.equal(loss.detach(), want_loss)
        assert all(torch.equal(p.grad, g) for p, g in zip((p for la in layers for p in la.parameters()), want_grads))
        del sw._pack  # the tally (and the handles it lists) goes
        del loss, h, handles, written, in_dram, sizes, handle
        gc.collect()
        assert sw.store.used_bytes == 0 and sw._held_bytes == 0
        for _ in range(2):  # the window starts again at each forward pass
            loss, grads = _step(layers, x, sw)
            assert torch.equal(loss, want_loss) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))
        assert sw.stats.forwards == 3 and sw.stats.dram_bytes == 3 * tail
    finally:
        sw.close()


def test_an_allowance_above_the_pass_writes_nothing(tmp_path):
    sw = ActivationSwapper(tmp_path / "act.store", 64 * MIB, min_bytes=64 << 10, dram_bytes=64 * MIB)
    try:
        layers, x = _mlp(), torch.randn(512, 256)
        want_loss, want_grads = _step(layers, x)
        loss, grads = _step(layers, x, sw)
        assert torch.equal(loss, want_loss) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))
        assert sw.stats.written_bytes == sw.stats.read_bytes == 0
        assert sw.stats.max_forward_dram_bytes >= 12 * (512 << 10)
    finally:
        sw.close()


def test_views_of_one_storage_are_written_once_and_restored_with_their_layout(swapper):
    h = torch.randn(1024, 256)  # 1 MiB: one storage, saved below through four views
    views = [h, h.view(256, 1024), h[512:], h.t(), h.view(torch.int32)[3:7, ::2]]
    with swapper.hooks():
        packed = [swapper._pack(v) for v in views]
    stats = swapper.stats
    assert stats.swapped_tensors == 1 and stats.written_bytes == h.numel() * 4
    assert stats.deduplicated_tensors == 4
    assert stats.deduplicated_bytes == sum(v.numel() * v.element_size() for v in views[1:])
    assert all(p.handle is packed[0].handle for p in packed) and packed[0].handle.tensor is None  # written, dropped
    out = [swapper._unpack(p) for p in packed]
    assert stats.read_bytes == h.numel() * 4  # one read serves every view
    assert len({o.untyped_storage().data_ptr() for o in out}) == 1
    assert out[0].untyped_storage().data_ptr() != h.untyped_storage().data_ptr()
    for want, got in zip(views, out):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.stride() == want.stride() and got.storage_offset() == want.storage_offset()
        assert torch.equal(got, want)


def test_views_saved_by_autograd_give_the_same_gradients_from_one_write(swapper):
    torch.manual_seed(2)
    x = torch.randn(1024, 256)
    w1, w2 = torch.randn(256, 64, requires_grad=True), torch.randn(256, 64, requires_grad=True)
    v = torch.randn(1024, 32, requires_grad=True)

    def grads(hooks):
        for p in (w1, w2, v):
            p.grad = None
        with swapper.hooks() if hooks else contextlib.nullcontext():
            h = torch.tanh(x)  # owns its storage (x needs no gradient: tanh saves nothing)
            loss = (h @ w1).sum() + (h[512:] @ w2).sum() + (h.t() @ v).square().sum()
        del h
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in (w1, w2, v)]

    want_loss, want = grads(False)
    got_loss, got = grads(True)
    assert torch.equal(got_loss, want_loss) and all(torch.equal(a, b) for a, b in zip(got, want))
    # the products save h, its row slice and its transpose: one storage, one write
    assert swapper.stats.written_bytes == x.numel() * 4 and swapper.stats.swapped_tensors == 1
    assert swapper.stats.deduplicated_tensors == 2 and swapper.stats.deduplicated_bytes == x.numel() * 4 * 3 // 2


def test_a_transposed_view_that_covers_its_storage_is_swapped(swapper):
    h = torch.randn(256, 1024)
    with swapper.hooks():
        packed = swapper._pack(h.t())
    assert swapper.stats.written_bytes == h.numel() * 4
    out = swapper._unpack(packed)
    assert out.stride() == (1, 1024) and torch.equal(out, h.t())


@pytest.mark.parametrize(("make", "covers"), [
    (lambda: torch.zeros(4, 6), True),
    (lambda: torch.zeros(4, 6).t(), True),
    (lambda: torch.zeros(2, 3, 4).permute(2, 0, 1), True),
    (lambda: torch.zeros(4, 1, 6)[:, :, :], True),
    (lambda: torch.zeros(4, 6)[1:], False),
    (lambda: torch.zeros(4, 6)[:, ::2], False),
    (lambda: torch.zeros(6).expand(4, 6), False),
    (lambda: torch.zeros(4, 6).view(torch.int16), True),
])
def test_covers_storage(make, covers):
    assert covers_storage(make()) is covers
