"""Ranged I/O of the chunked optimizer step (memascend.integrations.deepspeed.chunk_io) and the step's
read-ahead / write-behind pipeline (chunked_step.ChunkedSubGroups.step) on small in-memory
sub-groups: an aio-like target whose transfers happen only at ``wait`` (so a buffer used before its
read was waited for, or changed before its write was, gives wrong results) and memascend's raw store.
Read-ahead and the serial path write the same files as a reference computation."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from memascend.config.settings import MemAscendSettings
from memascend.integrations.deepspeed import chunk_io, chunk_plan, chunked_step

A = chunk_plan.CHUNK_ALIGN_NUMEL
MiB = 1 << 20


class FakeAioHandle:
    """``async_pread``/``async_pwrite``/``wait`` of DeepSpeed's aio handle: ``wait`` completes every
    outstanding operation and returns their count (``count_bias`` makes it lie)."""

    def __init__(self, count_bias: int = 0) -> None:
        self.ops: list[tuple[str, int]] = []
        self.waits = 0
        self.pending = 0
        self.count_bias = count_bias

    def async_pread(self, buffer, path, offset):
        self.ops.append(("read", offset))
        self.pending += 1
        return 0

    def async_pwrite(self, buffer, path, offset):
        self.ops.append(("write", offset))
        self.pending += 1
        return 0

    def wait(self):
        assert self.pending > 0  # deepspeed_io_handle_t::_wait_locked asserts it
        self.waits += 1
        done, self.pending = self.pending, 0
        return done + self.count_bias


def test_aio_range_io_counts_what_it_submitted_and_waits_once():
    handle = FakeAioHandle()
    io = chunk_io.AioRangeIO(handle)
    buf = torch.zeros(A)
    io.submit_read([(buf, "a", 0), (buf, "b", 4096)])
    io.submit_write([(buf, "c", 0)])
    assert (handle.waits, io.pending) == (0, 3)
    io.wait()
    assert (handle.waits, io.pending) == (1, 0)
    io.wait()  # nothing outstanding: the handle's wait (which asserts pending ops) is not called
    assert handle.waits == 1
    io.read([(buf, "a", 0)])
    io.write([(buf, "a", 0)])
    assert handle.waits == 3 and io.asynchronous


def test_aio_range_io_refuses_a_count_mismatch():
    io = chunk_io.AioRangeIO(FakeAioHandle(count_bias=1))
    io.submit_read([(torch.zeros(A), "a", 0)])
    with pytest.raises(RuntimeError, match="completed 2 of 1"):
        io.wait()


class DeferredIO:
    """An asynchronous ranged I/O on in-memory files: a transfer happens at :meth:`wait`, reads before
    writes; submitting a read into a buffer with a write outstanding is an error."""

    asynchronous = True

    def __init__(self, files: dict[str, torch.Tensor]) -> None:
        self.files = files
        self.reads: list[tuple[torch.Tensor, str, int]] = []
        self.writes: list[tuple[torch.Tensor, str, int]] = []
        self.writes_with_reads = False
        """Whether a write was ever submitted while a read was outstanding (read-ahead)."""

    def begin_write(self, path, total_bytes):
        assert self.files[path].nbytes == total_bytes

    def end_write(self, path):
        pass

    def submit_read(self, requests):
        for buf, _, _ in requests:
            assert not any(_overlap(buf, w) for w, _, _ in self.writes), "read into a buffer being written"
        self.reads += requests

    def submit_write(self, requests):
        self.writes += requests
        self.writes_with_reads |= bool(self.reads)

    def read(self, requests):
        self.submit_read(requests)
        self.wait()

    def wait(self):
        for buf, path, offset in self.reads:
            buf.copy_(self.files[path].narrow(0, offset // 4, buf.numel()))
        for buf, path, offset in self.writes:
            self.files[path].narrow(0, offset // 4, buf.numel()).copy_(buf)
        self.reads, self.writes = [], []


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


class StoreIO(chunk_io.StoreRangeIO):
    """The raw store's ranged I/O with paths as keys (no swap handle needed)."""

    def __init__(self, store) -> None:
        self.handle = types.SimpleNamespace(key=str, store=store)
        self.store = store
        self._writing, self._reading = {}, {}


@dataclasses.dataclass
class Case:
    """One sub-group: ``numel`` elements, gradient fragments at ``(offset, length)`` (the rest of the
    sub-group's gradient stays in DRAM), the state files' contents before the step."""

    numel: int
    fragments: list[tuple[int, int]]
    files: dict[str, torch.Tensor]
    grad: torch.Tensor
    unswapped: list[tuple[int, torch.Tensor]]


