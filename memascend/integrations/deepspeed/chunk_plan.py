"""Where the chunks of a chunked optimizer step start and stop, and what each one reads and writes.

Pure arithmetic on element offsets (no DeepSpeed, no I/O), used by
:mod:`~memascend.integrations.deepspeed.chunked_step`. A swapped optimizer sub-group is one flat
fp32 partition of ``numel`` elements, stored as one file (or raw-store key) per tensor (master
weights, ``exp_avg``, ``exp_avg_sq``) of ``io_aligned(numel)`` elements, plus its gradient as
*fragments* (one file per parameter partition, or part of one, at an element offset of the flat
partition; DeepSpeed 0.19.8 ``OptimizerStateSwapInfo.swapped_gradients``). A chunk is the element
range ``[start, stop)`` of the flat partition; chunk boundaries are multiples of
:data:`CHUNK_ALIGN_NUMEL` so that

* every chunk's byte offset in the state files is direct-I/O aligned (4 KiB of fp32), and
* ``DeepSpeedCPUAdam``'s vectorised loop covers exactly the elements it covers when the whole
  sub-group is stepped at once (its SIMD spans are at most 128 fp32 elements, counted from the
  tensor's start): only the sub-group's last ``numel % 128`` elements take the scalar tail, in the
  last chunk as in the whole sub-group. Adam is elementwise, so every element is updated with the
  same instructions on the same inputs: the result is bit-identical.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

CHUNK_ALIGN_NUMEL = 1024
"""Chunk boundaries are multiples of this many elements: 4 KiB of fp32 (the largest direct-I/O
alignment of a swap device) and a multiple of every ``DeepSpeedCPUAdam`` SIMD span (<= 128)."""

GRAD_BOUNCE_NUMEL = 1 << 20
"""fp32 elements of the bounce slab gradient pieces are read through (4 MiB): a fragment starts at
its parameter's offset of the sub-group, so a chunk's part of it rarely starts on a direct-I/O
boundary of the fragment file; it is read in aligned rounds of at most this size and copied."""


GRAD_READ_AHEAD_SLACK_NUMEL = 16 * CHUNK_ALIGN_NUMEL
"""fp32 elements a read-ahead gradient slab holds beyond its chunk (64 KiB): a piece's aligned reads
cover at most ``2 * CHUNK_ALIGN_NUMEL`` elements more than the piece, so the whole gradient of a
chunk made of up to 8 fragment pieces is read ahead; the rest of a chunk of more pieces is read
through the slab when the chunk is stepped."""


def grad_slab_numel(chunk_numel: int, read_ahead: bool) -> int:
    """fp32 elements of one gradient slab (what a chunk's gradient fragments are read into before
    they are copied to the chunk's gradient): a chunk plus slack with read-ahead, else the bounce
    slab (:data:`GRAD_BOUNCE_NUMEL`, at most a chunk, plus two alignments)."""
    if read_ahead:
        return int(chunk_numel) + GRAD_READ_AHEAD_SLACK_NUMEL
    return min(GRAD_BOUNCE_NUMEL, int(chunk_numel)) + 2 * CHUNK_ALIGN_NUMEL


def buffer_sets(read_ahead: bool) -> int:
    """Chunk buffer sets of the chunked step: two with read-ahead (one stepped, one being read or
    written), else one."""
    return 2 if read_ahead else 1


def chunk_buffers_numel(chunk_numel: int, read_ahead: bool) -> int:
    """fp32 elements of the chunked step's locked buffers for chunks of ``chunk_numel`` elements:
    per buffer set (:func:`buffer_sets`) the master weights, two moments and a gradient slab
    (:func:`grad_slab_numel`), plus one chunk gradient that Adam reads (shared by the sets)."""
    per_set = 3 * int(chunk_numel) + grad_slab_numel(chunk_numel, read_ahead)
    return buffer_sets(read_ahead) * per_set + int(chunk_numel)


def window_numel(largest_sub_group_numel: int, chunk_numel: int) -> int:
    """Elements of the chunk-sized swap window (:mod:`.chunked_swap_out`): the chunk, or the largest
    sub-group rounded up to :data:`CHUNK_ALIGN_NUMEL` where that is smaller."""
    return min(int(chunk_numel), align_up(int(largest_sub_group_numel), CHUNK_ALIGN_NUMEL))


def align_up(numel: int, align: int) -> int:
    """``numel`` rounded up to a multiple of ``align`` (elements)."""
    return -(-int(numel) // align) * align


def align_down(numel: int, align: int) -> int:
    """``numel`` rounded down to a multiple of ``align`` (elements)."""
    return (int(numel) // align) * align


def chunk_bounds(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """The chunks ``[(start, stop), ...]`` of a flat partition of ``numel`` elements.

    Every chunk but the last has ``chunk_numel`` elements; the chunks tile ``[0, numel)`` in order.

    Raises:
        ValueError: ``chunk_numel`` is not a positive multiple of :data:`CHUNK_ALIGN_NUMEL`.
    """
    if chunk_numel < CHUNK_ALIGN_NUMEL or chunk_numel % CHUNK_ALIGN_NUMEL:
        raise ValueError(f"chunk_numel must be a positive multiple of {CHUNK_ALIGN_NUMEL}, got {chunk_numel}")
    return [(start, min(start + chunk_numel, numel)) for start in range(0, max(0, numel), chunk_numel)]


def chunk_io_numel(start: int, stop: int, numel: int, io_align_numel: int) -> int:
    """Elements a chunk reads and writes in a state file of ``align_up(numel, io_align_numel)``
    elements: its own, and for the last chunk the file's padding too (so the writes tile the file)."""
    return (align_up(numel, io_align_numel) if stop >= numel else stop) - start


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of one source (gradient fragment, parameter partition) that falls in a chunk.

    Attributes:
        index: which source (position in the list given to :func:`pieces_in_chunk`).
        src_start: first element of the piece, counted from the source's start.
        src_stop: one past its last element.
        dest_start: where the piece starts in the chunk (element offset from the chunk's start).
    """

    index: int
    src_start: int
    src_stop: int
    dest_start: int

    @property
    def numel(self) -> int:
        """Elements of the piece."""
        return self.src_stop - self.src_start


def pieces_in_chunk(sources: Sequence[tuple[int, int]], start: int, stop: int) -> list[Piece]:
    """The parts of ``sources`` (``(offset, numel)`` in the flat partition) inside ``[start, stop)``.

    Returns:
        One :class:`Piece` per overlapping source, in the order of ``sources``.
    """
    pieces = []
    for index, (offset, numel) in enumerate(sources):
        lo, hi = max(start, offset), min(stop, offset + numel)
        if lo < hi:
            pieces.append(Piece(index, lo - offset, hi - offset, lo - start))
    return pieces


def aligned_reads(src_start: int, src_stop: int, file_numel: int, align_numel: int,
                  max_numel: int) -> list[tuple[int, int]]:
    """Split the read of elements ``[src_start, src_stop)`` of a file of ``file_numel`` elements into
    direct-I/O-aligned reads ``[(read_start, read_stop), ...]``.

    Each read starts on a multiple of ``align_numel``, ends on one or at the file's end, holds at
    most ``max_numel`` elements, and together they cover the range (a read may start before
    ``src_start`` or end after ``src_stop``: the caller copies only the wanted part).

    Raises:
        ValueError: ``max_numel`` below ``2 * align_numel`` or the range outside the file.
    """
    if max_numel < 2 * align_numel:
        raise ValueError(f"max_numel {max_numel} must be at least twice the alignment {align_numel}")
    if not 0 <= src_start <= src_stop <= file_numel:
        raise ValueError(f"range [{src_start}, {src_stop}) lies outside a file of {file_numel} elements")
    reads = []
    pos = align_down(src_start, align_numel)
    step = align_down(max_numel, align_numel)
    while pos < src_stop:
        end = min(pos + step, align_up(src_stop, align_numel), file_numel)
        reads.append((pos, end))
        pos = end
    return reads


def param_writes(src_start: int, src_stop: int, numel: int, file_numel: int, align_numel: int) -> tuple[int, int]:
    """The aligned part ``[write_start, write_stop)`` of a parameter partition that can be written
    once its elements up to ``src_stop`` are known (written in order from 0).

    ``write_start`` is ``src_start`` rounded down (the elements before it were written by the
    previous piece, those from it on are carried over); ``write_stop`` is ``src_stop`` rounded down,
    or the file's end (``file_numel``, the partition's ``numel`` padded for I/O) when the piece
    reaches the partition's end.
    """
    write_start = align_down(src_start, align_numel)
    write_stop = file_numel if src_stop >= numel else align_down(src_stop, align_numel)
    return write_start, max(write_start, write_stop)


def plan_summary(numels: Iterable[int], chunk_numel: int) -> dict[str, int]:
    """How many chunks the sub-groups of ``numels`` elements take, and the largest chunk (elements)."""
    counts = [len(chunk_bounds(int(n), chunk_numel)) for n in numels]
    largest = max((min(int(n), chunk_numel) for n in numels), default=0)
    return {"sub_groups": len(counts), "chunks": sum(counts), "largest_chunk_numel": largest}


@dataclasses.dataclass(frozen=True)
class SlabRead:
    """One direct-I/O read of a gradient fragment into a gradient slab, and what of it to copy.

    Attributes:
        index: which fragment (position in the sources given to :func:`pieces_in_chunk`).
        read_start: first element of the fragment file read (aligned).
        read_stop: one past the last element read (aligned, or the file's end).
        slab_start: where the read lands in the slab (elements, aligned).
        copy_start: first element of the fragment wanted (inside the read).
        copy_stop: one past the last element wanted.
        dest_start: where ``copy_start`` goes in the chunk's gradient.
    """

    index: int
    read_start: int
    read_stop: int
    slab_start: int
    copy_start: int
    copy_stop: int
    dest_start: int


def slab_rounds(pieces: Sequence[Piece], file_numels: Sequence[int], align_numel: int,
                slab_numel: int) -> list[list[SlabRead]]:
    """Pack the aligned reads of a chunk's gradient pieces into rounds that each fit a slab of
    ``slab_numel`` elements (every read starts on an ``align_numel`` boundary of the slab).

    Args:
        pieces: the chunk's pieces of the fragments (:func:`pieces_in_chunk`).
        file_numels: elements of each fragment's file (by ``Piece.index``).

    Returns:
        The rounds in order; the reads of a round are all in the slab at once. Empty for no pieces.

    Raises:
        ValueError: ``slab_numel`` below ``2 * align_numel`` (as :func:`aligned_reads`).
    """
    rounds: list[list[SlabRead]] = []
    current: list[SlabRead] = []
    pos = 0
    for piece in pieces:
        for lo, hi in aligned_reads(piece.src_start, piece.src_stop, file_numels[piece.index], align_numel,
                                    slab_numel):
            if current and pos + (hi - lo) > slab_numel:
                rounds.append(current)
                current, pos = [], 0
            a, b = max(lo, piece.src_start), min(hi, piece.src_stop)
            current.append(SlabRead(piece.index, lo, hi, pos, a, b, piece.dest_start + a - piece.src_start))
            pos = align_up(pos + hi - lo, align_numel)
    if current:
        rounds.append(current)
    return rounds
