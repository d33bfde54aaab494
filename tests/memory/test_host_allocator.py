"""memascend.memory.host_allocator: page release, the glibc malloc policy and malloc_trim."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
import torch

from memascend.memory import host_allocator


def test_release_pages_drops_rss_and_reads_zero_inside():
    proc = psutil.Process()
    t = torch.full((64 << 20,), 7, dtype=torch.uint8)  # 64 MiB, touched
    before = proc.memory_info().rss
    released = host_allocator.release_pages(t)
    assert released > 60 << 20
    assert proc.memory_info().rss < before - (48 << 20)
    start = -(-t.data_ptr() // 4096) * 4096 - t.data_ptr()
    assert int(t[start:start + released].sum()) == 0
    assert int(t[:start].sum()) == 7 * start  # partial head page kept
    assert host_allocator.release_pages(torch.ones(10)) == 0  # under two pages: left alone


@pytest.mark.skipif(host_allocator.malloc_stats() is None, reason="needs glibc >= 2.33 (mallinfo2)")
def test_malloc_policy_and_trim_run():
    assert host_allocator.set_malloc_policy() is True
    host_allocator.trim()
    assert host_allocator.malloc_stats()["heap_bytes"] > 0


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, (128 << 10, 128 << 10, None)),  # glibc's defaults; its own arena limit
    ({"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "3"}, (65536, 128 << 10, 3)),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0x100000:glibc.malloc.arena_max=010"}, (128 << 10, 1 << 20, 8)),
    # whichever comes first in the environment, as glibc takes it
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096", "MALLOC_MMAP_THRESHOLD_": "8192"}, (4096, 128 << 10, None)),
    ({"MALLOC_MMAP_THRESHOLD_": "8192", "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}, (8192, 128 << 10, None)),
    # values glibc ignores: unreadable, an mmap threshold over 32 MiB, no arena limit
    ({"MALLOC_TRIM_THRESHOLD_": "lots", "MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_ARENA_MAX": "0"},
     (128 << 10, 128 << 10, None)),
])
def test_startup_malloc_policy_reads_what_glibc_reads(environ, expected):
    policy = host_allocator.startup_malloc_policy(environ)
    assert (policy.mmap_threshold_bytes, policy.trim_threshold_bytes, policy.arena_max) == expected


class _Recorder:
    def __init__(self, refuse=()):
        self.calls, self.refuse = [], set(refuse)

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return 0 if param in self.refuse else 1


def test_setting_the_previous_policy_again_restores_it(monkeypatch):
    recorder = _Recorder()
    monkeypatch.setattr(host_allocator, "_libc", lambda: recorder)
    monkeypatch.setattr(host_allocator, "_in_force", None)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX"):
        monkeypatch.delenv(name, raising=False)
    previous = host_allocator.malloc_policy_in_force()
    assert host_allocator.set_malloc_policy() is True
    assert host_allocator.malloc_policy_in_force() == host_allocator.MallocPolicy()
    assert host_allocator.set_malloc_policy(previous) is True
    # no arena call: glibc's own limit cannot be set back, so the one memascend set stays (and is known)
    assert recorder.calls[3:] == [(host_allocator._M_MMAP_THRESHOLD, 128 << 10),
                                  (host_allocator._M_TRIM_THRESHOLD, 128 << 10)]
    assert host_allocator.malloc_policy_in_force() == host_allocator.MallocPolicy(
        mmap_threshold_bytes=128 << 10, trim_threshold_bytes=128 << 10, arena_max=2)


def test_a_refused_value_is_not_recorded_as_in_force(monkeypatch):
    recorder = _Recorder(refuse={host_allocator._M_MMAP_THRESHOLD})
    monkeypatch.setattr(host_allocator, "_libc", lambda: recorder)
    monkeypatch.setattr(host_allocator, "_in_force", host_allocator.MallocPolicy(
        mmap_threshold_bytes=1 << 20, trim_threshold_bytes=1 << 20, arena_max=None))
    assert host_allocator.set_malloc_policy() is False
    assert host_allocator.malloc_policy_in_force() == host_allocator.MallocPolicy(
        mmap_threshold_bytes=1 << 20, trim_threshold_bytes=16 << 20, arena_max=2)


_ARENA_PROBE = r"""
import ctypes, sys, threading, torch
from memascend.memory import host_allocator

torch.set_num_threads(2)
libc = ctypes.CDLL("libc.so.6")
libc.open_memstream.restype = ctypes.c_void_p
libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]


def arenas():
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    return buf.value.decode().count("<heap nr=")


# another thread (as an aio or gloo thread would) takes the second arena first, and stays
ready, done = threading.Event(), threading.Event()
def other():
    libc.free(libc.malloc(1000))
    ready.set()
    done.wait()
t = threading.Thread(target=other)
t.start()
ready.wait()
if sys.argv[1] == "stock-order":
    host_allocator.start_intra_op_threads = lambda: None
host_allocator.set_malloc_policy()
torch.empty(1 << 16).fill_(1.0)  # the first parallel region, wherever the pool did not start yet
print(arenas())
done.set()
t.join()
"""


@pytest.mark.skipif(host_allocator.malloc_stats() is None, reason="needs glibc >= 2.33 (mallinfo2, malloc_info)")
@pytest.mark.skipif(not torch.backends.openmp.is_available(), reason="torch built without OpenMP")
def test_the_arena_limit_leaves_the_intra_op_worker_its_own_arena():
    # main arena + the other thread's + the intra-op worker's own; where the pool starts only after
    # the two-arena limit the worker shares one of the first two
    def arenas(order: str) -> int:
        out = subprocess.run([sys.executable, "-c", _ARENA_PROBE, order], capture_output=True, text=True,
                             check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
        return int(out.stdout.split()[-1])

    assert arenas("memascend") == 3
    assert arenas("stock-order") == 2


def test_start_intra_op_threads_starts_the_pool_once():
    # threads of the process before, after a first and after a second call
    code = ("import psutil, torch; from memascend.memory import host_allocator as h; torch.set_num_threads(2); "
            "p = psutil.Process(); n = [p.num_threads()]; h.start_intra_op_threads(); n.append(p.num_threads()); "
            "h.start_intra_op_threads(); n.append(p.num_threads()); print(*n)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    before, first, second = map(int, out.stdout.split())
    assert (first - before, second - first) == (1, 0)
