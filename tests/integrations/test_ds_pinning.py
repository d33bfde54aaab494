"""Routing of locked allocations and accelerator pin_memory to the arena (stand-in arena)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from memascend.integrations.deepspeed.pinning import (  # noqa: E402
    LockedAllocator,
    make_arena_pin_memory,
    make_arena_unpin_memory,
)


class StandInArena:
    """Exact-size allocations; remembers which storages it owns."""

    def __init__(self):
        self.live = {}

    def allocate(self, numel, dtype):
        t = torch.empty(numel, dtype=dtype)
        self.live[t.untyped_storage().data_ptr()] = t
        return t

    def free(self, t):
        del self.live[t.untyped_storage().data_ptr()]

    def is_pinned(self, t):
        return t.untyped_storage().data_ptr() in self.live


class FakeHandle:
    def __init__(self, accepts_arena):
        self.accepts_arena = accepts_arena
        self.locked = {}

    def is_pinned(self, t):
        return self.accepts_arena or t.data_ptr() in self.locked

    def new_cpu_locked_tensor(self, numel, example):
        t = torch.empty(numel, dtype=example.dtype)
        self.locked[t.data_ptr()] = t
        return t

    def free_cpu_locked_tensor(self, t):
        return self.locked.pop(t.data_ptr(), None) is not None


@pytest.mark.parametrize("accepts, prefer, source", [(True, True, "arena"), (False, True, "aio_handle"),
                                                     (True, False, "aio_handle")])
def test_locked_allocator_uses_the_arena_only_where_aio_accepts_it(accepts, prefer, source):
    arena, handle = StandInArena(), FakeHandle(accepts)
    alloc = LockedAllocator(handle, prefer_arena=prefer, arena=arena)
    assert alloc.source == source
    t = alloc.allocate(1000, torch.bfloat16)
    assert t.numel() == 1000 and t.dtype == torch.bfloat16 and alloc.allocated_bytes == 2000
    owner = arena.live if source == "arena" else handle.locked
    assert len(owner) == 1
    alloc.free(t)
    assert alloc.allocated_bytes == 0 and not arena.live and not handle.locked


def test_real_cpu_handle_keeps_its_own_allocator():
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed async_io op is not buildable here")
    handle = AsyncIOBuilder().load(verbose=False).aio_handle(1 << 20, 8, False, True, 1)
    alloc = LockedAllocator(handle, prefer_arena=True, arena=StandInArena())
    # A plain (CUDA-unregistered) buffer would get a bounce buffer per request: not used.
    assert alloc.source == "aio_handle"
    t = alloc.allocate(4097, torch.float32)
    assert handle.is_pinned(t) and t.numel() == 4097
    alloc.free(t)


class PinningAccelerator:
    _torch_pins_host_memory = True

    def pin_memory(self, tensor, make_copy=True, match_shape=True):
        return ("torch", tensor)

    def unpin_memory(self, tensor):
        return "torch-unpin"


class CpuLikeAccelerator(PinningAccelerator):
    _torch_pins_host_memory = False


def test_pin_memory_goes_to_the_arena_exact_size():
    arena = StandInArena()
    pin = make_arena_pin_memory(PinningAccelerator.pin_memory, arena_loader=lambda: arena)
    unpin = make_arena_unpin_memory(PinningAccelerator.unpin_memory, arena_loader=lambda: arena)
    acc = PinningAccelerator()
    src = torch.randn(3, 129)
    pinned = pin(acc, src)
    assert pinned.shape == src.shape and torch.equal(pinned, src) and arena.is_pinned(pinned)
    assert pinned.untyped_storage().nbytes() == src.numel() * 4  # no power-of-two rounding
    flat = pin(acc, src, make_copy=False, match_shape=False)
    assert flat.shape == (src.numel(),)
    assert unpin(acc, pinned) is None and unpin(acc, flat) is None and not arena.live
    assert unpin(acc, torch.ones(2)) == "torch-unpin"


def test_cpu_accelerator_pin_memory_stays_stock():
    arena = StandInArena()
    pin = make_arena_pin_memory(CpuLikeAccelerator.pin_memory, arena_loader=lambda: arena)
    src = torch.ones(10)
    assert pin(CpuLikeAccelerator(), src) == ("torch", src) and not arena.live
