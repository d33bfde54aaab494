"""Swap I/O of a run: the bytes read and written on the swap target and the time spent waiting for
them, and the target's sequential bandwidth (the disk floor of a phase).

Both engines move their swap bytes through one of two handle classes: DeepSpeed 0.19.8's aio handle
(the ``async_io`` op's ``aio_handle``: ``async_pread``/``async_pwrite`` then ``wait``, or the
synchronous ``sync_pread``/``sync_pwrite``/``read``/``write``/``pread``/``pwrite``) on a swap folder,
and memascend's :class:`~.swap_backend.StoreSwapHandle` on a raw store, plus the chunked step's ranged
store transfers (:class:`~.chunk_io.StoreRangeIO`, which count themselves here). :func:`install` wraps
those classes' methods (through the seam's patch registry, so ``revert()`` restores them) to count
into :data:`METER`:

* ``read_bytes`` / ``write_bytes``: the bytes of every buffer handed to a read or write (a request's
  payload; the aio handle splits it into ``block_size`` requests itself);
* ``wait_s``: wall seconds the calling thread spent inside ``wait`` and inside the synchronous
  transfers, i.e. the time the step was blocked on the swap target (submitting an asynchronous
  transfer is not counted).

Counting is per process (all ranks' handles in it), from any thread; the recipe takes
:meth:`SwapIOMeter.totals` at its phase boundaries.

:func:`probe_folder_bandwidth` measures the floor's bandwidth: the engine's own sequential write and
read of one file in the swap folder (the run's ``aio`` settings, a few hundred MiB), at the start of
the run. A phase's disk floor is ``read_bytes / read_bytes_per_s + write_bytes / write_bytes_per_s``
(:func:`floor_s`): the time the target needs for the phase's bytes, reads and writes sharing it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
import time
from typing import Any

_ASYNC_OP_NAME = "async_io"
"""Name of DeepSpeed's aio op among its builders' loaded ops (``OpBuilder._loaded_ops``)."""


def _loaded_aio_op() -> Any | None:
    """DeepSpeed's aio op module if a builder has loaded it in this process (never loads it)."""
    builder = sys.modules.get("deepspeed.ops.op_builder.builder")
    if builder is None:
        return None
    return getattr(builder.OpBuilder, "_loaded_ops", {}).get(_ASYNC_OP_NAME)

#: handle method -> (direction, whether the call itself waits for the transfer). ``pread``/``pwrite``
#: wait unless their ``async`` argument is true (timed either way: submitting is cheap).
_METHODS = {
    "async_pread": ("read", False),
    "async_pwrite": ("write", False),
    "sync_pread": ("read", True),
    "sync_pwrite": ("write", True),
    "read": ("read", True),
    "write": ("write", True),
    "pread": ("read", True),
    "pwrite": ("write", True),
    "wait": (None, True),
}

_MARK = "_memascend_io_meter"


