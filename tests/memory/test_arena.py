"""Exact-size pinned arena: alignment, accounting against a Python model of the free list,
coalescing, growth, locking, hugepages, CUDA registration status, tensor lifetime."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from memascend.memory import arena as arena_mod
from memascend.memory.arena import ALIGN_BYTES, REGION_ALIGN_BYTES, PinnedArena, PinnedMemoryError

MIB = 1 << 20


def round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def meminfo(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@pytest.fixture
def arena():
    a = PinnedArena(region_bytes=4 * MIB, enable_hugetlb=False)
    yield a
    a.close()


# -- reference model ------------------------------------------------------------------------------
class FreeListModel:
    """Plain-Python best-fit free list with per-region coalescing: the oracle for the C++ arena."""

    def __init__(self, region_bytes: int) -> None:
        self.region_bytes = round_up(region_bytes, REGION_ALIGN_BYTES)
        self.regions: list[tuple[int, int]] = []  # (base, bytes)
        self.free: dict[int, tuple[int, int]] = {}  # addr -> (bytes, region index)
        self.live: dict[int, tuple[int, int, int]] = {}  # addr -> (granted, requested, region)
        self.peak_in_use = 0

    def needs_growth(self, nbytes: int) -> int:
        """Bytes of the region the arena must map for nbytes, 0 if a free block fits."""
        granted = round_up(max(nbytes, 1), ALIGN_BYTES)
        if any(size >= granted for size, _ in self.free.values()):
            return 0
        return round_up(max(self.region_bytes, granted), REGION_ALIGN_BYTES)

    def add_region(self, base: int, nbytes: int) -> None:
        self.regions.append((base, nbytes))
        self.free[base] = (nbytes, len(self.regions) - 1)

    def allocate(self, nbytes: int) -> int:
        granted = round_up(max(nbytes, 1), ALIGN_BYTES)
        size, addr = min((size, addr) for addr, (size, _) in self.free.items() if size >= granted)
        _, region = self.free.pop(addr)
        if size > granted:
            self.free[addr + granted] = (size - granted, region)
        self.live[addr] = (granted, nbytes, region)
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return addr

    def release(self, addr: int) -> None:
        granted, _, region = self.live.pop(addr)
        nxt = self.free.get(addr + granted)
        if nxt is not None and nxt[1] == region:
            del self.free[addr + granted]
            granted += nxt[0]
        for paddr, (psize, pregion) in list(self.free.items()):
            if paddr + psize == addr and pregion == region:
                del self.free[paddr]
                addr, granted = paddr, granted + psize
                break
        self.free[addr] = (granted, region)

    @property
    def in_use(self) -> int:
        return sum(g for g, _, _ in self.live.values())

    @property
    def requested(self) -> int:
        return sum(r for _, r, _ in self.live.values())


class ArenaMachine(RuleBasedStateMachine):
    """Random allocate/free sequences; every step the arena must equal the model exactly."""

    blocks = Bundle("blocks")

    def __init__(self) -> None:
        super().__init__()
        self.arena = PinnedArena(enable_hugetlb=False, region_bytes=2 * MIB, enable_mlock=False)
        self.ext = self.arena._ext
        self.model = FreeListModel(2 * MIB)

    @rule(target=blocks, nbytes=st.one_of(st.integers(0, 3 * ALIGN_BYTES), st.integers(1, 3 * MIB)))
    def allocate(self, nbytes):
        grow = self.model.needs_growth(nbytes)
        regions_before = len(self.arena.regions())
        addr = self.ext.allocate_raw(nbytes)
        regions = self.arena.regions()
        if grow:
            assert len(regions) == regions_before + 1
            assert regions[-1].size_bytes == grow
            self.model.add_region(regions[-1].base, regions[-1].size_bytes)
        else:
            assert len(regions) == regions_before
        assert addr == self.model.allocate(nbytes)
        assert addr % ALIGN_BYTES == 0
        return addr

    @rule(addr=consumes(blocks))
    def free(self, addr):
        self.ext.free_raw(addr)
        self.model.release(addr)

    @invariant()
    def matches_model(self):
        assert self.arena.free_blocks() == sorted((a, s) for a, (s, _) in self.model.free.items())
        s = self.arena.stats()
        assert s.in_use_bytes == self.model.in_use
        assert s.requested_bytes == self.model.requested
        assert s.peak_in_use_bytes == self.model.peak_in_use
        assert s.reserved_bytes == sum(b for _, b in self.model.regions)
        assert s.free_bytes == s.reserved_bytes - s.in_use_bytes
        assert s.num_allocations == len(self.model.live)
        assert s.largest_free_bytes == max((sz for sz, _ in self.model.free.values()), default=0)
        assert s.locked_bytes == 0  # enable_mlock=False

    def teardown(self):
        self.arena.close()


ArenaMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestArenaAgainstModel = ArenaMachine.TestCase


# -- allocation API ---------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(0, 300_000),
    dtype=st.sampled_from(
        [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.int64]
    ),
)
def test_allocate_is_aligned_and_exact(numel, dtype):
    with PinnedArena(enable_hugetlb=False, region_bytes=2 * MIB, enable_mlock=False) as a:
        t = a.allocate(numel, dtype)
        assert t.shape == (numel,) and t.dtype == dtype and t.device.type == "cpu"
        assert t.data_ptr() % ALIGN_BYTES == 0
        nbytes = numel * t.element_size()
        s = a.stats()
        assert s.requested_bytes == nbytes
        assert s.in_use_bytes == round_up(max(nbytes, 1), ALIGN_BYTES)
        assert s.rounding_waste_bytes == ((-nbytes) % ALIGN_BYTES if nbytes else ALIGN_BYTES)
        t.fill_(3)  # the memory is really there
        assert bool((t == 3).all())
        a.free(t)
        assert a.stats().in_use_bytes == 0


def test_coalescing_returns_one_block(arena):
    ts = [arena.allocate(ALIGN_BYTES, torch.uint8) for _ in range(4)]
    addrs = [t.data_ptr() for t in ts]
    assert addrs == [addrs[0] + i * ALIGN_BYTES for i in range(4)]  # carved in address order
    arena.free(ts[0])
    arena.free(ts[2])
    assert arena.stats().num_free_blocks == 3  # [0], [2], tail
    arena.free(ts[1])  # merges with both neighbours
    assert arena.stats().num_free_blocks == 2
    arena.free(ts[3])
    s = arena.stats()
    assert s.num_free_blocks == 1 and s.largest_free_bytes == s.reserved_bytes == 4 * MIB
    assert s.fragmentation_ratio == 0.0


def test_best_fit_reuses_the_smallest_hole(arena):
    a, _b, c, _d = (
        arena.allocate(n, torch.uint8) for n in (3 * ALIGN_BYTES, ALIGN_BYTES, ALIGN_BYTES, ALIGN_BYTES)
    )
    a_ptr, c_ptr = a.data_ptr(), c.data_ptr()
    arena.free(a)
    arena.free(c)
    assert arena.stats().fragmentation_ratio > 0
    small = arena.allocate(100, torch.uint8)
    assert small.data_ptr() == c_ptr  # the 4 KiB hole, not the 12 KiB one
    mid = arena.allocate(2 * ALIGN_BYTES, torch.uint8)
    assert mid.data_ptr() == a_ptr


def test_growth_by_region_and_oversized_region(arena):
    t1 = arena.allocate(3 * MIB, torch.uint8)
    assert arena.stats().num_regions == 1
    t2 = arena.allocate(3 * MIB, torch.uint8)  # 1 MiB left: a new 4 MiB region
    regions = arena.regions()
    assert [r.size_bytes for r in regions] == [4 * MIB, 4 * MIB]
    big = arena.allocate(9 * MIB + 1, torch.uint8)  # larger than a region: its own, 2 MiB-rounded
    assert arena.regions()[-1].size_bytes == 10 * MIB
    assert arena.stats().reserved_bytes == 18 * MIB == arena.stats().peak_reserved_bytes
    for t in (t1, t2, big):
        arena.free(t)
    assert arena.release_empty_regions() == 18 * MIB
    assert arena.stats().reserved_bytes == 0 and arena.stats().num_regions == 0


def test_release_empty_before_growing_replaces_idle_regions_instead_of_adding():
    def run(release: bool) -> tuple[int, int]:
        a = PinnedArena(region_bytes=4 * MIB, enable_hugetlb=False, enable_mlock=False,
                        enable_cuda_register=False, release_empty_before_growing=release)
        try:
            kept = a.allocate(MIB, torch.uint8)  # region 1 stays in use
            idle = [a.allocate(4 * MIB, torch.uint8) for _ in range(3)]  # regions 2-4, then idle
            for t in idle:
                a.free(t)
            big = a.allocate(6 * MIB, torch.uint8)  # fits no free block: a 6 MiB region
            fits = a.allocate(2 * MIB, torch.uint8)  # fits region 1's free 3 MiB: no growth
            s = a.stats()
            assert kept.data_ptr() != big.data_ptr() and s.in_use_bytes == 9 * MIB
            for t in (kept, big, fits):
                a.free(t)
            return s.reserved_bytes, s.peak_reserved_bytes
        finally:
            a.close()

    assert run(release=False) == (22 * MIB, 22 * MIB)  # 4 + 3 x 4 idle + 6
    # Two idle 4 MiB regions (8 >= 6 MiB) go before the 6 MiB one is mapped; one idle region stays.
    assert run(release=True) == (14 * MIB, 16 * MIB)


def test_reserve_maps_one_exact_region(arena):
    assert arena.reserve(10 * MIB + 5) == 12 * MIB
    assert arena.reserve(5 * MIB) == 0  # fits in the free 12 MiB
    t = arena.allocate(10 * MIB // 4, torch.float32)
    assert arena.stats().num_regions == 1
    arena.free(t)


def test_view_keeps_memory_until_it_dies(arena):
    t = arena.allocate(10_000, torch.float32)
    view = t[100:200]
    arena.free(t)
    assert t.numel() == 0
    assert arena.stats().num_allocations == 1  # the view still holds the block
    view.fill_(1.0)
    del view
    gc.collect()
    assert arena.stats().num_allocations == 0


def test_free_rejects_foreign_and_double_free(arena):
    with pytest.raises(ValueError, match="not view a live allocation"):
        arena.free(torch.empty(10))
    t = arena.allocate(10, torch.float32)
    arena.free(t)
    with pytest.raises(ValueError):
        arena.free(t)
    other = PinnedArena(enable_hugetlb=False, region_bytes=2 * MIB)
    u = other.allocate(10, torch.float32)
    with pytest.raises(ValueError):
        arena.free(u)
    other.free(u)
    other.close()


def test_dropping_the_last_reference_frees(arena):
    t = arena.allocate(1000, torch.bfloat16)
    assert arena.stats().num_allocations == 1
    del t
    assert arena.stats().num_allocations == 0


def test_bad_arguments(arena):
    with pytest.raises(ValueError):
        arena.allocate(-1, torch.float32)
    with pytest.raises(ValueError):
        arena.allocate(1.5, torch.float32)
    with pytest.raises(ValueError):
        PinnedArena(enable_hugetlb=False, region_bytes=0)


def test_close_defers_unmap_until_tensors_die():
    a = PinnedArena(enable_hugetlb=False, region_bytes=2 * MIB)
    t = a.allocate(100, torch.float32)
    t.fill_(2.0)
    a.close()
    with pytest.raises(RuntimeError, match="close"):
        a.allocate(1, torch.float32)
    assert a.stats().num_regions == 1  # t's region stays mapped
    assert float(t.sum()) == 200.0
    ext = a._ext
    del a
    gc.collect()
    assert float(t.sum()) == 200.0  # the tensor keeps the arena alive
    del t
    assert ext.stats()["num_regions"] == 0 and ext.stats()["reserved_bytes"] == 0


def test_pin_copies_and_reports_pinned(arena):
    src = torch.randn(3, 5, 7)
    p = arena.pin(src)
    assert p.shape == src.shape and torch.equal(p, src)
    assert arena.is_pinned(p) and arena.is_pinned(p[1:, ::2])
    assert not arena.is_pinned(src)
    unlocked = PinnedArena(enable_hugetlb=False, region_bytes=2 * MIB, enable_mlock=False)
    q = unlocked.allocate(10, torch.float32)
    assert not unlocked.is_pinned(q)
    unlocked.free(q)
    unlocked.close()


def test_concurrent_allocate_free(arena):
    errors = []

    def worker(seed: int) -> None:
        try:
            g = torch.Generator().manual_seed(seed)
            held = []
            for _ in range(200):
                if held and torch.rand(1, generator=g).item() < 0.5:
                    arena.free(held.pop())
                else:
                    n = int(torch.randint(1, 50_000, (1,), generator=g))
                    t = arena.allocate(n, torch.float32)
                    t.fill_(seed)
                    held.append(t)
            assert all(bool((t == seed).all()) for t in held)
            for t in held:
                arena.free(t)
        except Exception as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    s = arena.stats()
    assert s.in_use_bytes == 0 and s.num_allocations == 0 and s.num_free_blocks == s.num_regions


def test_default_arena_is_process_wide():
    previous = arena_mod.set_default_arena(None)
    try:
        a = arena_mod.default_arena()
        assert arena_mod.default_arena() is a
        custom = PinnedArena(enable_hugetlb=False, region_bytes=2 * MIB)
        assert arena_mod.set_default_arena(custom) is a
        assert arena_mod.default_arena() is custom
        custom.close()
        assert arena_mod.default_arena() is not custom  # a closed default is replaced
        a.close()
    finally:
        arena_mod.set_default_arena(previous)


def test_odirect_write_from_arena_buffer(arena, tmp_path):
    t = arena.allocate(64 * 1024, torch.uint8)
    t.copy_(torch.arange(64 * 1024, dtype=torch.int64).remainder(251).to(torch.uint8))
    path = tmp_path / "direct.bin"
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    except OSError as exc:
        pytest.skip(f"O_DIRECT not supported on {tmp_path}: {exc}")
    try:
        # os.pwrite copies through a bytes object; hand the arena memory itself to the kernel.
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        written = libc.pwrite(fd, ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.numel()), ctypes.c_long(0))
        assert written == t.numel(), os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(t.tolist())


# -- locking, hugepages, CUDA -------------------------------------------------------------------------
def test_mlock_really_locks():
    before_kib = proc_status_kib("VmLck")
    a = PinnedArena(enable_hugetlb=False, region_bytes=64 * MIB)
    t = a.allocate(1000, torch.float32)
    s = a.stats()
    assert s.locked_bytes == s.reserved_bytes == 64 * MIB
    assert proc_status_kib("VmLck") - before_kib == 64 * MIB // 1024
    a.free(t)
    a.close()
    assert proc_status_kib("VmLck") == before_kib


_MLOCK_DENIED = textwrap.dedent(
    """
    import resource, torch
    from memascend.memory.arena import PinnedArena, PinnedMemoryError
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 << 20, 8 << 20))
    a = PinnedArena(enable_hugetlb=False, region_bytes=64 << 20)
    try:
        a.allocate(10, torch.float32)
    except PinnedMemoryError as exc:
        print("ERROR:", exc)
    """
)


@pytest.mark.root
def test_mlock_failure_names_limit_and_need():
    if os.geteuid() != 0:
        pytest.skip("needs root to drop CAP_IPC_LOCK with setpriv")
    cmd = [
        "setpriv",
        "--bounding-set",
        "-ipc_lock",
        "--inh-caps",
        "-ipc_lock",
        sys.executable,
        "-c",
        _MLOCK_DENIED,
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        pytest.skip("setpriv not installed")
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ERROR:")), None)
    assert line is not None, out.stdout + out.stderr
    assert "RLIMIT_MEMLOCK" in line and str(8 << 20) in line and str(64 << 20) in line
    assert "\n" not in line.strip()


@pytest.mark.root
def test_hugetlb_backing_when_hugepages_reserved():
    knob = Path("/proc/sys/vm/nr_hugepages")
    if os.geteuid() != 0 or not os.access(knob, os.W_OK):
        pytest.skip("needs root and a writable vm.nr_hugepages")
    if meminfo("Hugepagesize") != 2048:
        pytest.skip("test assumes 2 MiB hugepages")
    saved = knob.read_text().strip()
    pages = 8
    try:
        knob.write_text(str(int(saved) + pages))
        free_before = meminfo("HugePages_Free")
        if free_before < pages:
            pytest.skip("the kernel could not reserve hugepages (memory too fragmented)")
        a = PinnedArena(region_bytes=pages * 2 * MIB)
        t = a.allocate(pages * 2 * MIB // 4, torch.float32)
        region = a.regions()[0]
        assert region.backing == "hugetlb" and region.locked
        s = a.stats()
        assert s.hugetlb_bytes == s.reserved_bytes == s.locked_bytes == pages * 2 * MIB
        assert meminfo("HugePages_Free") == free_before - pages
        t.fill_(7.0)
        assert float(t[-1]) == 7.0
        a.free(t)
        a.close()
        assert meminfo("HugePages_Free") == free_before
        # With hugetlb disabled the same request falls back to transparent hugepages.
        b = PinnedArena(region_bytes=2 * MIB, enable_hugetlb=False)
        u = b.allocate(10, torch.float32)
        assert b.regions()[0].backing in ("thp", "pages")
        b.free(u)
        b.close()
    finally:
        knob.write_text(saved)


def test_thp_backing_without_hugetlb():
    a = PinnedArena(enable_hugetlb=False, region_bytes=2 * MIB)
    t = a.allocate(1, torch.uint8)
    region = a.regions()[0]
    thp_mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    expected = "pages" if thp_mode.exists() and "[never]" in thp_mode.read_text() else "thp"
    assert region.backing == expected and region.base % REGION_ALIGN_BYTES == 0
    assert a.stats().hugetlb_bytes == 0
    a.free(t)
    a.close()


def test_cuda_registration_reports_not_available_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    a = PinnedArena(enable_hugetlb=False, region_bytes=2 * MIB)
    t = a.allocate(10, torch.float32)
    assert a.cuda_status.startswith("not available: "), a.cuda_status
    assert a.stats().registered_bytes == 0
    assert not a.regions()[0].registered
    a.free(t)
    a.close()


@pytest.mark.gpu
def test_cuda_registration_pins_for_torch():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    a = PinnedArena(enable_hugetlb=False, region_bytes=2 * MIB)
    t = a.allocate(1 << 16, torch.float32)
    assert a.cuda_status.startswith("available")
    assert a.stats().registered_bytes == a.stats().reserved_bytes
    assert t.is_pinned()
    t.copy_(torch.arange(1 << 16, dtype=torch.float32))
    assert torch.equal(t.cuda(non_blocking=True).cpu(), t)
    a.free(t)
    a.close()


def test_pinned_memory_error_is_user_error():
    from memascend.errors import UserError

    assert issubclass(PinnedMemoryError, UserError)


@pytest.mark.parametrize("register", [True, False])
def test_arena_initialises_torch_cuda_before_registering(monkeypatch, register):
    # torch's is_pinned() is False for every pointer until torch has initialised CUDA (H100, torch
    # 2.11): the arena initialises it before it registers regions, and only then.
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("init"))
    a = PinnedArena(enable_hugetlb=False, enable_mlock=False, enable_cuda_register=register, region_bytes=2 * MIB)
    a.close()
    assert calls == (["init"] if register else [])
