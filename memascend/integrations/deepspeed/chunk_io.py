"""Reads and writes of part of a swap file, for the chunked optimizer step: a swap folder through
DeepSpeed's aio handle, or memascend's raw store.

DeepSpeed 0.19.8's swappers always move whole files at offset 0; the chunked step
(:mod:`~memascend.integrations.deepspeed.chunked_step`) moves one chunk of a sub-group's files at a
time. :func:`range_io_for` picks the implementation for the swapper's handle:

* :class:`AioRangeIO`: DeepSpeed's aio handle (``async_pread``/``async_pwrite`` with
  ``file_offset``, then ``wait``); the file stays where stock put it, under the name stock gave it,
  so checkpoints (which copy the swap folder) see stock's files;
* :class:`StoreRangeIO`: the raw store's :class:`~memascend.integrations.deepspeed.swap_backend.StoreSwapHandle`;
  a tensor's extent is read and written in place at byte offsets
  (:meth:`~memascend.io.store.TensorStore.read_extent` / ``write_extent``). A file is always
  written whole, in order, within one :meth:`begin_write` .. :meth:`end_write`, so the CRC32C of
  its bytes is accumulated as the pieces go out and recorded at the end, as a whole-tensor write
  records it (checkpoint export and later whole reads check it). A key read in order from 0 to its
  end is CRC32C-checked when its last piece arrives.

Both offer a synchronous API (:meth:`~AioRangeIO.read`, :meth:`~AioRangeIO.begin_write` /
:meth:`~AioRangeIO.write` / :meth:`~AioRangeIO.end_write`) and a split one for read-ahead and
write-behind (:meth:`~AioRangeIO.submit_read` / :meth:`~AioRangeIO.submit_write`, then
:meth:`~AioRangeIO.wait`). :attr:`~AioRangeIO.asynchronous` says whether a submitted transfer runs
while the caller computes: DeepSpeed's aio handle does the I/O on its own C++ threads and its
``wait`` waits for *every* operation outstanding on the handle (``deepspeed_io_handle_t::wait``), so
:class:`AioRangeIO` counts what it submitted and checks that count; the raw store's ranged transfers
(:meth:`~memascend.io.store.TensorStore.read_extent` / ``write_extent``) are synchronous, so
:class:`StoreRangeIO` completes each request when it is submitted (same order, same CRC32C checks)
and its :meth:`~StoreRangeIO.wait` has nothing left to wait for. :class:`StoreRangeIO` counts its
transfers (bytes and seconds) into :data:`~.io_meter.METER`; the aio handle's are counted by its
metered methods (:func:`~.io_meter.install`).

Every buffer is a contiguous CPU tensor whose first byte is direct-I/O aligned (a view at an
aligned offset of a locked buffer), and every byte offset is a multiple of 4 KiB.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from memascend.integrations.deepspeed.io_meter import METER


class AioRangeIO:
    """Ranged transfers through a DeepSpeed aio handle (a swap folder).

    Nothing else may submit to ``handle`` while this object has transfers outstanding (its
    ``wait`` would complete them and the counts would not match).

    Args:
        handle: the aio handle whose buffers are given (its ``is_pinned`` accepts them).
    """

    asynchronous = True
    """Submitted transfers run on the handle's threads until :meth:`wait`."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.pending = 0
        """Transfers submitted and not yet waited for."""

    def file_bytes(self, path: str) -> int | None:
        """Size of the swap file ``path`` in bytes, ``None`` when it does not exist."""
        try:
            return os.path.getsize(path)
        except OSError:
            return None

    def read(self, requests: list[tuple[torch.Tensor, str, int]]) -> None:
        """Fill each ``buffer`` from ``path`` at ``offset_bytes`` (``buffer.nbytes`` bytes) and wait
        (for every outstanding transfer, see :meth:`wait`).

        Raises:
            RuntimeError: the handle refused a request or completed fewer than submitted.
        """
        self.submit_read(requests)
        self.wait()

    def submit_read(self, requests: list[tuple[torch.Tensor, str, int]]) -> None:
        """Start filling each ``buffer`` from ``path`` at ``offset_bytes``; the buffers may be used
        only after :meth:`wait`.

        Raises:
            RuntimeError: the handle refused a request.
        """
        self._submit(requests, self.handle.async_pread, "read")

    def begin_write(self, path: str, total_bytes: int) -> None:
        """Start writing ``path`` (``total_bytes`` long once complete); nothing to do for a file."""

    def write(self, requests: list[tuple[torch.Tensor, str, int]]) -> None:
        """Write each ``buffer`` to ``path`` at ``offset_bytes`` and wait (raises as :meth:`read`)."""
        self.submit_write(requests)
        self.wait()

    def submit_write(self, requests: list[tuple[torch.Tensor, str, int]]) -> None:
        """Start writing each ``buffer`` to ``path`` at ``offset_bytes``; the buffers must stay
        unchanged until :meth:`wait` (raises as :meth:`submit_read`)."""
        self._submit(requests, self.handle.async_pwrite, "write")

    def end_write(self, path: str) -> None:
        """Finish writing ``path``; nothing to do for a file."""

    def wait(self) -> None:
        """Wait for every transfer submitted and not yet waited for.

        Raises:
            RuntimeError: the handle completed another number of transfers than were submitted.
        """
        pending, self.pending = self.pending, 0
        done = self.handle.wait() if pending else 0
        if done != pending:
            raise RuntimeError(f"chunked optimizer step: aio completed {done} of {pending} transfers")

    def _submit(self, requests: list[tuple[torch.Tensor, str, int]], submit: Any, verb: str) -> None:
        for buffer, path, offset in requests:
            if submit(buffer, path, int(offset)) != 0:
                raise RuntimeError(f"chunked optimizer step: aio {verb} of {buffer.nbytes} bytes at offset "
                                   f"{offset} of {path} was refused")
            self.pending += 1


