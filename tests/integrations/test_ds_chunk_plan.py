"""Chunk planning of the chunked optimizer step (memascend.integrations.deepspeed.chunk_plan): pure
arithmetic, checked against brute-force element sets."""

from __future__ import annotations

import pytest

from memascend.config.settings import MemAscendSettings
from memascend.config.sizing import AUTO_CHUNK_NUMEL, resolve_chunk_numel
from memascend.errors import UserError
from memascend.integrations.deepspeed import chunk_plan

A = chunk_plan.CHUNK_ALIGN_NUMEL


@pytest.mark.parametrize("numel", [1, A - 1, A, 3 * A + 17, 10 * A])
@pytest.mark.parametrize("chunk", [A, 4 * A])
def test_chunks_tile_the_partition_on_aligned_boundaries(numel, chunk):
    bounds = chunk_plan.chunk_bounds(numel, chunk)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))
    assert all(start % A == 0 and 0 < stop - start <= chunk for start, stop in bounds)
    # Only the last chunk may be short, so the scalar tail of a SIMD loop is the whole sub-group's.
    assert all(stop - start == chunk for start, stop in bounds[:-1])


def test_chunk_numel_must_be_aligned():
    with pytest.raises(ValueError):
        chunk_plan.chunk_bounds(10 * A, A + 1)
    with pytest.raises(ValueError):
        chunk_plan.chunk_bounds(10 * A, 0)


def test_last_chunk_io_reaches_the_padded_file_end():
    numel, io_align = 5 * A + 100, 256
    bounds = chunk_plan.chunk_bounds(numel, 2 * A)
    io = [chunk_plan.chunk_io_numel(s, e, numel, io_align) for s, e in bounds]
    assert io[:-1] == [2 * A, 2 * A]
    assert bounds[-1][0] + io[-1] == chunk_plan.align_up(numel, io_align)
    assert io[-1] <= 2 * A  # the chunk buffers hold it


def test_pieces_in_chunk_cover_exactly_the_overlap():
    sources = [(0, 300), (300, 5000), (5300, 7), (5307, 2000)]
    start, stop = 1024, 5500
    pieces = chunk_plan.pieces_in_chunk(sources, start, stop)
    covered = set()
    for p in pieces:
        off = sources[p.index][0]
        elems = set(range(off + p.src_start, off + p.src_stop))
        assert elems == {start + p.dest_start + k for k in range(p.numel)}
        covered |= elems
    assert covered == set(range(start, stop))
    assert [p.index for p in pieces] == [1, 2, 3]


@pytest.mark.parametrize("src", [(0, 10), (5, 4000), (1000, 1030), (3000, 4100), (4090, 4100)])
def test_aligned_reads_cover_the_range_inside_the_file(src):
    file_numel, align = 4100, 1024
    reads = chunk_plan.aligned_reads(*src, file_numel, align, max_numel=2 * align)
    assert all(lo % align == 0 and (hi % align == 0 or hi == file_numel) for lo, hi in reads)
    assert all(0 < hi - lo <= 2 * align and hi <= file_numel for lo, hi in reads)
    covered = set().union(*(range(lo, hi) for lo, hi in reads))
    assert set(range(*src)) <= covered
    assert all(b[1] == c[0] for b, c in zip(reads, reads[1:]))


def test_aligned_reads_refuse_a_range_outside_the_file():
    with pytest.raises(ValueError):
        chunk_plan.aligned_reads(0, 5000, 4096, 1024, 4096)


def test_param_writes_in_order_write_every_element_once():
    numel, align = 10_000, 2048
    file_numel = chunk_plan.align_up(numel, 512)
    cuts = [0, 1500, 4096, 4097, 9000, numel]
    written, carried_from = [], 0
    for lo_src, hi_src in zip(cuts, cuts[1:]):
        lo, hi = chunk_plan.param_writes(lo_src, hi_src, numel, file_numel, align)
        assert lo == carried_from  # the carry starts where the last write stopped
        assert lo % align == 0 and (hi % align == 0 or hi == file_numel)
        if hi > lo:
            written.append((lo, hi))
            carried_from = hi
    assert written[0][0] == 0 and written[-1][1] == file_numel
    assert all(b[1] == c[0] for b, c in zip(written, written[1:]))


def test_resolve_and_summary():
    assert resolve_chunk_numel("auto") == AUTO_CHUNK_NUMEL
    assert resolve_chunk_numel(None) is None
    assert resolve_chunk_numel(4 * A) == 4 * A
    summary = chunk_plan.plan_summary([10 * A, A // 2], 4 * A)
    assert summary == {"sub_groups": 2, "chunks": 4, "largest_chunk_numel": 4 * A}


@pytest.mark.parametrize("bad", [0, 1000, A + 1, True, "big"])
def test_setting_refuses_unaligned_chunks(bad):
    with pytest.raises(UserError, match="optimizer_chunk_numel"):
        MemAscendSettings(optimizer_chunk_numel=bad)


def test_setting_defaults_and_section():
    assert MemAscendSettings().optimizer_chunk_numel == "auto"
    assert MemAscendSettings.baseline().optimizer_chunk_numel is None
    section = {"memascend": {"optimizer_chunk_numel": 8 * A}}
    assert MemAscendSettings.from_ds_config(section).optimizer_chunk_numel == 8 * A


@pytest.mark.parametrize("slab", [2 * A, 3 * A + 5, 40 * A])
def test_slab_rounds_fit_the_slab_and_cover_every_piece(slab):
    sources = [(0, 300), (300, 5000), (5300, 7), (5307, 2000), (7307, 9000)]
    file_numels = [chunk_plan.align_up(n, 256) for _, n in sources]
    start, stop = 1024, 12 * A
    pieces = chunk_plan.pieces_in_chunk(sources, start, stop)
    rounds = chunk_plan.slab_rounds(pieces, file_numels, A, slab)
    covered = []
    for reads in rounds:
        taken = []
        for r in reads:
            assert r.read_start % A == 0 and r.slab_start % A == 0
            assert r.read_stop % A == 0 or r.read_stop == file_numels[r.index]
            assert r.read_start <= r.copy_start < r.copy_stop <= r.read_stop <= file_numels[r.index]
            assert r.slab_start + r.read_stop - r.read_start <= slab
            taken.append((r.slab_start, r.slab_start + r.read_stop - r.read_start))
            off = sources[r.index][0]
            covered += [(off + e, start + r.dest_start + e - r.copy_start) for e in range(r.copy_start, r.copy_stop)]
        taken.sort()
        assert all(a[1] <= b[0] for a, b in zip(taken, taken[1:]))  # no two reads of a round share the slab
    assert all(src == dst for src, dst in covered)
    assert sorted(src for src, _ in covered) == list(range(start, stop))
    assert (len(rounds) > 1) == (slab < 12 * A)


def test_chunk_buffers_numel_adds_one_set_for_read_ahead():
    chunk = 8 * A
    serial = chunk_plan.chunk_buffers_numel(chunk, read_ahead=False)
    ahead = chunk_plan.chunk_buffers_numel(chunk, read_ahead=True)
    assert serial == 4 * chunk + chunk_plan.grad_slab_numel(chunk, False)  # as before read-ahead
    assert ahead == 2 * (3 * chunk + chunk + chunk_plan.GRAD_READ_AHEAD_SLACK_NUMEL) + chunk
