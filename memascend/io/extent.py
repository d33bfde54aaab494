"""Extent allocator of the device store: maps a tensor's bytes to one aligned (offset, length).

Best fit over a free list kept sorted by offset; freeing merges with both neighbours, so the free
list never holds two adjacent extents. Every offset and length is a multiple of ``align_bytes``
(max(logical block size, 4096) for O_DIRECT). Not thread-safe: the store serialises calls.

Source: MemAscend (arXiv 2505.23254), direct NVMe engine; replaces DeepSpeed's one file per
tensor (``{swap_folder}/{id}_param.tensor.swp``), where the filesystem did the allocating.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class Extent:
    """A byte range on the device: ``[offset_bytes, offset_bytes + length_bytes)``."""

    offset_bytes: int
    length_bytes: int

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.length_bytes


class ExtentAllocator:
    """Best-fit allocator over ``[start_bytes, end_bytes)`` with a coalescing free list.

    Args:
        start_bytes: first allocatable byte (rounded up to ``align_bytes``).
        end_bytes: end of the region (rounded down to ``align_bytes``).
        align_bytes: granule of offsets and lengths; a power of two.

    Raises:
        ValueError: ``align_bytes`` is not a power of two.
    """

    def __init__(self, start_bytes: int, end_bytes: int, align_bytes: int) -> None:
        if align_bytes <= 0 or align_bytes & (align_bytes - 1):
            raise ValueError(f"align_bytes must be a power of two, got {align_bytes}")
        self.align_bytes = align_bytes
        self.start_bytes = -(-start_bytes // align_bytes) * align_bytes
        self.end_bytes = max(self.start_bytes, end_bytes // align_bytes * align_bytes)
        self._starts: list[int] = []  # sorted offsets of free extents
        self._length: dict[int, int] = {}  # free extent offset -> length
        if self.end_bytes > self.start_bytes:
            self._insert(self.start_bytes, self.end_bytes - self.start_bytes)
        self.free_bytes = self.end_bytes - self.start_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.end_bytes - self.start_bytes

    @property
    def used_bytes(self) -> int:
        return self.capacity_bytes - self.free_bytes

    @property
    def largest_free_bytes(self) -> int:
        return max(self._length.values(), default=0)

    def aligned_size(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the granule (at least one granule)."""
        return max(1, -(-nbytes // self.align_bytes)) * self.align_bytes

    def free_extents(self) -> list[Extent]:
        """The free list, sorted by offset."""
        return [Extent(s, self._length[s]) for s in self._starts]

    def allocate(self, nbytes: int) -> Extent | None:
        """Best-fit extent of ``aligned_size(nbytes)`` bytes, or ``None`` when none is large enough.

        Ties go to the lowest offset. The extent is carved from the start of the chosen free one.

        Raises:
            ValueError: ``nbytes`` < 0.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        need = self.aligned_size(nbytes)
        best = None
        for s in self._starts:
            n = self._length[s]
            if n >= need and (best is None or n < self._length[best]):
                best = s
                if n == need:
                    break
        if best is None:
            return None
        n = self._remove(best)
        if n > need:
            self._insert(best + need, n - need)
        self.free_bytes -= need
        return Extent(best, need)

    def reserve(self, extent: Extent) -> None:
        """Mark an exact extent as used (rebuilding the allocator from a stored table).

        Raises:
            ValueError: misaligned, outside the region, or not entirely free.
        """
        self._check(extent)
        i = bisect.bisect_right(self._starts, extent.offset_bytes) - 1
        if i < 0:
            raise ValueError(f"extent {extent} is not free")
        s = self._starts[i]
        n = self._length[s]
        if extent.end_bytes > s + n:
            raise ValueError(f"extent {extent} is not free")
        self._remove(s)
        if extent.offset_bytes > s:
            self._insert(s, extent.offset_bytes - s)
        if s + n > extent.end_bytes:
            self._insert(extent.end_bytes, s + n - extent.end_bytes)
        self.free_bytes -= extent.length_bytes

    def free(self, extent: Extent) -> None:
        """Return an extent, merging it with free neighbours.

        Raises:
            ValueError: misaligned, outside the region, or overlapping free space (double free).
        """
        self._check(extent)
        off, n = extent.offset_bytes, extent.length_bytes
        i = bisect.bisect_left(self._starts, off)
        if i > 0:
            ps = self._starts[i - 1]
            if ps + self._length[ps] > off:
                raise ValueError(f"extent {extent} overlaps free space (double free?)")
        if i < len(self._starts) and self._starts[i] < off + n:
            raise ValueError(f"extent {extent} overlaps free space (double free?)")
        self.free_bytes += n
        if i < len(self._starts) and self._starts[i] == off + n:
            n += self._remove(self._starts[i])
        if i > 0:
            ps = self._starts[i - 1]
            if ps + self._length[ps] == off:
                off, n = ps, n + self._remove(ps)
        self._insert(off, n)

    def _check(self, extent: Extent) -> None:
        a = self.align_bytes
        if extent.offset_bytes % a or extent.length_bytes % a or extent.length_bytes <= 0:
            raise ValueError(f"extent {extent} is not aligned to {a} bytes")
        if extent.offset_bytes < self.start_bytes or extent.end_bytes > self.end_bytes:
            raise ValueError(f"extent {extent} lies outside [{self.start_bytes}, {self.end_bytes})")

    def _insert(self, off: int, n: int) -> None:
        bisect.insort(self._starts, off)
        self._length[off] = n

    def _remove(self, off: int) -> int:
        del self._starts[bisect.bisect_left(self._starts, off)]
        return self._length.pop(off)