class StoreRangeIO:
    """Ranged transfers on memascend's raw store.

    Args:
        handle: the rank's :class:`~memascend.integrations.deepspeed.swap_backend.StoreSwapHandle`.
    """

    asynchronous = False
    """Each request completes when it is submitted (the store's ranged transfers are synchronous)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.store = handle.store
        self._writing: dict[str, list[Any]] = {}  # key -> [reservation, crc, dtype, next offset]
        self._reading: dict[str, list[int]] = {}  # key -> [next offset, crc of the bytes read from 0]

    def file_bytes(self, path: str) -> int | None:
        """Bytes written under the key of ``path``, ``None`` when there is none."""
        key = self.handle.key(path)
        return self.store.record(key).nbytes if key in self.store else None

    def read(self, requests: list[tuple[torch.Tensor, str, int]]) -> None:
        """Fill each ``buffer`` from the key of ``path`` at ``offset_bytes``.

        A key read in order from offset 0 to its end (the chunked step's fp32 weights and moments)
        is CRC32C-checked against its record when the last piece arrives, before that piece is used;
        pieces read out of order are not checked.

        Raises:
            KeyError: nothing written under the key. StoreIOError: the read failed.
            ChecksumError: a key read whole in order does not match its recorded CRC32C.
        """
        for buffer, path, offset in requests:
            key = self.handle.key(path)
            rec = self.store.record(key)
            data = buffer.view(torch.uint8)
            t0 = time.monotonic()
            self.store.read_extent(rec, data, int(offset), buffer.nbytes)
            METER.add(read_bytes=buffer.nbytes, wait_s=time.monotonic() - t0)
            if self.store.enable_crc and rec.crc32c is not None:
                self._check_in_order(key, rec, data, int(offset), buffer.nbytes)

    def submit_read(self, requests: list[tuple[torch.Tensor, str, int]]) -> None:
        """:meth:`read` (completed now; raises as it)."""
        self.read(requests)

    def submit_write(self, requests: list[tuple[torch.Tensor, str, int]]) -> None:
        """:meth:`write` (completed now; raises as it)."""
        self.write(requests)

    def wait(self) -> None:
        """Nothing to wait for: every request completed when it was submitted."""

    def _check_in_order(self, key: str, rec: Any, data: torch.Tensor, offset: int, nbytes: int) -> None:
        from memascend.ops import nvme_io

        state = [0, 0] if offset == 0 else self._reading.get(key)
        if state is None or state[0] != offset:
            self._reading.pop(key, None)
            return
        state[1] = nvme_io.load().crc32c(data, nbytes, state[1])
        state[0] = offset + nbytes
        self._reading[key] = state
        if state[0] < rec.nbytes:
            return
        del self._reading[key]
        if state[1] != rec.crc32c:
            raise self.store.checksum_error(key, rec, state[1])

    def begin_write(self, path: str, total_bytes: int) -> None:
        """Start writing the key of ``path`` whole: in place when it holds ``total_bytes`` already,
        else into a newly reserved extent (the old one is given back).

        Raises:
            StoreFullError: no room for a new extent.
        """
        from memascend.io.records import Reservation

        key = self.handle.key(path)
        rec = self.store.record(key) if key in self.store else None
        if rec is not None and rec.nbytes == total_bytes:
            res, dtype = Reservation(key, rec.offset_bytes, rec.nbytes), rec.dtype
        else:
            res, dtype = self.store.reserve(key, total_bytes), None
        self._writing[key] = [res, 0, dtype, 0]

    def write(self, requests: list[tuple[torch.Tensor, str, int]]) -> None:
        """Write each ``buffer`` at ``offset_bytes`` of a key being written (in order from 0).

        Raises:
            ValueError: a key not begun, or a piece out of order. StoreIOError: the write failed.
        """
        from memascend.ops import nvme_io

        for buffer, path, offset in requests:
            key = self.handle.key(path)
            state = self._writing.get(key)
            if state is None or state[3] != offset:
                raise ValueError(f"chunked optimizer step: write of '{key}' at {offset} out of order")
            data = buffer.view(torch.uint8)
            t0 = time.monotonic()
            self.store.write_extent(state[0], data, int(offset), buffer.nbytes)
            METER.add(write_bytes=buffer.nbytes, wait_s=time.monotonic() - t0)
            if self.store.enable_crc:
                state[1] = nvme_io.load().crc32c(data, buffer.nbytes, state[1])
            state[2] = state[2] or str(buffer.dtype)
            state[3] = offset + buffer.nbytes

    def end_write(self, path: str) -> None:
        """Record the key of ``path`` as written whole (its CRC32C over the pieces).

        Raises:
            ValueError: fewer bytes written than begun with.
        """
        key = self.handle.key(path)
        res, crc, dtype, written = self._writing.pop(key)
        if written != res.nbytes:
            raise ValueError(f"chunked optimizer step: '{key}' got {written} of {res.nbytes} bytes")
        itemsize = torch.empty(0, dtype=_torch_dtype(dtype)).element_size()
        self.store.commit(res, crc32c=crc, dtype=dtype, shape=(res.nbytes // itemsize,))


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def range_io_for(handle: Any) -> AioRangeIO | StoreRangeIO:
    """The ranged I/O for a swapper's handle: the raw store's when it is a ``StoreSwapHandle``."""
    from memascend.integrations.deepspeed.swap_backend import StoreSwapHandle

    return StoreRangeIO(handle) if isinstance(handle, StoreSwapHandle) else AioRangeIO(handle)
