"""``TensorStore``: tensors swapped to a raw block device (or one preallocated file) by key.

Each key maps to one extent (aligned offset and length), kept by the store's
:class:`~memascend.io.extent_table.ExtentTable`; bytes move through the io_uring/O_DIRECT engine (``csrc/nvme_io``), so swapping never grows the
page cache. A CRC32C of every extent is recorded on write and checked on read (``enable_crc``).
The extent table lives on the device (:mod:`memascend.io.header`) and is persisted by
:meth:`TensorStore.flush` / :meth:`TensorStore.close`. Checkpoints (:mod:`memascend.io.checkpoint`:
ordinary files, since a raw store has no folder to copy) stream tensors through
:meth:`TensorStore.records`, :meth:`TensorStore.read_extent` and :meth:`TensorStore.reserve` /
:meth:`TensorStore.write_extent` / :meth:`TensorStore.commit` / :meth:`TensorStore.release`.

Source: MemAscend (arXiv 2505.23254), direct NVMe engine. Replaces the folder of ``.swp`` files
behind DeepSpeed's ``AsyncPartitionedParameterSwapper`` and ``PartitionedOptimizerSwapper``, and
the ``shutil.copytree`` of that folder in ``DeepSpeedEngine`` checkpointing.

Example::

    with TensorStore.create("/dev/nvme0n1p3") as store:
        store.write("layer0.weight", weight)
        ticket = store.submit_read("layer0.weight", out)
        store.wait(ticket)
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
from pathlib import Path

import torch

from memascend.errors import UserError
from memascend.io import device as _device
from memascend.io.engine import check_job, new_header, read_header, read_table
from memascend.io.engine import crc_bytes as _crc_bytes
from memascend.io.engine import open_engine as _open_engine
from memascend.io.errors import ChecksumError, DeviceRefusedError, StoreError, StoreFullError
from memascend.io.extent_table import ExtentTable
from memascend.io.header import StoreHeader, encode_table
from memascend.io.records import ExtentRecord, IOCounters, Reservation, Ticket
from memascend.io.target import TargetChange
from memascend.ops import nvme_io as _op
from memascend.units import format_bytes

DEFAULT_QUEUE_DEPTH = 32
DEFAULT_REQUEST_BYTES = 8 << 20
DEFAULT_TABLE_SLOT_BYTES = 2 << 20


class TensorStore:
    """Tensors by key on one block device or preallocated file. Use :meth:`create` or :meth:`open`.

    Thread-safe: several threads may submit and wait at once; up to ``queue_depth`` requests of
    at most ``request_bytes`` are in flight on the device. Per key, a write excludes any other
    transfer or free of that key until it is waited for; reads of one key may overlap.
    """

    def __init__(
        self,
        *,
        engine,
        info: _device.DeviceInfo,
        header: StoreHeader,
        records: dict[str, ExtentRecord],
        enable_crc: bool,
    ) -> None:
        self._engine = engine
        self.info = info
        self.header = header
        self.enable_crc = enable_crc
        self._table = ExtentTable(
            info.path,
            start_bytes=header.data_offset,
            end_bytes=engine.size_bytes,
            align_bytes=header.align_bytes,
            records=records,
        )
        self._lock = threading.Lock()
        self._tickets: dict[int, Ticket] = {}
        self._closed = False
        self._counters = [0, 0, 0, 0]  # read, write, payload read, payload write (bytes)

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        *,
        size_bytes: int | None = None,
        allow_overwrite: bool = False,
        owner_uuid: uuid.UUID | None = None,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        request_bytes: int = DEFAULT_REQUEST_BYTES,
        enable_crc: bool = True,
        enable_direct: bool = True,
        table_slot_bytes: int = DEFAULT_TABLE_SLOT_BYTES,
        backend: str = "auto",
        min_capacity_bytes: int | None = None,
    ) -> TensorStore:
        """Create an empty store on ``path``, refusing a target that holds anything else.

        Args:
            path: raw block device (e.g. ``/dev/nvme0n1p3``) or a file, created and preallocated
                (``posix_fallocate``) to ``size_bytes`` when missing or smaller.
            size_bytes: file size; required for a file that does not exist. Ignored for devices.
            allow_overwrite: accept a target carrying a filesystem, partition table or another
                store's header. A mounted or held device is refused regardless.
            owner_uuid: identity written in the header (default: a new random UUID); a target
                whose header carries this same UUID is this owner's old store and is reused.
            queue_depth: requests in flight at most (io_uring entries).
            request_bytes: largest single request; jobs are split into requests of this size.
            enable_crc: record a CRC32C per extent on write and check it on read.
            enable_direct: O_DIRECT; turn off only for filesystems without it (tmpfs).
            table_slot_bytes: room for the compressed extent table (two slots are reserved).
            backend: ``"auto"`` (io_uring, else libaio), ``"io_uring"`` or ``"libaio"``.
            min_capacity_bytes: refuse a target whose data region is smaller (checked before
                anything is written to it).

        A refused or failed create leaves the target as it was: a file it created is removed, a
        file it grew is truncated back to its size before.

        Raises:
            DeviceRefusedError: the target is in use or carries data (see above); a regular file
                that is not empty and not this owner's store counts as data, whatever its content.
            UserError: the path is unusable (missing, no size given, too small, no O_DIRECT).
        """
        p = Path(path)
        change = TargetChange(p)
        engine = None
        try:
            owner = owner_uuid or uuid.uuid4()
            change.prepare(size_bytes=size_bytes, owner_uuid=owner, allow_overwrite=allow_overwrite)
            info = _device.probe_info(p)
            engine = _open_engine(p, queue_depth, request_bytes, enable_direct, backend)
            header = new_header(engine, p, owner_uuid=owner, table_slot_bytes=table_slot_bytes)
            store = cls(engine=engine, info=info, header=header, records={}, enable_crc=enable_crc)
            # Checked before the header is written: a refused target is never modified.
            if min_capacity_bytes is not None and store.capacity_bytes < min_capacity_bytes:
                raise UserError(
                    f"nvme path {p} holds {format_bytes(store.capacity_bytes)} of store space; this run "
                    f"needs about {format_bytes(min_capacity_bytes)} for swapped parameters and optimizer "
                    "state: give a larger device or file"
                )
            store._write_raw(0, header.pack(_crc_bytes), "<store header>")
            return store
        except BaseException:
            if engine is not None:
                engine.close()
            change.undo()
            raise

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        owner_uuid: uuid.UUID | None = None,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        request_bytes: int = DEFAULT_REQUEST_BYTES,
        enable_crc: bool = True,
        enable_direct: bool = True,
        backend: str = "auto",
    ) -> TensorStore:
        """Open an existing store with the extent table of its last :meth:`flush`.

        Args:
            owner_uuid: when given, the header's owner must match.

        Raises:
            StoreFormatError: no store header, a damaged header or table.
            DeviceRefusedError: the target is in use, or belongs to another owner.
        """
        p = Path(path)
        info = _device.probe_info(p)
        reason = _device.in_use_reason(p)
        if reason:
            raise DeviceRefusedError(f"nvme path {p} is {reason}")
        engine = _open_engine(p, queue_depth, request_bytes, enable_direct, backend)
        try:
            header = read_header(engine, p)
            if owner_uuid is not None and header.owner_uuid != owner_uuid:
                raise DeviceRefusedError(
                    f"nvme path {p} holds the store of owner {header.owner_uuid}, not {owner_uuid}: {_device.FIX_OVERWRITE}"
                )
            records = read_table(engine, header, p)
            return cls(engine=engine, info=info, header=header, records=records, enable_crc=enable_crc)
        except BaseException:
            engine.close()
            raise

    # ------------------------------------------------------------------ properties
    @property
    def path(self) -> Path:
        return self.info.path

    @property
    def align_bytes(self) -> int:
        return self.header.align_bytes

    @property
    def capacity_bytes(self) -> int:
        """Bytes of the data region."""
        return self._table.alloc.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._table.alloc.used_bytes

    @property
    def free_bytes(self) -> int:
        return self._table.alloc.free_bytes

    @property
    def largest_free_bytes(self) -> int:
        return self._table.alloc.largest_free_bytes

    @property
    def engine(self):
        """The ``memascend_nvme_io.Engine`` (queue depth, request size, alignment, bounce bytes)."""
        return self._engine

    def io_counters(self) -> IOCounters:
        """Bytes moved so far (see :class:`IOCounters`)."""
        with self._lock:
            return IOCounters(*self._counters)

    def _count(self, op: str, nbytes: int) -> None:
        """Account one submitted transfer of ``nbytes`` payload bytes (``op``: "read"/"write")."""
        device = -(-nbytes // self.align_bytes) * self.align_bytes if self._engine.direct else nbytes
        i = 0 if op == "read" else 1
        with self._lock:
            self._counters[i] += device
            self._counters[i + 2] += nbytes

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._table.records)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._table.records

    def __len__(self) -> int:
        with self._lock:
            return len(self._table.records)

    def record(self, key: str) -> ExtentRecord:
        """The extent record of ``key``. Raises ``KeyError`` for an unknown key."""
        with self._lock:
            return self._table.records[key]

    # ------------------------------------------------------------------ transfers
    def write(self, key: str, tensor: torch.Tensor) -> ExtentRecord:
        """Write ``tensor`` under ``key`` and wait; see :meth:`submit_write`."""
        return self.wait(self.submit_write(key, tensor))

    def read(self, key: str, out: torch.Tensor) -> ExtentRecord:
        """Read ``key`` into ``out`` and wait; see :meth:`submit_read`."""
        return self.wait(self.submit_read(key, out))

    def read_tensor(self, key: str) -> torch.Tensor:
        """A new tensor with the dtype, shape and bytes written under ``key``."""
        rec = self.record(key)
        out = torch.empty(rec.shape, dtype=rec.torch_dtype())
        self.read(key, out)
        return out

    def submit_write(self, key: str, tensor: torch.Tensor) -> Ticket:
        """Queue a write of a contiguous CPU tensor (any dtype/shape) under ``key``.

        The key's previous extent is reused when the size matches, else replaced. Memory that
        is 4 KiB-aligned (pinned arena, ``aligned_empty``) is transferred in place; other memory
        through the engine's bounce buffers. Do not modify ``tensor`` before :meth:`wait`.

        Raises:
            StoreFullError: no free extent is large enough (the store is left unchanged).
            ValueError: a non-contiguous or non-CPU tensor, or a transfer of ``key`` in flight.
        """
        self._check_tensor(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            self._check_open()
            if self._table.busy(key):
                raise ValueError(f"tensor '{key}' has a transfer in flight; wait for it before writing")
            rec = self._table.place(key, nbytes, dtype=str(tensor.dtype), shape=tuple(tensor.shape))
        job = None
        if nbytes:
            try:
                job = self._engine.submit_write(tensor, rec.offset_bytes, nbytes, self.enable_crc)
                self._count("write", nbytes)
            except BaseException:
                with self._lock:
                    self._table.drop(key)
                raise
        ticket = Ticket(key=key, op="write", job_id=job, record=rec, tensor=tensor)
        if job is not None:
            with self._lock:
                self._tickets[job] = ticket
        return ticket

    def submit_read(self, key: str, out: torch.Tensor) -> Ticket:
        """Queue a read of ``key`` into the first ``record(key).nbytes`` bytes of ``out``.

        Args:
            out: contiguous CPU tensor of at least the written bytes (dtype and shape are free:
                the swappers read into slices of flat buffers).

        Raises:
            KeyError: unknown key.
            ValueError: ``out`` too small, non-contiguous or not on the CPU; a write of ``key``
                in flight.
        """
        self._check_tensor(out)
        with self._lock:
            self._check_open()
            rec = self._table.records[key]
            if key in self._table.writes:
                raise ValueError(f"tensor '{key}' has a write in flight; wait for it before reading")
            have = out.numel() * out.element_size()
            if have < rec.nbytes:
                raise ValueError(
                    f"tensor '{key}' holds {rec.nbytes} bytes; the output tensor has only {have}"
                )
            self._table.start_read(key)
        job = None
        if rec.nbytes:
            try:
                job = self._engine.submit_read(
                    out, rec.offset_bytes, rec.nbytes, self.enable_crc and rec.crc32c is not None
                )
                self._count("read", rec.nbytes)
            except BaseException:
                with self._lock:
                    self._table.end_transfer(key, "read")
                raise
        ticket = Ticket(key=key, op="read", job_id=job, record=rec, tensor=out)
        if job is not None:
            with self._lock:
                self._tickets[job] = ticket
        return ticket

    def wait(self, ticket: Ticket) -> ExtentRecord:
        """Wait for a submitted transfer and check it.

        Returns:
            The key's record (for a write, with its CRC32C filled in).

        Raises:
            StoreIOError: EIO or another OS error, or a short transfer; names key and offset.
                A failed write drops the key (its extent is freed).
            ChecksumError: a read whose CRC32C differs from the one recorded at write time.
        """
        result = self._engine.wait(ticket.job_id) if ticket.job_id is not None else None
        with self._lock:
            if ticket.job_id is not None:
                self._tickets.pop(ticket.job_id, None)
            self._table.end_transfer(ticket.key, ticket.op)
            if result is None:
                return ticket.record
            failed = result.error != 0 or result.short_transfer
            if ticket.op == "write":
                if failed:
                    self._table.drop(ticket.key)
                else:
                    rec = dataclasses.replace(ticket.record, crc32c=result.crc32c if result.has_crc else None)
                    self._table.records[ticket.key] = rec
                    ticket.record = rec
        check_job(result, ticket.key, ticket.record.offset_bytes, self.path, op=ticket.op)
        rec = ticket.record
        if ticket.op == "read" and result.has_crc and rec.crc32c is not None and result.crc32c != rec.crc32c:
            raise self.checksum_error(ticket.key, rec, result.crc32c)
        return rec

    def checksum_error(self, key: str, rec: ExtentRecord, actual_crc32c: int) -> ChecksumError:
        """The error for tensor ``key`` (record ``rec``) read back with CRC32C ``actual_crc32c``."""
        return ChecksumError(
            f"checksum mismatch reading tensor '{key}' at device offset {rec.offset_bytes} "
            f"({rec.nbytes} bytes) of {self.path}: expected crc32c 0x{rec.crc32c:08x}, read 0x{actual_crc32c:08x}",
            key=key,
            offset_bytes=rec.offset_bytes,
            expected_crc32c=rec.crc32c,
            actual_crc32c=actual_crc32c,
        )

    def wait_all(self) -> None:
        """Wait for every submitted transfer; raises the first error after all have finished."""
        with self._lock:
            tickets = list(self._tickets.values())
        first: BaseException | None = None
        for t in tickets:
            try:
                self.wait(t)
            except StoreError as exc:
                first = first or exc
        if first is not None:
            raise first

    def free(self, key: str) -> None:
        """Drop ``key`` and return its extent to the free list.

        Raises:
            KeyError: unknown key.
            ValueError: a transfer of ``key`` is in flight.
        """
        with self._lock:
            self._check_open()
            if key not in self._table.records:
                raise KeyError(key)
            if self._table.busy(key):
                raise ValueError(f"tensor '{key}' has a transfer in flight; wait for it before freeing")
            self._table.drop(key)

    # ------------------------------------------------------------------ streaming (checkpoints)
    def records(self) -> list[ExtentRecord]:
        """A snapshot of every key's record, sorted by key (keys with a write in flight included:
        call :meth:`wait_all` first for a quiet store)."""
        with self._lock:
            return sorted(self._table.records.values(), key=lambda r: r.key)

    def read_extent(self, rec: ExtentRecord, buf: torch.Tensor, pos_bytes: int, nbytes: int) -> None:
        """Read bytes ``[pos_bytes, pos_bytes + nbytes)`` of ``rec``'s extent into the start of
        ``buf`` (4 KiB-aligned ``uint8`` CPU tensor from ``nvme_io.load().aligned_empty``) and wait.
        ``pos_bytes`` is a multiple of :attr:`align_bytes`; no checksum is checked.

        Raises:
            StoreIOError: the read failed or was short (names key and device offset).
        """
        self._transfer("read", rec.key, buf, rec.offset_bytes + pos_bytes, nbytes)

    def reserve(self, key: str, nbytes: int) -> Reservation:
        """Reserve a new extent of ``nbytes`` for a streamed write of ``key`` (a checkpoint import):
        :meth:`write_extent` its pieces, then :meth:`commit`, or :meth:`release` on failure. The
        key's old extent is given back now; until commit or release the key has a write in flight.

        Raises:
            StoreFullError: no free extent is large enough.
            ValueError: the store is closed, or a transfer of ``key`` is in flight.
        """
        with self._lock:
            self._check_open()
            if self._table.busy(key):
                raise ValueError(f"tensor '{key}' has a transfer in flight")
            return self._table.reserve(key, nbytes)

    def write_extent(self, res: Reservation, buf: torch.Tensor, pos_bytes: int, nbytes: int) -> None:
        """Write the first ``nbytes`` of ``buf`` (as for :meth:`read_extent`) at byte ``pos_bytes``
        of a reserved extent and wait. Raises :class:`StoreIOError` as :meth:`read_extent`."""
        self._transfer("write", res.key, buf, res.offset_bytes + pos_bytes, nbytes)

    def commit(self, res: Reservation, *, crc32c: int, dtype: str, shape: tuple[int, ...]) -> ExtentRecord:
        """Make a reserved extent, fully written, the key's tensor and return its new record.
        ``crc32c`` (of the bytes written) is kept when checksums are on or the tensor is empty;
        ``dtype`` is ``str(torch.dtype)``."""
        kept_crc32c = crc32c if self.enable_crc or res.nbytes == 0 else None
        with self._lock:
            return self._table.commit(res, crc32c=kept_crc32c, dtype=dtype, shape=shape)

    def release(self, res: Reservation) -> None:
        """Give back the extent of a failed streamed write. The key's tensor from before
        :meth:`reserve` is gone too: ``reserve`` gave its extent back, so other writes may hold it now
        (keeping the record would let a read return their bytes and a free give the extent twice)."""
        with self._lock:
            self._table.release(res)

    # ------------------------------------------------------------------ persistence
    def flush(self) -> None:
        """Persist the extent table (to the inactive slot, then the header points at it).

        Raises:
            StoreFullError: the compressed table does not fit its slot.
        """
        with self._lock:
            self._check_open()
            data = encode_table(self._table.persistent_json())
            hdr = self.header
            if len(data) > hdr.table_slot_bytes:
                raise StoreFullError(
                    f"extent table of {self.path} needs {len(data)} bytes, the slot holds {hdr.table_slot_bytes}: create the store with a larger table_slot_bytes"
                )
            slot = 1 - hdr.active_slot if hdr.table_length else hdr.active_slot
            new = dataclasses.replace(
                hdr,
                generation=hdr.generation + 1,
                active_slot=slot,
                table_length=len(data),
                table_crc32c=_crc_bytes(data),
            )
        self._write_raw(hdr.slot_offset(slot), data, "<extent table>")
        self._write_raw(0, new.pack(_crc_bytes), "<store header>")
        self.header = new

    def close(self) -> None:
        """Wait for everything in flight, flush the table, close the device. Idempotent."""
        if self._closed:
            return
        try:
            self.wait_all()
            self.flush()
        finally:
            self._closed = True
            self._engine.close()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _write_raw(self, offset: int, data: bytes, what: str) -> None:
        buf = _op.load().aligned_empty(len(data))
        buf.numpy()[:] = memoryview(data)
        self._count("write", len(data))
        check_job(self._engine.wait(self._engine.submit_write(buf, offset)), what, offset, self.path, op="write")

    def _transfer(self, op: str, key: str, buf: torch.Tensor, offset: int, nbytes: int) -> None:
        """One synchronous raw read or write (``op``) of ``nbytes`` at device ``offset``, counted."""
        submit = self._engine.submit_read if op == "read" else self._engine.submit_write
        result = self._engine.wait(submit(buf, offset, nbytes))
        self._count(op, nbytes)
        check_job(result, key, offset, self.path, op=op)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"store {self.path} is closed")

    @staticmethod
    def _check_tensor(t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            raise ValueError(f"tensor must be on the CPU, got {t.device}")
        if not t.is_contiguous():
            raise ValueError("tensor must be contiguous")