@dataclasses.dataclass(frozen=True)
class SwapIOTotals:
    """Swap I/O counted since the meter started (or a difference of two totals).

    Attributes:
        read_bytes, write_bytes: payload bytes read from / written to the swap target.
        read_ops, write_ops: transfers submitted (one per buffer handed to the handle).
        wait_s: seconds spent blocked in waits and synchronous transfers.
    """

    read_bytes: int = 0
    write_bytes: int = 0
    read_ops: int = 0
    write_ops: int = 0
    wait_s: float = 0.0

    def __sub__(self, other: SwapIOTotals) -> SwapIOTotals:
        return SwapIOTotals(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __add__(self, other: SwapIOTotals) -> SwapIOTotals:
        return SwapIOTotals(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def to_dict(self) -> dict:
        """``{"read_bytes", "write_bytes", "read_ops", "write_ops", "io_wait_s"}``."""
        return {"read_bytes": self.read_bytes, "write_bytes": self.write_bytes, "read_ops": self.read_ops,
                "write_ops": self.write_ops, "io_wait_s": self.wait_s}


_THREAD = threading.local()


def count_as_step_worker() -> None:
    """Count the calling thread's swap I/O apart (:meth:`SwapIOMeter.worker_totals`): the optimizer
    step run beside the forward (:mod:`.step_overlap`), whose bytes belong to the step, not to the
    phase the training thread is in meanwhile."""
    _THREAD.step_worker = True


class SwapIOMeter:
    """Thread-safe counters of swap I/O (:class:`SwapIOTotals`): the training thread's (and any
    other's), and the overlapped optimizer step's worker's apart."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = SwapIOTotals()
        self._worker = SwapIOTotals()

    def add(self, *, read_bytes: int = 0, write_bytes: int = 0, wait_s: float = 0.0) -> None:
        """Count one transfer (a non-zero byte count counts one op) and/or seconds waited."""
        worker = getattr(_THREAD, "step_worker", False)
        with self._lock:
            t = self._worker if worker else self._totals
            t = SwapIOTotals(t.read_bytes + read_bytes, t.write_bytes + write_bytes,
                             t.read_ops + (read_bytes > 0), t.write_ops + (write_bytes > 0), t.wait_s + wait_s)
            if worker:
                self._worker = t
            else:
                self._totals = t

    def totals(self) -> SwapIOTotals:
        """The counts so far, less the step worker's."""
        with self._lock:
            return self._totals

    def worker_totals(self) -> SwapIOTotals:
        """The overlapped optimizer step's worker's counts so far (:func:`count_as_step_worker`);
        its ``wait_s`` is the worker's, not time the training thread was blocked."""
        with self._lock:
            return self._worker

    def discount(self, extra: SwapIOTotals) -> None:
        """Take ``extra`` (counted by a measurement of the meter's own, e.g. the probe) back out."""
        with self._lock:
            self._totals = self._totals - extra


METER = SwapIOMeter()
"""The process's swap I/O meter."""


def _buffer_bytes(args: tuple, kwargs: dict) -> int:
    buffer = args[0] if args else kwargs.get("buffer")
    return int(getattr(buffer, "nbytes", 0) or 0)


def _counting(original: Any, direction: str | None, blocking: bool) -> Any:
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        nbytes = _buffer_bytes(args, kwargs) if direction else 0
        t0 = time.monotonic() if blocking else 0.0
        try:
            return original(self, *args, **kwargs)
        finally:
            METER.add(read_bytes=nbytes if direction == "read" else 0,
                      write_bytes=nbytes if direction == "write" else 0,
                      wait_s=time.monotonic() - t0 if blocking else 0.0)

    setattr(method, _MARK, True)
    return method


def handle_classes() -> list[type]:
    """The handle classes to meter that exist in this process: DeepSpeed's aio handle (only once its
    op is loaded; this never loads or builds it) and the raw store's handle."""
    from memascend.integrations.deepspeed.swap_backend import StoreSwapHandle

    classes: list[type] = [StoreSwapHandle]
    op = _loaded_aio_op()
    if op is not None and hasattr(op, "aio_handle"):
        classes.append(op.aio_handle)
    return classes


def install(registry: Any) -> int:
    """Wrap the transfer and wait methods of :func:`handle_classes` to count into :data:`METER`
    (through ``registry``; a class already wrapped is left as it is). Call after
    ``deepspeed.initialize`` (the swappers have loaded the aio op then); existing handles are
    metered from then on.

    Returns:
        The number of methods wrapped now.
    """
    wrapped = 0
    for cls in handle_classes():
        for name, (direction, blocking) in _METHODS.items():
            original = cls.__dict__.get(name)
            if original is None or getattr(original, _MARK, False):
                continue
            registry.patch(cls, name, _counting(original, direction, blocking))
            wrapped += 1
    return wrapped


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    """The swap target's sequential bandwidth as the engine's own transfers reach it.

    Attributes:
        read_bytes_per_s, write_bytes_per_s: measured bandwidths.
        probe_bytes: bytes of one timed pass (written over the file's allocated blocks, or read).
        call_bytes: bytes per transfer handed to the handle (each split into ``block_size`` requests).
        block_size_bytes, queue_depth, intra_op_parallelism: the run's aio settings the probe used.
        probe_s: wall seconds of the probe (the untimed allocating write included).
    """

    read_bytes_per_s: float
    write_bytes_per_s: float
    probe_bytes: int
    call_bytes: int
    block_size_bytes: int
    queue_depth: int
    intra_op_parallelism: int
    probe_s: float

    def to_dict(self) -> dict:
        """The fields as a JSON dict."""
        return dataclasses.asdict(self)


PROBE_BYTES = 128 << 20
"""Bytes of the bandwidth probe's file (written once untimed, then :data:`PROBE_PASSES` times each way)."""
PROBE_PASSES = 2
"""Timed passes of the probe in each direction (the fastest counts)."""
PROBE_CALL_BYTES = 16 << 20
"""Bytes per transfer of the probe (one locked buffer of this size)."""


def probe_folder_bandwidth(folder: str | os.PathLike, ds_config: dict, probe_bytes: int = PROBE_BYTES,
                           call_bytes: int = PROBE_CALL_BYTES) -> Bandwidth | None:
    """Sequential write then read of one file in swap folder ``folder`` through a new DeepSpeed aio
    handle with the run's ``aio`` settings: ``probe_bytes`` in transfers of ``call_bytes``, all
    submitted, then one wait (the handle's queue depth and threads as in the run). The file is
    written once untimed first (allocation), then overwritten and read back :data:`PROBE_PASSES`
    times each, the fastest pass of each direction counting; it is removed. Not counted by
    :data:`METER`.

    Returns:
        The bandwidths, or ``None`` when the aio op is not loaded in this process (no swap folder).

    Raises:
        RuntimeError: a transfer was refused or came back short.
    """
    op = _loaded_aio_op()
    if op is None:
        return None
    import torch
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    from deepspeed.runtime.swap_tensor.constants import (
        AIO_BLOCK_SIZE,
        AIO_INTRA_OP_PARALLELISM,
        AIO_OVERLAP_EVENTS,
        AIO_QUEUE_DEPTH,
        AIO_SINGLE_SUBMIT,
    )

    aio = get_aio_config(ds_config)
    calls = max(1, probe_bytes // call_bytes)
    t0 = time.monotonic()
    handle = op.aio_handle(aio[AIO_BLOCK_SIZE], aio[AIO_QUEUE_DEPTH], aio[AIO_SINGLE_SUBMIT],
                           aio[AIO_OVERLAP_EVENTS], aio[AIO_INTRA_OP_PARALLELISM])
    buffer = handle.new_cpu_locked_tensor(call_bytes, torch.empty(0, dtype=torch.uint8))
    path = os.path.join(os.fspath(folder), f".memascend-bandwidth-probe-{os.getpid()}.swp")
    try:
        buffer.fill_(7)
        # The swap files of steady steps are overwritten in place: the file's blocks are allocated
        # by an untimed first pass (a write that extends a file also pays the allocation). Then the
        # best of PROBE_PASSES timed passes each way: a shared disk's bandwidth varies from second
        # to second, and the floor is what the target can do.
        _timed_transfers(handle, handle.async_pwrite, buffer, path, calls)
        write_s = min(_timed_transfers(handle, handle.async_pwrite, buffer, path, calls) for _ in range(PROBE_PASSES))
        read_s = min(_timed_transfers(handle, handle.async_pread, buffer, path, calls) for _ in range(PROBE_PASSES))
    finally:
        handle.free_cpu_locked_tensor(buffer)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    total = calls * call_bytes
    return Bandwidth(read_bytes_per_s=total / read_s, write_bytes_per_s=total / write_s, probe_bytes=total,
                     call_bytes=call_bytes, block_size_bytes=int(aio[AIO_BLOCK_SIZE]),
                     queue_depth=int(aio[AIO_QUEUE_DEPTH]), intra_op_parallelism=int(aio[AIO_INTRA_OP_PARALLELISM]),
                     probe_s=time.monotonic() - t0)


def _timed_transfers(handle: Any, submit: Any, buffer: Any, path: str, calls: int) -> float:
    # The probe's own handle: a metered class counts it, so the meter is put back afterwards.
    before = METER.totals()
    t0 = time.monotonic()
    for i in range(calls):
        if submit(buffer, path, i * buffer.nbytes) != 0:
            raise RuntimeError(f"bandwidth probe: transfer {i} of {path} was refused")
    done = handle.wait()
    elapsed = time.monotonic() - t0
    if done != calls:
        raise RuntimeError(f"bandwidth probe: {done} of {calls} transfers of {path} completed")
    METER.discount(METER.totals() - before)
    return max(elapsed, 1e-9)


def floor_s(io: dict, bandwidth: Bandwidth | dict | None) -> float | None:
    """The disk floor of a phase: ``read_bytes / read_bytes_per_s + write_bytes / write_bytes_per_s``
    (seconds; ``io`` as :meth:`SwapIOTotals.to_dict`), ``None`` without a bandwidth."""
    if bandwidth is None:
        return None
    bw = bandwidth.to_dict() if isinstance(bandwidth, Bandwidth) else bandwidth
    return io["read_bytes"] / bw["read_bytes_per_s"] + io["write_bytes"] / bw["write_bytes_per_s"]