def _case(seed: int) -> Case:
    gen = torch.Generator().manual_seed(seed)
    numel = 12 * A + 300
    # Fragments of odd lengths at odd offsets, some small (many pieces per chunk), one hole in DRAM.
    lengths = [5000, 37, 900, 1, 64, 2000, 700, 130, 1500]
    fragments, pos = [], 0
    for n in lengths:
        fragments.append((pos, n))
        pos += n
    hole = (pos, 1800)
    fragments.append((pos + 1800, numel - pos - 1800))
    grad = torch.randn(numel, generator=gen)
    files = {}
    for name in ("param", *chunked_step.STATE_KEYS):
        files[name] = torch.zeros(chunk_plan.align_up(numel, 256))
        files[name][:numel] = torch.randn(numel, generator=gen)
    files["exp_avg_sq"].abs_()
    for i, (off, n) in enumerate(fragments):
        files[f"grad{i}"] = torch.zeros(chunk_plan.align_up(n, 256))
        files[f"grad{i}"][:n] = grad[off:off + n]
    return Case(numel, fragments, files, grad, [(hole[0], grad[hole[0]:hole[0] + hole[1]].clone())])


def _fake_adam(optimizer, hparams, views, grad, numel, step_count):
    """An elementwise update standing in for DeepSpeedCPUAdam (which needs its built op)."""
    p, m, v = (views[k].narrow(0, 0, numel) for k in ("param", *chunked_step.STATE_KEYS))
    m.mul_(0.5).add_(grad)
    v.mul_(0.25).add_(grad * grad)
    p.sub_(m / (v.sqrt() + 1.0))
    return step_count + 1


def _reference(case: Case, inv_scale: float, has_moments: bool) -> dict[str, torch.Tensor]:
    p, m, v = (case.files[k][:case.numel].clone() for k in ("param", *chunked_step.STATE_KEYS))
    if not has_moments:
        m.zero_()
        v.zero_()
    _fake_adam(None, {}, {"param": p, "exp_avg": m, "exp_avg_sq": v}, case.grad * inv_scale, case.numel, 0)
    return {"param": p, "exp_avg": m, "exp_avg_sq": v}


class _Allocator:
    def __init__(self) -> None:
        from memascend.ops import nvme_io

        self.op = nvme_io.load()

    def allocate(self, numel, dtype):
        return self.op.aligned_empty(numel * torch.empty(0, dtype=dtype).element_size()).view(dtype)

    def free(self, buffer):
        pass


def _run_step(case: Case, io, chunk_numel: int, read_ahead: bool, has_moments: bool, monkeypatch) -> torch.Tensor:
    flat = torch.zeros(case.numel, dtype=torch.bfloat16)
    opt = types.SimpleNamespace(fp16_partitioned_groups_flat=[flat], fp16_groups=[[]],
                                fp16_partitioned_groups=[[]], optimizer=None,
                                _unflatten_partitioned_parameters=lambda sub_group_id: None)
    state: dict = {"step": 3}
    files = chunked_step._SubGroupFiles(
        numel=case.numel, file_numel=chunk_plan.align_up(case.numel, 256), numel_alignment=256, group_id=0,
        state=state, has_moments=has_moments, paths={k: k for k in ("param", *chunked_step.STATE_KEYS)},
        fragment_sources=case.fragments, fragment_paths=[f"grad{i}" for i in range(len(case.fragments))],
        fragment_file_numels=[chunk_plan.align_up(n, 256) for _, n in case.fragments],
        fragment_dtypes=[torch.float32] * len(case.fragments), unswapped=case.unswapped)
    monkeypatch.setattr(chunked_step._SubGroupFiles, "of", classmethod(lambda cls, o, s: files))
    monkeypatch.setattr(chunked_step, "_adam_on_chunk", _fake_adam)
    plan = chunked_step.ChunkedSubGroups.__new__(chunked_step.ChunkedSubGroups)
    vars(plan).update(chunk_numel=chunk_numel, settings=MemAscendSettings(), buffer_numel=chunk_numel, io=io,
                      read_ahead=read_ahead, allocator=_Allocator(), sets=[], grad=None, staging=None,
                      param_io={}, inv_scale=0.5, hparams=[{}], peak_locked_bytes=0)
    plan.step(opt, 0)
    assert state["step"] == 4
    assert plan.peak_locked_bytes == chunk_plan.chunk_buffers_numel(chunk_numel, read_ahead) * 4
    return flat


@pytest.mark.parametrize("has_moments", [True, False])
@pytest.mark.parametrize("read_ahead", [True, False])
@pytest.mark.parametrize("chunk_numel", [A, 2 * A, 8 * A])
def test_step_writes_the_reference_with_and_without_read_ahead(monkeypatch, chunk_numel, read_ahead, has_moments):
    case = _case(chunk_numel)
    want = _reference(case, 0.5, has_moments)
    io = DeferredIO(case.files)
    flat = _run_step(case, io, chunk_numel, read_ahead, has_moments, monkeypatch)
    for name, tensor in want.items():
        assert torch.equal(case.files[name][:case.numel], tensor), name
    assert torch.equal(flat, want["param"].to(torch.bfloat16))
    # Read-ahead: a chunk's writes were submitted while the next chunk's reads were outstanding.
    assert io.writes_with_reads == read_ahead


