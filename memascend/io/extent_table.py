"""The extent table of a device store in memory: which extent holds each key, and which keys have
a transfer in flight.

:class:`ExtentTable` keeps the key -> :class:`~memascend.io.records.ExtentRecord` map over an
:class:`~memascend.io.extent.ExtentAllocator`: placing a tensor (reusing its extent when the size
matches, else giving it back and allocating anew), dropping a key, reserving an extent for a
streamed write and committing or releasing it. :meth:`ExtentTable.persistent_json` is what
:meth:`~memascend.io.store.TensorStore.flush` writes to the device (:mod:`memascend.io.header`).
Not thread-safe: the store holds its lock around every call.

Source: MemAscend (arXiv 2505.23254), direct NVMe engine; replaces the filesystem's bookkeeping of
DeepSpeed's one swap file per tensor (``{swap_folder}/{id}_param.tensor.swp``).
"""

from __future__ import annotations

from pathlib import Path

from memascend.io.errors import StoreFullError
from memascend.io.extent import Extent, ExtentAllocator
from memascend.io.records import ExtentRecord, Reservation


class ExtentTable:
    """Key -> extent record of one store, over its data region, with the keys in flight.

    Args:
        path: the store's target (named in errors).
        start_bytes, end_bytes, align_bytes: the data region and its alignment
            (:class:`~memascend.io.extent.ExtentAllocator`).
        records: the records read from the device; their extents are marked used.

    Raises:
        ValueError: two records overlap, or one lies outside the data region.
    """

    def __init__(
        self, path: Path, *, start_bytes: int, end_bytes: int, align_bytes: int, records: dict[str, ExtentRecord]
    ) -> None:
        self.path = path
        self.alloc = ExtentAllocator(start_bytes, end_bytes, align_bytes)
        for rec in records.values():
            if rec.alloc_bytes:
                self.alloc.reserve(Extent(rec.offset_bytes, rec.alloc_bytes))
        self.records = records
        self.reads: dict[str, int] = {}
        """Reads in flight per key."""
        self.writes: set[str] = set()
        """Keys with a write (or a reserved streamed write) in flight."""

    def busy(self, key: str) -> bool:
        """A read or a write of ``key`` is in flight."""
        return key in self.writes or bool(self.reads.get(key))

    def place(self, key: str, nbytes: int, *, dtype: str, shape: tuple[int, ...]) -> ExtentRecord:
        """Give ``key`` an extent for a write of ``nbytes`` and mark the write in flight.

        The key's extent is reused when its size matches, else given back (an empty tensor needs
        none). The record's CRC32C is unknown (``None``) until the write finishes, 0 when empty.

        Raises:
            StoreFullError: no free extent is large enough (the table is left unchanged).
        """
        old = self.records.get(key)
        need = self.alloc.aligned_size(nbytes) if nbytes else 0
        if old is not None and old.alloc_bytes == need:
            offset = old.offset_bytes
        elif nbytes:
            offset = self.allocate(key, nbytes, old)
        else:  # an empty tensor needs no extent; give back the old one
            offset = 0
            if old is not None and old.alloc_bytes:
                self.alloc.free(Extent(old.offset_bytes, old.alloc_bytes))
        rec = ExtentRecord(
            key=key,
            offset_bytes=offset,
            nbytes=nbytes,
            alloc_bytes=need,
            crc32c=0 if nbytes == 0 else None,
            dtype=dtype,
            shape=shape,
        )
        self.records[key] = rec
        self.writes.add(key)
        return rec

    def allocate(self, key: str, nbytes: int, old: ExtentRecord | None) -> int:
        """Extent offset for ``nbytes`` under ``key``; gives back ``old`` (the key's record) on
        success. When nothing else is large enough, ``old``'s own extent is tried too.

        Raises:
            StoreFullError: no free extent is large enough (``old`` is kept).
        """
        ext = self.alloc.allocate(nbytes)
        if ext is None and old is not None and old.alloc_bytes:
            self.alloc.free(Extent(old.offset_bytes, old.alloc_bytes))
            self.records.pop(key)
            old_freed = True
            ext = self.alloc.allocate(nbytes)
            if ext is None:
                self.alloc.reserve(Extent(old.offset_bytes, old.alloc_bytes))
                self.records[key] = old
                old_freed = False
        else:
            old_freed = False
        if ext is None:
            raise StoreFullError(
                f"store {self.path} is full: tensor '{key}' needs {self.alloc.aligned_size(nbytes)} bytes, "
                f"{self.alloc.free_bytes} free, largest free extent {self.alloc.largest_free_bytes} bytes"
            )
        if old is not None and old.alloc_bytes and not old_freed:
            self.alloc.free(Extent(old.offset_bytes, old.alloc_bytes))
        return ext.offset_bytes

    def start_read(self, key: str) -> None:
        """Mark a read of ``key`` in flight (reads of one key may overlap)."""
        self.reads[key] = self.reads.get(key, 0) + 1

    def end_transfer(self, key: str, op: str) -> None:
        """A transfer of ``key`` (``op``: ``"read"``/``"write"``) is no longer in flight."""
        if op == "write":
            self.writes.discard(key)
        else:
            self.reads[key] -= 1
            if not self.reads[key]:
                del self.reads[key]

    def drop(self, key: str) -> None:
        """Forget ``key`` (if known) and give back its extent."""
        rec = self.records.pop(key, None)
        self.writes.discard(key)
        if rec is not None and rec.alloc_bytes:
            self.alloc.free(Extent(rec.offset_bytes, rec.alloc_bytes))

    def reserve(self, key: str, nbytes: int) -> Reservation:
        """A new extent of ``nbytes`` for a streamed write of ``key``, marked in flight; the key's
        old extent is given back.

        Raises:
            StoreFullError: no free extent is large enough.
        """
        offset = self.allocate(key, nbytes, self.records.get(key)) if nbytes else 0
        self.writes.add(key)
        return Reservation(key, offset, nbytes)

    def commit(self, res: Reservation, *, crc32c: int | None, dtype: str, shape: tuple[int, ...]) -> ExtentRecord:
        """Make a reserved extent the key's tensor; returns its record."""
        rec = ExtentRecord(
            key=res.key,
            offset_bytes=res.offset_bytes,
            nbytes=res.nbytes,
            alloc_bytes=self.alloc.aligned_size(res.nbytes) if res.nbytes else 0,
            crc32c=crc32c,
            dtype=dtype,
            shape=tuple(shape),
        )
        self.writes.discard(res.key)
        self.records[res.key] = rec
        return rec

    def release(self, res: Reservation) -> None:
        """Give back a reserved extent; the key is forgotten (its old extent was given back by
        :meth:`reserve`, so other writes may hold it now)."""
        self.writes.discard(res.key)
        self.records.pop(res.key, None)
        if res.nbytes:
            self.alloc.free(Extent(res.offset_bytes, self.alloc.aligned_size(res.nbytes)))

    def persistent_json(self) -> dict[str, dict]:
        """``{key: record fields}`` of every key without a write in flight (what a flush stores)."""
        return {k: r.to_json() for k, r in self.records.items() if k not in self.writes}
