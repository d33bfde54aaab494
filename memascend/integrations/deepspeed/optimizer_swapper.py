"""Optimizer-state swap buffers sized to the real sub-groups, allocated as first needed.

Stock DeepSpeed 0.19.8 (``runtime/swap_tensor/utils.py`` ``SwapBufferManager``, created by
``OptimizerSwapper.__init__`` in ``optimizer_utils.py``) locks ``buffer_count`` fp32 buffers of the
largest sub-group at construction, whether the optimizer needs that many or not, and returns
``None`` (an assertion failure upstream) when it needs more, e.g. the pipelined swapper with
``pipeline_read`` needs two sub-groups' worth (``2 x (states + 1)``).

:class:`OnDemandSwapBufferManager` has the same interface and buffer geometry (each buffer holds
the largest I/O-aligned sub-group, handed out narrowed to the request), but

* creates a buffer only when a request finds none free, so it holds exactly the peak number the
  optimizer used at once (``states + 1`` for the partitioned swapper with Adam);
* never refuses a request (grows past ``buffer_count``);
* ``allocate_all`` hands out the free buffers it already has (at least two): callers of it
  (initial fp32 write-out, gradient swap-out staging) only stream through them, and move the same
  bytes to the same files with fewer buffers;
* hands out *window* buffers of a requested, smaller size (``allocate_window``: the chunk-sized
  buffers :mod:`.chunked_swap_out` streams gradients and the initial fp32 write-out through),
  kept apart from the sub-group buffers and counted in :meth:`locked_bytes`;
* between optimizer steps (``release_free_buffers``, with ``enable_optimizer_buffer_release``)
  unlocks the buffers and hands their pages back to the OS, keeping their mappings (parked), and
  locks them again when the next step asks for them: the forward and backward run without them,
  and no buffer is allocated anew (stock keeps all of them locked for the whole run).

Locked memory per buffer is then set by the sub-group size. :func:`plan_sub_group_numel` picks
one that bounds the optimizer's locked memory while keeping every I/O request large.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime.swap_tensor.utils import SwapBufferManager

from memascend.config.settings import MemAscendSettings
from memascend.errors import UserError
from memascend.integrations.deepspeed.pinning import LockedAllocator, make_room
from memascend.memory import host_allocator

_FP32_BYTES = 4


class OnDemandSwapBufferManager(SwapBufferManager):
    """Drop-in ``SwapBufferManager`` that allocates largest-sub-group buffers on demand.

    Constructed by DeepSpeed as ``cls(num_elems, count, dtype, aio_handle)``; settings are a class
    attribute bound by :func:`make_swap_buffer_manager_class`.

    Args:
        num_elems: elements per buffer: the largest I/O-aligned sub-group.
        count: the stock ``buffer_count`` (kept for reporting; not a limit).
        dtype: element type (the master weights' dtype, fp32).
        aio_handle: the swapper's aio handle (locked allocation, ``is_pinned``).
    """

    memascend_settings: MemAscendSettings = MemAscendSettings()

    def __init__(self, num_elems: int, count: int, dtype: torch.dtype, aio_handle: Any) -> None:  # noqa: D107
        # Deliberately not calling SwapBufferManager.__init__: it locks count x num_elems up front.
        self.num_elems = int(num_elems)
        self.count = int(count)
        self.dtype = dtype
        self.aio_handle = aio_handle
        self.allocator = LockedAllocator(aio_handle, prefer_arena=self.memascend_settings.enable_arena_pinning)
        self.all_buffers: list[torch.Tensor] = []
        self.free_buffer_index: list[int] = []
        self.used_buffer_index: dict[int, int] = {}
        self.peak_buffers_in_use = 0
        self.peak_locked_bytes = 0
        self.gigabytes = 0.0
        self.parked_buffer_index: set[int] = set()
        self.window_buffers: list[torch.Tensor] = []
        self.free_window_index: list[int] = []
        self.used_window_index: dict[int, int] = {}
        self.peak_window_bytes = 0

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one buffer (the largest I/O-aligned sub-group)."""
        return self.num_elems * torch.empty(0, dtype=self.dtype).element_size()

    def _account(self) -> None:
        self.peak_locked_bytes = max(self.peak_locked_bytes, self.locked_bytes())
        self.gigabytes = self.locked_bytes() / 1024**3

    def _grow(self, how_many: int) -> None:
        make_room(self.memascend_settings, how_many * self.buffer_bytes)
        for _ in range(how_many):
            # Zeroed like the stock buffers: optimizer state may start from them.
            self.all_buffers.append(self.allocator.allocate(self.num_elems, self.dtype).zero_())
            self.free_buffer_index.append(len(self.all_buffers) - 1)
        self._account()

    def _unpark(self, indices: list[int]) -> None:
        parked = [i for i in indices if i in self.parked_buffer_index]
        if not parked:
            return
        make_room(self.memascend_settings, len(parked) * self.buffer_bytes)
        for index in parked:
            # Faults the pages in (2 MiB ones where parked with huge pages); they read as zero,
            # like a new buffer's, apart from the unreleased partial page at the end.
            host_allocator.lock_pages(self.all_buffers[index])
            self.parked_buffer_index.discard(index)
        self._account()

    def allocate(self, num_elems: int, count: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """``count`` buffers narrowed to ``num_elems``; grows instead of returning ``None``.

        Raises:
            ValueError: wrong dtype or ``num_elems`` above the largest sub-group.
        """
        if dtype != self.dtype:
            raise ValueError(f"swap buffers hold {self.dtype}, asked for {dtype}")
        if num_elems > self.num_elems:
            raise ValueError(f"{num_elems} elements exceed the largest sub-group ({self.num_elems})")
        missing = count - len(self.free_buffer_index)
        if missing > 0:
            self._grow(missing)
        # Hand out locked buffers before parked ones (which must be locked again first).
        self.free_buffer_index = ([i for i in self.free_buffer_index if i in self.parked_buffer_index]
                                  + [i for i in self.free_buffer_index if i not in self.parked_buffer_index])
        indices = self.free_buffer_index[-count:] if count else []
        self.free_buffer_index = self.free_buffer_index[:len(self.free_buffer_index) - count]
        self._unpark(indices)
        buffers = []
        for index in indices:
            view = self.all_buffers[index].narrow(0, 0, num_elems)
            self.used_buffer_index[id(view)] = index
            buffers.append(view)
        self.peak_buffers_in_use = max(self.peak_buffers_in_use, len(self.used_buffer_index))
        return buffers

    streaming_buffers = 2
    """Fewest buffers :meth:`allocate_all` hands out: two, so a streaming writer (the gradient
    swapper during backward) fills one while the other is being written (one would make every
    flush wait for its own write)."""

    def allocate_all(self, num_elems: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every free locked buffer, creating or locking parked ones so that at least
        :attr:`streaming_buffers` are handed out (parked ones beyond that stay parked: the
        gradient swap-out during backward streams through two as fast as through four)."""
        locked_free = [i for i in self.free_buffer_index if i not in self.parked_buffer_index]
        count = max(self.streaming_buffers, len(locked_free))
        return self.allocate(num_elems=num_elems, count=count, dtype=dtype)

    def free(self, buffers: list[torch.Tensor]) -> None:
        """Return buffers from :meth:`allocate` (the same view objects).

        Raises:
            KeyError: a buffer that is not handed out.
        """
        keys = [id(b) for b in buffers]
        unknown = [k for k in keys if k not in self.used_buffer_index]
        if unknown:
            raise KeyError(f"{len(unknown)} buffer(s) were not allocated by this manager")
        for key in keys:
            self.free_buffer_index.append(self.used_buffer_index.pop(key))

    def allocate_window(self, num_elems: int, count: int) -> list[torch.Tensor]:
        """``count`` locked 1-D buffers of exactly ``num_elems`` elements of the manager's dtype,
        apart from the sub-group buffers (contents undefined): idle window buffers of that size are
        reused, others created. Return them with :meth:`free_window`.

        Raises:
            ValueError: ``num_elems`` or ``count`` below 1.
        """
        if num_elems < 1 or count < 1:
            raise ValueError(f"a window of {count} buffer(s) of {num_elems} elements")
        fitting = [i for i in self.free_window_index if self.window_buffers[i].numel() == num_elems]
        missing = count - len(fitting)
        if missing > 0:
            nbytes = num_elems * torch.empty(0, dtype=self.dtype).element_size()
            make_room(self.memascend_settings, missing * nbytes)
            for _ in range(missing):
                self.window_buffers.append(self.allocator.allocate(num_elems, self.dtype))
                fitting.append(len(self.window_buffers) - 1)
        handed = fitting[:count]
        self.free_window_index = [i for i in self.free_window_index if i not in handed]
        buffers = []
        for index in handed:
            buffer = self.window_buffers[index]
            self.used_window_index[id(buffer)] = index
            buffers.append(buffer)
        self.peak_window_bytes = max(self.peak_window_bytes, self._window_bytes(self.used_window_index.values()))
        self._account()
        return buffers

    def free_window(self, buffers: list[torch.Tensor]) -> None:
        """Return buffers from :meth:`allocate_window` (kept locked for reuse until
        :meth:`release_free_buffers`).

        Raises:
            KeyError: a buffer that is not handed out.
        """
        keys = [id(b) for b in buffers]
        if any(k not in self.used_window_index for k in keys):
            raise KeyError("window buffer(s) not allocated by this manager")
        for key in keys:
            self.free_window_index.append(self.used_window_index.pop(key))

    def _window_bytes(self, indices: Any) -> int:
        return sum(self.window_buffers[i].nbytes for i in indices)

    def _release_window(self) -> int:
        """Free the idle window buffers (none is handed out between steps); the bytes freed."""
        released = self._window_bytes(self.free_window_index)
        idle = set(self.free_window_index)
        for index in idle:
            self.allocator.free(self.window_buffers[index])
        kept = [b for i, b in enumerate(self.window_buffers) if i not in idle]
        if self.used_window_index:  # re-index the ones still handed out
            position = {id(b): n for n, b in enumerate(kept)}
            self.used_window_index = {key: position[key] for key in self.used_window_index}
        self.window_buffers, self.free_window_index = kept, []
        return released

    def parkable(self) -> bool:
        """Whether idle buffers are parked (kept mapped, unlocked, pages released) rather than freed.

        Only the aio handle's buffers are: arena memory on a CUDA host is registered with CUDA
        and must stay resident while registered (the arena releases its own idle regions).
        """
        return self.allocator.source == "aio_handle" and host_allocator.can_park()

    def release_free_buffers(self) -> int:
        """Unlock every buffer and return its memory when none is handed out (between optimizer steps).

        The forward and backward then run without the buffers' memory, and the peak stays
        ``states + 1`` buffers. Buffers of the aio handle are parked
        (:func:`~memascend.memory.host_allocator.park_locked_pages`: same
        address, pages released, marked for huge pages with ``enable_torch_thp``) and locked
        again by the :meth:`allocate` that hands them out; other buffers are freed and
        allocated anew. Idle window buffers (:meth:`allocate_window`) are freed in any case.
        Returns the bytes released (only the window's while any sub-group buffer is in use).
        """
        released_window = self._release_window()
        if self.used_buffer_index or not self.all_buffers:
            self.gigabytes = self.locked_bytes() / 1024**3
            return released_window
        released = self.locked_bytes() - self._window_bytes(range(len(self.window_buffers)))
        if self.parkable():
            for index, buffer in enumerate(self.all_buffers):
                if index not in self.parked_buffer_index:
                    host_allocator.park_locked_pages(buffer, huge_pages=self.memascend_settings.enable_torch_thp)
                    self.parked_buffer_index.add(index)
        else:
            for buffer in self.all_buffers:
                self.allocator.free(buffer)
            self.all_buffers, self.free_buffer_index = [], []
        self.gigabytes = self.locked_bytes() / 1024**3
        return released + released_window

    def locked_bytes(self) -> int:
        """Bytes locked by this manager's buffers now (parked ones excluded, window buffers included)."""
        return sum(b.numel() * b.element_size() for i, b in enumerate(self.all_buffers)
                   if i not in self.parked_buffer_index) + self._window_bytes(range(len(self.window_buffers)))

    def __del__(self) -> None:
        buffers = getattr(self, "all_buffers", None) or []
        buffers = buffers + (getattr(self, "window_buffers", None) or [])
        allocator = getattr(self, "allocator", None)
        if not buffers or allocator is None:
            return
        for buf in buffers:
            try:
                allocator.free(buf)
            except Exception:  # noqa: BLE001 - interpreter teardown may have dropped the handle
                pass
        self.all_buffers, self.window_buffers = [], []


def make_swap_buffer_manager_class(settings: MemAscendSettings) -> type[OnDemandSwapBufferManager]:
    """An :class:`OnDemandSwapBufferManager` subclass bound to ``settings``."""
    return type("OnDemandSwapBufferManager", (OnDemandSwapBufferManager,),
                {"memascend_settings": settings, "__module__": __name__})


def plan_sub_group_numel(*, locked_budget_bytes: int, buffers_in_flight: int = 4,
                         min_io_bytes: int = 8 * 1024**2, element_size_bytes: int = _FP32_BYTES) -> int:
    """Choose ``zero_optimization.sub_group_size`` to bound the optimizer's locked memory.

    The optimizer swapper locks ``buffers_in_flight`` buffers of the largest sub-group (Adam with
    the partitioned swapper: parameter, two moments and the gradient = 4; the pipelined swapper
    doubles it). A sub-group must not fall below ``min_io_bytes`` per tensor, or each NVMe request
    gets too small to reach the drive's bandwidth.

    Args:
        locked_budget_bytes: locked bytes the optimizer swap buffers may use in total.
        buffers_in_flight: buffers of the largest sub-group held at once.
        min_io_bytes: smallest acceptable I/O request.
        element_size_bytes: bytes per element of the master weights (fp32: 4).

    Returns:
        Elements per sub-group: ``budget / (buffers x element size)``, rounded down to a multiple
        of 1 Mi elements when that large.

    Raises:
        UserError: the budget cannot hold ``buffers_in_flight`` requests of ``min_io_bytes``.
    """
    if buffers_in_flight < 1:
        raise UserError(f"buffers_in_flight must be at least 1, got {buffers_in_flight}")
    numel = locked_budget_bytes // (buffers_in_flight * element_size_bytes)
    if numel * element_size_bytes < min_io_bytes:
        need_mib = buffers_in_flight * min_io_bytes / 1024**2
        raise UserError(f"optimizer locked budget {locked_budget_bytes / 1024**2:.1f} MiB is below the "
                        f"{need_mib:.1f} MiB needed for {buffers_in_flight} buffers of "
                        f"{min_io_bytes / 1024**2:.1f} MiB; raise the budget")
    granule = 1 << 20
    return (numel // granule) * granule if numel >= granule else int(numel)