def test_step_on_the_raw_store_keeps_crc_and_matches_the_reference(tmp_path, monkeypatch):
    from memascend.io.store import TensorStore

    case = _case(1)
    want = _reference(case, 0.5, True)
    with TensorStore.create(tmp_path / "store", size_bytes=16 * MiB) as store:
        for key, tensor in case.files.items():
            store.write(key, tensor)
        io = StoreIO(store)
        assert not io.asynchronous
        _run_step(case, io, 2 * A, False, True, monkeypatch)
        for name, tensor in want.items():
            got = store.read_tensor(name)  # a whole read checks the CRC32C recorded from the pieces
            assert torch.equal(got[:case.numel], tensor), name


def test_step_on_the_raw_store_stops_at_a_corrupted_state_file(tmp_path, monkeypatch):
    from memascend.io.errors import ChecksumError
    from memascend.io.records import Reservation
    from memascend.io.store import TensorStore

    case = _case(2)
    with TensorStore.create(tmp_path / "store", size_bytes=16 * MiB) as store:
        for key, tensor in case.files.items():
            store.write(key, tensor)
        rec = store.record("exp_avg")
        bad = _Allocator().allocate(A, torch.float32)
        store.read_extent(rec, bad.view(torch.uint8), 4 * A * 4, 4 * A)
        bad[0] += 1.0
        store.write_extent(Reservation(rec.key, rec.offset_bytes, rec.nbytes), bad.view(torch.uint8), 4 * A * 4, 4 * A)
        with pytest.raises(ChecksumError):
            _run_step(case, StoreIO(store), 2 * A, False, True, monkeypatch)


def test_read_ahead_is_off_on_a_synchronous_target():
    assert chunk_io.AioRangeIO.asynchronous and not chunk_io.StoreRangeIO.asynchronous
    assert MemAscendSettings().enable_chunk_prefetch
    assert not MemAscendSettings.baseline().enable_chunk_prefetch


def test_read_ahead_crosses_into_the_next_chunked_sub_group(monkeypatch):
    """The last chunk of sub-group 0 reads ahead the first chunk of sub-group 1 (stepped in chunks
    too); sub-group 0's last writes are still outstanding when its step returns and complete at
    sub-group 1's first wait. Both sub-groups end as the reference computes them."""
    cases = [_case(11), _case(12)]
    wants = [_reference(c, 0.5, True) for c in cases]
    files_of = {}
    for g, case in enumerate(cases):
        files_of[g] = chunked_step._SubGroupFiles(
            numel=case.numel, file_numel=chunk_plan.align_up(case.numel, 256), numel_alignment=256, group_id=0,
            state={"step": 3}, has_moments=True, paths={k: f"{g}/{k}" for k in ("param", *chunked_step.STATE_KEYS)},
            fragment_sources=case.fragments, fragment_paths=[f"{g}/grad{i}" for i in range(len(case.fragments))],
            fragment_file_numels=[chunk_plan.align_up(n, 256) for _, n in case.fragments],
            fragment_dtypes=[torch.float32] * len(case.fragments), unswapped=case.unswapped)
    io = DeferredIO({f"{g}/{k}": t for g, c in enumerate(cases) for k, t in c.files.items()})
    monkeypatch.setattr(chunked_step._SubGroupFiles, "of", classmethod(lambda cls, o, s: files_of[s]))
    monkeypatch.setattr(chunked_step, "_adam_on_chunk", _fake_adam)
    flats = [torch.zeros(c.numel, dtype=torch.bfloat16) for c in cases]
    opt = types.SimpleNamespace(fp16_partitioned_groups_flat=flats, fp16_groups=[[], []],
                                fp16_partitioned_groups=[[], []], optimizer=None,
                                _unflatten_partitioned_parameters=lambda sub_group_id: None)
    plan = chunked_step.ChunkedSubGroups.__new__(chunked_step.ChunkedSubGroups)
    vars(plan).update(chunk_numel=4 * A, settings=MemAscendSettings(), buffer_numel=4 * A, io=io, read_ahead=True,
                      allocator=_Allocator(), sets=[], grad=None, staging=None, param_io={}, inv_scale=0.5,
                      hparams=[{}, {}], peak_locked_bytes=0, sub_groups={0, 1})
    plan.step(opt, 0)
    assert plan.ahead is not None and plan.ahead.sub_group_id == 1
    assert io.reads and io.writes  # sub-group 1's first reads and sub-group 0's last writes in flight
    plan.step(opt, 1)
    assert plan.ahead is None and not io.reads and not io.writes
    for g, case in enumerate(cases):
        for name, tensor in wants[g].items():
            assert torch.equal(case.files[name][:case.numel], tensor), (g, name)
        assert torch.equal(flats[g], wants[g]["param"].to(torch.bfloat16))
        assert files_of[g].state["step"] == 4
