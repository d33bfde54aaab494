"""Where the offload path's locked host memory comes from.

Two sources exist:

* the exact-size pinned arena (``memascend.memory.arena``, MemAscend section 4.3): 4 KiB-aligned,
  mlocked, registered with CUDA once when a CUDA runtime is present, no power-of-two rounding;
* the DeepSpeed aio handle's ``new_cpu_locked_tensor`` (posix_memalign + mlock, exact size, but not
  registered with CUDA).

DeepSpeed's aio op decides per request whether a buffer may be read into directly: only if torch
says it is pinned (``tensor.is_pinned()``: CUDA-registered memory) or the handle allocated it. Any
other buffer gets a full-size locked *bounce buffer* for every request, which would double the
locked memory and add a copy. Arena memory therefore serves the swap buffers only where the handle
accepts it (:func:`arena_if_accepted_by`, a CUDA host); on a CPU-only host the handle's own
exact-size allocator is used. The accelerator's ``pin_memory`` is routed to the arena only for
accelerators that really page-lock (``_torch_pins_host_memory``); DeepSpeed's CPU accelerator makes
``pin_memory`` a no-op, which already costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch


def load_arena() -> Any | None:
    """Return ``memascend.memory.arena.default_arena()``, or ``None`` when the op is unavailable."""
    try:
        arena_mod = importlib.import_module("memascend.memory.arena")
        return arena_mod.default_arena()
    except (ImportError, OSError, RuntimeError):
        return None


def arena_if_accepted_by(aio_handle: Any, arena: Any | None) -> Any | None:
    """Return ``arena`` if ``aio_handle`` reads into arena memory without a bounce buffer.

    Probes with one small arena allocation and the handle's ``is_pinned`` (DeepSpeed's own
    direct-I/O eligibility test).
    """
    if arena is None:
        return None
    probe = arena.allocate(1024, torch.uint8)
    try:
        accepted = bool(aio_handle.is_pinned(probe))
    finally:
        arena.free(probe)
    return arena if accepted else None


def make_room(settings: Any, locked_bytes: int) -> None:
    """Before locking ``locked_bytes`` of swap buffers (the aio handle's or the arena's, never the
    host block cache's): with ``settings.enable_host_block_cache``, have the cache unmap the idle
    bytes that locking them would otherwise add to the process's peak resident memory
    (:func:`memascend.memory.host_cache.make_room`), so the buffers take those pages instead of
    raising the peak, while pages the peak already paid for stay with the cache for the next forward.
    Used by the on-demand optimizer buffers and the chunked step."""
    if settings.enable_host_block_cache:
        from memascend.memory import host_cache

        host_cache.make_room(locked_bytes)


class LockedAllocator:
    """Exact-size locked 1-D tensors for swap buffers, from the arena or the aio handle.

    Args:
        aio_handle: the swapper's DeepSpeed aio handle (``new_cpu_locked_tensor``,
            ``free_cpu_locked_tensor``, ``is_pinned``).
        prefer_arena: use the arena when the handle accepts its memory.
        arena: the arena to use (default: :func:`load_arena`); tests pass a stand-in.
    """

    def __init__(self, aio_handle: Any, *, prefer_arena: bool, arena: Any | None = None) -> None:
        self._handle = aio_handle
        self._arena = None
        # Without CUDA the aio engine never treats arena memory as pinned (see module doc), so
        # the arena is not even loaded: probing it would map and lock a region for nothing.
        if prefer_arena and (arena is not None or torch.cuda.is_available()):
            self._arena = arena_if_accepted_by(aio_handle, arena if arena is not None else load_arena())
        self.allocated_bytes = 0

    @property
    def source(self) -> str:
        """``"arena"`` or ``"aio_handle"``."""
        return "arena" if self._arena is not None else "aio_handle"

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A locked 1-D tensor of exactly ``numel`` elements of ``dtype`` (contents undefined)."""
        if self._arena is not None:
            tensor = self._arena.allocate(numel, dtype)
        else:
            tensor = self._handle.new_cpu_locked_tensor(numel, torch.empty(0, dtype=dtype))
        self.allocated_bytes += tensor.numel() * tensor.element_size()
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        """Release a tensor from :meth:`allocate`."""
        self.allocated_bytes -= tensor.numel() * tensor.element_size()
        if self._arena is not None:
            self._arena.free(tensor)
        else:
            self._handle.free_cpu_locked_tensor(tensor)


def make_arena_pin_memory(original: Any, arena_loader: Any = load_arena) -> Any:
    """Wrap an accelerator's ``pin_memory`` so host tensors are pinned in the arena.

    Replaces ``DeepSpeedAccelerator.pin_memory`` (torch pinning, whose caching host allocator
    rounds every block up to a power of two). Falls back to ``original`` when the accelerator does
    not page-lock (CPU) or DeepSpeed's native pin backend is active, or no arena is available.

    Args:
        original: the accelerator class's ``pin_memory`` function.
        arena_loader: returns the arena or ``None``.

    Returns:
        A ``pin_memory(self, tensor, make_copy=True, match_shape=True)`` function.
    """

    def pin_memory(self: Any, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        from deepspeed.utils.pin_memory import get_active_native_pinned_memory

        arena = arena_loader() if getattr(self, "_torch_pins_host_memory", False) else None
        if arena is None or get_active_native_pinned_memory() is not None or tensor.device.type != "cpu":
            return original(self, tensor, make_copy=make_copy, match_shape=match_shape)
        pinned = arena.allocate(tensor.numel(), tensor.dtype)
        if match_shape:
            pinned = pinned.view(tensor.shape)
        if make_copy:
            pinned.copy_(tensor.reshape(pinned.shape))
        return pinned

    pin_memory.__wrapped__ = original  # type: ignore[attr-defined]
    return pin_memory


def make_arena_unpin_memory(original: Any, arena_loader: Any = load_arena) -> Any:
    """Wrap ``unpin_memory`` so arena tensors go back to the arena; others to ``original``."""

    def unpin_memory(self: Any, tensor: torch.Tensor) -> Any:
        arena = arena_loader() if getattr(self, "_torch_pins_host_memory", False) else None
        if arena is not None and arena.is_pinned(tensor):
            arena.free(tensor)
            return None
        return original(self, tensor)

    unpin_memory.__wrapped__ = original  # type: ignore[attr-defined]
    return unpin_memory
