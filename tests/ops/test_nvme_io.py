"""Direct I/O engine (csrc/nvme_io) against plain-torch/Python oracles, on preallocated files."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memascend.ops import nvme_io

MiB = 1 << 20


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _crc32c_table() -> list[int]:
    table = []
    for b in range(256):
        c = b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 & -(c & 1))
        table.append(c)
    return table


CRC32C_TABLE = _crc32c_table()


def crc32c_reference_fast(data: bytes, crc: int = 0) -> int:
    """Byte-at-a-time table CRC32C (the same function, ~10x faster in Python) for long inputs."""
    table = CRC32C_TABLE
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = (crc >> 8) ^ table[(crc ^ b) & 0xFF]
    return crc ^ 0xFFFFFFFF


@pytest.fixture(scope="module")
def op():
    return nvme_io.load()


@pytest.fixture()
def store_file(tmp_path):
    path = tmp_path / "dev.bin"
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 32 * MiB)
    return path


def test_crc32c_check_value(op):
    assert op.crc32c_bytes(b"123456789") == 0xE3069283
    assert op.crc32c_bytes(b"") == 0


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=0, max_size=3000), split=st.integers(0, 3000), shift=st.integers(0, 7))
def test_crc32c_matches_reference(op, data, split, shift):
    expected = crc32c_reference(data)
    assert op.crc32c_bytes(data) == expected
    split = min(split, len(data))
    assert op.crc32c_bytes(data[split:], op.crc32c_bytes(data[:split])) == expected
    # tensor path at an unaligned start address
    t = torch.tensor(list(b"\0" * shift + data) or [0], dtype=torch.uint8)[shift : shift + len(data)]
    assert op.crc32c(t) == expected


@pytest.mark.parametrize(
    "nbytes",
    # Around the thresholds of the three-chain hardware path: 3 x 256 and 3 x 8192 bytes.
    [
        767,
        768,
        769,
        3 * 256 + 7,
        3 * 8192 - 1,
        3 * 8192,
        3 * 8192 + 8,
        3 * 8192 + 3 * 256 + 5,
        2 * 3 * 8192 + 13,
        100_003,
    ],
)
@pytest.mark.parametrize("shift", [0, 5])
def test_crc32c_long_inputs_match_reference(op, nbytes, shift):
    base = op.aligned_empty(nbytes + shift)
    base.random_(0, 256, generator=torch.Generator().manual_seed(nbytes))
    t = base[shift:]  # an unaligned start address when shift > 0
    data = t.numpy().tobytes()
    assert op.crc32c(t) == crc32c_reference_fast(data) == op.crc32c_bytes(data)
    assert crc32c_reference_fast(data[:999]) == crc32c_reference(data[:999])


def test_crc32c_continues_across_any_split(op):
    t = op.aligned_empty(5 * MiB + 123)
    t.random_(0, 256, generator=torch.Generator().manual_seed(7))
    whole = op.crc32c(t)
    for cut in (1, 7, 767, 4096, 3 * 8192 + 1, 1 * MiB + 3, 5 * MiB + 122):
        assert op.crc32c(t[cut:], -1, op.crc32c(t, cut)) == whole, cut
    assert op.crc32c_bytes(t.numpy().tobytes()) == whole


def test_aligned_empty_is_aligned(op):
    for n in (0, 1, 4095, 4096, 3 * MiB + 5):
        t = op.aligned_empty(n)
        assert t.numel() == n and t.dtype == torch.uint8
        assert t.data_ptr() % 4096 == 0


@settings(max_examples=40, deadline=None)
@given(
    nbytes=st.one_of(st.integers(0, 9000), st.integers(9000, 3 * MiB)),
    block=st.integers(0, 1000),
    shift=st.sampled_from([0, 0, 4, 64, 4096 + 8]),
    qd=st.sampled_from([1, 2, 8, 32]),
    request_bytes=st.sampled_from([4096, 64 << 10, 1 * MiB]),
    backend=st.sampled_from(["io_uring", "libaio"]),
)
def test_write_read_round_trip(op, tmp_path_factory, nbytes, block, shift, qd, request_bytes, backend):
    path = tmp_path_factory.mktemp("rt") / "dev.bin"
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 8 * MiB)
    e = op.Engine(str(path), queue_depth=qd, request_bytes=request_bytes, backend=backend)
    assert e.backend == backend
    try:
        offset = block * 4096
        if offset + nbytes > e.size_bytes - 4096:
            offset = 0
        src_base = op.aligned_empty(nbytes + shift)
        src = src_base[shift:]
        src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        r = e.wait(e.submit_write(src, offset, -1, True))
        assert (r.error, r.short_transfer, r.bytes_done, r.has_crc) == (0, False, nbytes, True)
        assert (
            r.crc32c == crc32c_reference(src.numpy().tobytes())
            if nbytes < 10000
            else r.crc32c == op.crc32c(src)
        )
        out = torch.full((nbytes + 3,), 7, dtype=torch.uint8)[3:]
        r2 = e.wait(e.submit_read(out, offset, -1, True))
        assert r2.error == 0 and r2.bytes_done == nbytes and r2.crc32c == r.crc32c
        assert torch.equal(out, src)
        with open(path, "rb") as f:  # the device really holds the bytes (and zero padding)
            f.seek(offset)
            pad = -nbytes % 4096
            raw = f.read(nbytes + pad)
        assert raw[:nbytes] == src.numpy().tobytes() and raw[nbytes:] == b"\0" * pad
    finally:
        e.close()


@pytest.mark.parametrize("backend", ["io_uring", "libaio"])
def test_many_jobs_in_flight_from_threads(op, store_file, backend):
    e = op.Engine(str(store_file), queue_depth=8, request_bytes=64 << 10, backend=backend)
    tensors = [torch.randn(50_000 + 997 * i) for i in range(24)]
    slot = 512 << 10
    errors = []

    def worker(ids):
        try:
            jobs = [(i, e.submit_write(tensors[i], i * slot, -1, i % 2 == 0)) for i in ids]
            for i, j in jobs:
                r = e.wait(j)
                assert r.error == 0
                assert r.has_crc == (i % 2 == 0) and (not r.has_crc or r.crc32c == op.crc32c(tensors[i]))
            outs = {i: torch.empty_like(tensors[i]) for i in ids}
            jobs = [(i, e.submit_read(outs[i], i * slot, -1, True)) for i in ids]
            assert e.outstanding() >= 1
            for i, j in jobs:
                r = e.wait(j)
                assert r.bytes_done == tensors[i].nbytes
                assert torch.equal(outs[i], tensors[i])
                assert r.has_crc and r.crc32c == op.crc32c(tensors[i])
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(range(k, 24, 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert e.outstanding() == 0
    e.close()


@pytest.mark.parametrize("backend", ["io_uring", "libaio"])
def test_completion_does_not_wait_for_the_submitting_thread(op, store_file, backend):
    """A swapper thread submits and goes back to computing (no system call for a while); a job it
    submitted must still complete and wake another thread's wait. With io_uring, a completion is
    posted by task work of the submitting thread: a ring set up so that only that thread's next
    io_uring_enter runs it (DEFER_TASKRUN) would hold the job until the computation ends."""
    e = op.Engine(str(store_file), queue_depth=8, request_bytes=1 * MiB, backend=backend)
    buf = op.aligned_empty(8 * MiB)
    buf.random_(0, 256)
    jobs: list[int] = []
    submitted = threading.Event()
    spin_s = 2.0

    def submit_then_compute():
        jobs.extend(e.submit_write(buf[k * MiB : (k + 1) * MiB], k * MiB) for k in range(8))
        submitted.set()
        t_end = time.perf_counter() + spin_s
        while time.perf_counter() < t_end:  # pure Python: no system call of this thread's own
            pass

    t = threading.Thread(target=submit_then_compute)
    t0 = time.perf_counter()
    t.start()
    assert submitted.wait(10)
    # wait() releases the GIL while it blocks; its return needs the GIL back (a switch interval).
    results = [e.wait(j) for j in jobs]
    waited_s = time.perf_counter() - t0
    t.join()
    assert all(r.error == 0 and r.bytes_done == MiB for r in results)
    assert waited_s < spin_s / 2, f"the writes completed only after {waited_s:.2f} s"
    e.close()


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split("-")[0].split(".")
    return (int(release[0]), int(release[1])) >= (major, minor)


@pytest.mark.parametrize("backend", ["io_uring", "libaio"])
def test_worker_is_the_rings_single_issuer_and_wakes_for_new_work(op, store_file, backend):
    """On Linux 6.1+ the io_uring ring is set up SINGLE_ISSUER | DEFER_TASKRUN (the worker thread
    submits everything); submit() from other threads, made while the worker sleeps in
    io_uring_enter with nothing in flight, must wake it (the eventfd kick) every time."""
    e = op.Engine(str(store_file), queue_depth=4, request_bytes=64 << 10, backend=backend)
    assert e.single_issuer == (backend == "io_uring" and _kernel_at_least(6, 1))
    buf = op.aligned_empty(256 << 10)
    buf.random_(0, 256)
    back = op.aligned_empty(256 << 10)
    for k in range(5):
        time.sleep(0.05)  # the worker is idle, asleep, when the next job arrives
        results: list = []
        offset = k * (256 << 10)
        t = threading.Thread(target=lambda out=results, off=offset: out.append(e.wait(e.submit_write(buf, off))))
        t.start()
        t.join(10)
        assert not t.is_alive(), f"job {k} submitted to an idle worker never completed"
        assert results[0].error == 0
        assert e.wait(e.submit_read(back, offset)).bytes_done == 256 << 10
        assert torch.equal(back, buf)
    e.close()


def test_aligned_memory_needs_no_bounce(op, store_file):
    e = op.Engine(str(store_file), queue_depth=4, request_bytes=1 * MiB)
    buf = op.aligned_empty(4 * MiB)
    assert e.wait(e.submit_write(buf, 0)).error == 0
    assert e.bounce_bytes_allocated == 0
    unaligned = torch.empty(4 * MiB + 1, dtype=torch.uint8)[1:]
    assert e.wait(e.submit_write(unaligned, 0)).error == 0
    assert 0 < e.bounce_bytes_allocated <= 4 * MiB
    e.close()


def test_rejects_misaligned_and_out_of_range(op, store_file):
    e = op.Engine(str(store_file))
    t = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not a multiple"):
        e.submit_write(t, 100)
    with pytest.raises(ValueError, match="beyond the end"):
        e.submit_read(t, 32 * MiB)
    with pytest.raises(ValueError, match="beyond the end"):
        e.submit_write(torch.zeros(4097, dtype=torch.uint8), 32 * MiB - 4096)
    with pytest.raises(IndexError):
        e.wait(12345)
    e.close()
    with pytest.raises(RuntimeError, match="closed"):
        e.submit_write(t, 0)


@pytest.mark.parametrize("backend", ["io_uring", "libaio"])
def test_short_read_past_end_of_file(op, tmp_path, backend):
    path = tmp_path / "dev.bin"
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 1 * MiB)
    e = op.Engine(str(path), request_bytes=64 << 10, backend=backend)
    os.truncate(path, 256 << 10)  # the file shrinks under the engine: reads past it return 0 bytes
    r = e.wait(e.submit_read(op.aligned_empty(512 << 10), 0))
    assert r.short_transfer and r.error_offset == 256 << 10 and r.bytes_done == 256 << 10
    # With a checksum asked for: the completed leading requests are checksummed, then dropped.
    r = e.wait(e.submit_read(op.aligned_empty(512 << 10), 0, -1, True))
    assert r.short_transfer and (r.has_crc, r.crc32c) == (False, 0)
    e.close()


@pytest.mark.parametrize("backend", ["io_uring", "libaio"])
def test_checksums_of_jobs_split_into_many_requests(op, store_file, backend):
    """A job of many requests, completing out of order: the read's checksum, computed over leading
    runs of completed requests while the rest are in flight, equals the whole buffer's; so does the
    write's, computed while its requests are in flight."""
    e = op.Engine(str(store_file), queue_depth=16, request_bytes=64 << 10, backend=backend)
    try:
        for nbytes, shift in ((8 * MiB, 0), (8 * MiB - 5, 0), (3 * MiB + 1, 3)):
            src = op.aligned_empty(nbytes + shift)[shift:]
            src.random_(0, 256)
            expected = op.crc32c(src)
            w = e.wait(e.submit_write(src, 4096, -1, True))
            assert (w.error, w.has_crc, w.crc32c) == (0, True, expected)
            out = op.aligned_empty(nbytes + shift)[shift:]
            jobs = [e.submit_read(out, 4096, -1, True) for _ in range(3)]
            assert e.outstanding() == 3
            for j in jobs:
                r = e.wait(j)
                assert (r.error, r.bytes_done, r.has_crc, r.crc32c) == (0, nbytes, True, expected)
            assert torch.equal(out, src)
            with pytest.raises(IndexError):
                e.wait(jobs[0])
    finally:
        e.close()


def test_open_errors(op, tmp_path):
    with pytest.raises(FileNotFoundError):
        op.Engine(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="neither a block device nor a regular file"):
        op.Engine(str(tmp_path))
    (tmp_path / "f").touch()
    with pytest.raises(ValueError, match="backend must be"):
        op.Engine(str(tmp_path / "f"), backend="spdk")
    with pytest.raises(ValueError, match="queue_depth"):
        op.Engine(str(tmp_path / "missing"), queue_depth=0)
