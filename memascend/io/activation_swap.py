"""Activation swap: the tensors autograd saves in the forward pass, written to NVMe and read back in
the backward pass, bit for bit.

A training step's forward pass keeps every tensor the backward pass will need (layer inputs, attention
and MLP intermediates, the fp32 logits and their log-softmax) until the backward pass consumes it:
with a frozen base (LoRA) or long sequences that is most of the step's host memory, and the same in
every engine. :class:`ActivationSwapper` installs ``torch.autograd.graph.saved_tensors_hooks``: the pack
hook submits each large saved host tensor to a :class:`~memascend.io.store.TensorStore` on a file in the
swap folder (O_DIRECT, CRC32C per extent) and drops its reference once the write is done; the unpack
hook reads it back (reads for the tensors the backward pass needs next are issued ahead, since it
consumes them in about the reverse order). The backward pass sees the same values, dtypes, shapes and
strides, so losses and gradients are bit-identical to a run without it.

A DRAM allowance (``dram_bytes``) keeps up to that many bytes of each forward pass's swappable saved
tensors in host memory: the *latest* ones. Every eligible tensor first joins a window of tensors held
in DRAM; when the window's bytes pass the allowance, its oldest tensors are written to the store. At
the end of the forward pass the window holds the tail of the pass (the loss's fp32 tensors, the last
layers), which the backward pass consumes first: it starts on tensors already in memory while the
read-ahead fetches the earlier ones, instead of waiting on reads from its first op, as it would if the
*first* bytes of the pass were kept (those are needed last, so they would sit in DRAM through the
whole backward pass while its start waits on the store). Holding a tensor until it leaves the window
delays its write by at most the allowance; nothing else changes.

The unit written is a storage: the first saved tensor that covers its whole storage (contiguous, or
any dense permutation of it, such as a transposed view) hands that storage to the swapper. Every later
saved tensor of the same storage in the same forward pass (the same tensor saved by the q, k and v
projections; a detached alias of a module's output saved by the next layer; a per-head view of the
q/k/v projection saved by attention) is not written again: it keeps its dtype, shape, strides and
storage offset, and the unpack hook builds it on the one copy of the storage (the original while it is
still in memory, else the one read), so it has the same values as without the swap. Its bytes are
counted in :attr:`ActivationSwapStats.deduplicated_bytes`.

Not swapped (handed back to autograd as they are): parameters and their views (ZeRO-3 swaps those
itself), storages under ``min_bytes``, non-CPU tensors, tensors that cover only part of their storage
and whose storage was not handed over before (a view of a larger buffer: writing it would free
nothing), and tensors that do not fit in the store (counted in :attr:`ActivationSwapStats.kept_bytes`).

Source: ZeRO-Infinity's activation checkpoint offload (Rajbhandari et al., SC'21, section 5.1.2),
which offloads checkpoints to CPU memory; here host memory is what is saved, so they go to NVMe through
MemAscend's direct NVMe engine (arXiv 2505.23254).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memascend.io.errors import StoreFullError
from memascend.io.records import Ticket
from memascend.io.store import TensorStore

DEFAULT_MIN_BYTES = 1 << 20
"""Smallest saved tensor that is swapped (1 MiB): below it the request overhead outweighs the bytes."""

DEFAULT_WRITE_BEHIND_BYTES = 64 << 20
"""Bytes of swapped tensors whose writes may be in flight at once (each is held in memory until its
write completes); past it the forward pass waits for the oldest write."""

DEFAULT_READ_AHEAD_BYTES = 64 << 20
"""Bytes of swapped tensors read ahead of the backward pass."""


@dataclasses.dataclass
class ActivationSwapStats:
    """Counters of one :class:`ActivationSwapper` (bytes; cumulative over the run unless named peak).

    Attributes:
        written_bytes: saved tensors written to the store.
        read_bytes: saved tensors read back (a tensor still in memory when the backward pass needs
            it is handed back without a read).
        kept_bytes: eligible saved tensors kept in memory because the store was full.
        swapped_tensors: storages written (one per storage, however many saved tensors view it).
        deduplicated_bytes: bytes (their own elements) of saved tensors that view a storage already
            handed to the swapper in the same forward pass: restored from that storage's one write
            (or from memory) instead of being written or kept again.
        deduplicated_tensors: how many such saved tensors.
        peak_stored_bytes: most bytes of saved tensors in the store at once.
        capacity_bytes: the store's data capacity.
        dram_allowance_bytes: the DRAM allowance per forward pass (0: every eligible tensor is written).
        forwards: forward passes run under the hooks.
        dram_bytes: eligible saved tensors held in DRAM by the allowance at the end of each forward
            pass, summed over the passes (``dram_bytes / forwards``: the mean per pass).
        max_forward_dram_bytes: the most of them at the end of one forward pass.
        max_forward_swapped_bytes: the most bytes written to the store by one forward pass (its
            tensors that left the window, or all eligible ones without an allowance).
    """

    written_bytes: int = 0
    read_bytes: int = 0
    kept_bytes: int = 0
    swapped_tensors: int = 0
    deduplicated_bytes: int = 0
    deduplicated_tensors: int = 0
    peak_stored_bytes: int = 0
    capacity_bytes: int = 0
    dram_allowance_bytes: int = 0
    forwards: int = 0
    dram_bytes: int = 0
    max_forward_dram_bytes: int = 0
    max_forward_swapped_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class _Swapped:
    """One swapped storage (the whole of it, as a flat tensor): held in DRAM (``held``: in the
    allowance's window; or kept, the store being full: ``key`` is ``None``), or in the store (``key``),
    what the unpack hook reads back. Frees its extent when autograd drops the last :class:`_View` of it
    (the graph is freed after backward)."""

    __slots__ = ("__weakref__", "dtype", "freed", "held", "key", "loaded", "nbytes", "owner", "ticket", "tensor")

    def __init__(self, owner: ActivationSwapper, flat: torch.Tensor) -> None:
        self.owner = owner
        self.key: str | None = None  # the store extent's key once written
        self.ticket: Ticket | None = None
        self.tensor: torch.Tensor | None = flat  # the saved tensor's bytes, held until the write completes
        self.loaded: torch.Tensor | None = None
        self.held = self.freed = False
        self.dtype, self.nbytes = flat.dtype, flat.numel() * flat.element_size()

    def __del__(self) -> None:
        try:
            self.owner._release(self)
        except Exception:  # noqa: BLE001 -- never raise from a finalizer; the store file goes at close
            pass


class _View:
    """What the pack hook hands autograd for one saved tensor: its storage's :class:`_Swapped` and
    where the tensor lies in that storage (dtype, shape, strides and offset in elements)."""

    __slots__ = ("dtype", "handle", "offset", "shape", "stride")

    def __init__(self, handle: _Swapped, t: torch.Tensor) -> None:
        self.handle, self.dtype = handle, t.dtype
        self.shape, self.stride, self.offset = tuple(t.shape), t.stride(), t.storage_offset()

    def on(self, flat: torch.Tensor) -> torch.Tensor:
        """The saved tensor, built on ``flat`` (the storage's bytes: the original or the one read)."""
        return torch.empty(0, dtype=self.dtype).set_(flat.untyped_storage(), self.offset, self.shape, self.stride)


def covers_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` holds every byte of its storage once: offset 0, ``numel`` elements filling the
    storage, and strides that are a permutation of contiguous strides (dense, no overlap)."""
    if t.storage_offset() != 0 or t.numel() * t.element_size() != t.untyped_storage().nbytes():
        return False
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class ActivationSwapper:
    """Swaps the saved tensors of the forward passes run under :meth:`hooks` to a store file.

    Args:
        path: the store file to create (in the run's swap folder); unlinked once open.
        capacity_bytes: the file's size (preallocated).
        min_bytes, write_behind_bytes, read_ahead_bytes: see the module constants.
        dram_bytes: bytes of each forward pass's eligible saved tensors kept in DRAM, the latest ones
            (see the module docstring); 0 or ``None``: every eligible tensor is written.
        meter: called as ``meter(read_bytes=, write_bytes=, wait_s=)`` for every transfer submitted
            and every wait (the seam's swap I/O meter, so the bytes show in the per-phase swap I/O).

    Raises:
        UserError / DeviceRefusedError: the file cannot be created (see ``TensorStore.create``).
    """

    def __init__(self, path: str | os.PathLike, capacity_bytes: int, *, min_bytes: int = DEFAULT_MIN_BYTES,
                 write_behind_bytes: int = DEFAULT_WRITE_BEHIND_BYTES,
                 read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES, dram_bytes: int | None = None,
                 meter: Callable[..., None] | None = None) -> None:
        self.path = Path(path)
        self.store = TensorStore.create(self.path, size_bytes=int(capacity_bytes))
        self.path.unlink()  # the open descriptor keeps it: no file is left behind, whatever ends the process
        self.min_bytes, self.write_behind_bytes, self.read_ahead_bytes = min_bytes, write_behind_bytes, read_ahead_bytes
        self._meter = meter or (lambda **_: None)
        self.dram_bytes = int(dram_bytes or 0)
        self.stats = ActivationSwapStats(capacity_bytes=self.store.capacity_bytes, dram_allowance_bytes=self.dram_bytes)
        self._lock = threading.RLock()
        self._keys = itertools.count()
        self._writing: collections.deque[weakref.ref[_Swapped]] = collections.deque()  # writes in flight, oldest first
        self._writing_bytes = 0
        self._stored_bytes = 0
        self._order: list[weakref.ref[_Swapped]] = []  # this forward's handles in pack order
        # this forward's storages handed over: the storage's StorageImpl address -> (a weak reference to
        # the storage, which keeps that address from being reused while it is held; its handle)
        self._storages: dict[int, tuple[StorageWeakRef, weakref.ref[_Swapped]]] = {}
        self._held: collections.deque[weakref.ref[_Swapped]] = collections.deque()  # the DRAM window, oldest first
        self._held_bytes = 0
        self._forward_written_bytes = 0
        self._installed: torch.autograd.graph.saved_tensors_hooks | None = None

    # ---------------------------------------------------------------- hooks
    @property
    def active(self) -> bool:
        """Whether the hooks are installed (between :meth:`begin` and :meth:`end`)."""
        return self._installed is not None

    def begin(self) -> None:
        """Install the hooks (a new forward pass: the read-ahead order starts again)."""
        if self._installed is not None:
            self.end()
        with self._lock:
            for ref in self._held:  # the previous pass's tail leaves the window (it stays in DRAM)
                handle = ref()
                if handle is not None:
                    handle.held = False
            self._held.clear()
            self._held_bytes = self._forward_written_bytes = 0
        self._order, self._storages = [], {}
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._installed = hooks

    def end(self) -> None:
        """Remove the hooks and wait for the writes still in flight, so that the saved tensors'
        memory is free before the backward pass (which reads them back). Call it in the thread that
        called :meth:`begin` (the hooks are thread-local)."""
        hooks, self._installed = self._installed, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        with self._lock:
            if hooks is not None:
                st = self.stats
                st.forwards += 1
                st.dram_bytes += self._held_bytes
                st.max_forward_dram_bytes = max(st.max_forward_dram_bytes, self._held_bytes)
                st.max_forward_swapped_bytes = max(st.max_forward_swapped_bytes, self._forward_written_bytes)
            for ref in list(self._writing):
                handle = ref()
                if handle is not None:
                    self._finish_write(handle)
            self._writing.clear()
            self._writing_bytes = 0

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """:meth:`begin` and :meth:`end` around a block (``with swapper.hooks(): loss = model(x)``)."""
        self.begin()
        try:
            yield
        finally:
            self.end()

    @staticmethod
    def _activation(t: torch.Tensor) -> bool:
        """A host tensor that is no parameter nor a view of one."""
        if t.device.type != "cpu" or isinstance(t, torch.nn.Parameter) or t.layout != torch.strided:
            return False
        base = t._base if t._base is not None else t
        return not (isinstance(base, torch.nn.Parameter) or hasattr(base, "ds_id"))

    def _handed_over(self, storage: torch.UntypedStorage) -> _Swapped | None:
        """The live handle of ``storage`` if this forward pass already handed it over."""
        seen = self._storages.get(storage._cdata)
        if seen is None or seen[0].expired():
            return None
        handle = seen[1]()
        return handle if handle is not None and not handle.freed else None

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._activation(t):
            return t
        with self._lock:
            storage = t.untyped_storage()
            handle = self._handed_over(storage)
            if handle is not None:  # another view of a storage already handed over: not written again
                self.stats.deduplicated_bytes += t.numel() * t.element_size()
                self.stats.deduplicated_tensors += 1
                return _View(handle, t)
            if storage.nbytes() < self.min_bytes or not covers_storage(t):
                return t
            handle = _Swapped(self, t.detach().as_strided((t.numel(),), (1,), 0))  # the whole storage, flat
            self._storages[storage._cdata] = (StorageWeakRef(storage), weakref.ref(handle))
            self._order.append(weakref.ref(handle))
            if not self.dram_bytes:
                self._write(handle)
                return _View(handle, t)
            handle.held = True
            self._held.append(weakref.ref(handle))
            self._held_bytes += handle.nbytes
            while self._held_bytes > self.dram_bytes and self._held:  # the oldest leave the window
                oldest = self._held.popleft()()
                if oldest is not None and oldest.held:
                    oldest.held = False
                    self._held_bytes -= oldest.nbytes
                    self._write(oldest)
        return _View(handle, t)

    def _write(self, handle: _Swapped) -> None:
        """Submit ``handle``'s write (a full store keeps it in DRAM); past the write-behind bytes, wait
        for the oldest writes."""
        key = f"a{next(self._keys)}"
        assert handle.tensor is not None
        try:
            handle.ticket = self.store.submit_write(key, handle.tensor)
        except StoreFullError:
            self.stats.kept_bytes += handle.nbytes
            return
        handle.key = key
        self._meter(write_bytes=handle.nbytes)
        self._writing.append(weakref.ref(handle))
        self._writing_bytes += handle.nbytes
        self._stored_bytes += handle.nbytes
        self.stats.written_bytes += handle.nbytes
        self._forward_written_bytes += handle.nbytes
        self.stats.swapped_tensors += 1
        self.stats.peak_stored_bytes = max(self.stats.peak_stored_bytes, self._stored_bytes)
        while self._writing_bytes > self.write_behind_bytes and len(self._writing) > 1:
            oldest = self._writing[0]()
            if oldest is None:
                self._writing.popleft()
            else:
                self._finish_write(oldest)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _View):
            return packed
        with self._lock:
            flat = self._load(packed.handle)
            self._read_ahead(packed.handle)
        return packed.on(flat)

    # ---------------------------------------------------------------- transfers
    def _finish_write(self, handle: _Swapped) -> None:
        """Wait for ``handle``'s write and drop the memory it held."""
        if handle.ticket is None or handle.ticket.op != "write":
            return
        self._wait(handle.ticket)
        handle.ticket = None
        handle.tensor = None
        self._writing = collections.deque(r for r in self._writing if r() is not None and r() is not handle)
        self._writing_bytes -= handle.nbytes

    def _start_read(self, handle: _Swapped) -> None:
        if handle.loaded is not None or handle.tensor is not None or handle.ticket is not None:
            return
        out = torch.empty(handle.nbytes // handle.dtype.itemsize, dtype=handle.dtype)
        handle.ticket = self.store.submit_read(handle.key, out)
        self._meter(read_bytes=handle.nbytes)
        handle.loaded = out
        self.stats.read_bytes += handle.nbytes

    def _load(self, handle: _Swapped) -> torch.Tensor:
        if handle.tensor is not None:  # its write may still be in flight: the data is still here
            return handle.tensor
        self._start_read(handle)
        if handle.ticket is not None:
            self._wait(handle.ticket)
            handle.ticket = None
        assert handle.loaded is not None
        return handle.loaded

    def _wait(self, ticket: Ticket) -> None:
        t0 = time.monotonic()
        self.store.wait(ticket)
        self._meter(wait_s=time.monotonic() - t0)

    def _read_ahead(self, handle: _Swapped) -> None:
        """Issue reads for the handles packed before ``handle`` (the backward pass's next ones)."""
        try:
            index = next(i for i in range(len(self._order) - 1, -1, -1) if self._order[i]() is handle)
        except StopIteration:
            return
        ahead = 0
        for ref in reversed(self._order[:index]):
            other = ref()
            if other is None or other.key is None:
                continue
            if other.tensor is None and other.loaded is None:
                self._start_read(other)
            ahead += other.nbytes
            if ahead >= self.read_ahead_bytes:
                break

    def _release(self, handle: _Swapped) -> None:
        """Autograd dropped ``handle``: free its extent (after any transfer in flight)."""
        with self._lock:
            if handle.freed:
                return
            handle.freed = True
            if handle.held:  # in the DRAM window: nothing in the store
                handle.held = False
                self._held_bytes -= handle.nbytes
            if handle.key is None or self.store is None:
                handle.loaded = handle.tensor = None
                return
            if handle.ticket is not None:
                if handle.ticket.op == "write":
                    self._finish_write(handle)
                else:
                    self._wait(handle.ticket)
                    handle.ticket = None
            self.store.free(handle.key)
            self._stored_bytes -= handle.nbytes
            handle.key, handle.loaded, handle.tensor = None, None, None

    def close(self) -> None:
        """Remove the hooks, wait for every transfer and close the store (its file was unlinked when
        it was made: the space goes with the last descriptor, also when the process is killed)."""
        if self._installed is not None:
            self.end()
        with self._lock:
            if self.store is None:
                return
            store, self.store = self.store, None
            self._writing.clear()
        try:
            store.wait_all()
        finally:
            store.close()
