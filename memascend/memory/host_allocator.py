"""Host memory calls on glibc: the ``mallopt`` policy, ``malloc_trim``, page release and locking.

Torch's CPU allocator takes every host tensor from glibc ``malloc``. glibc's defaults suit
long-lived small objects, not a training step that allocates and frees hundreds of MB of
activations and gradient temporaries per layer from several threads (aio, OpenMP, gloo):

* the mmap threshold is *dynamic*: after a freed mmapped block, glibc raises the threshold to that
  block's size (up to 32 MiB), so later tensors of up to 32 MiB come from the heap arenas, where
  freed memory stays resident (RSS) until the arena's top happens to be free;
* each thread may get its own arena (up to 8 per core), each keeping its own free memory.

MemAscend's "eradicating fragmentation" (paper section 4) is here the allocator half: a fixed mmap
threshold, a trim threshold, two arenas (:class:`MallocPolicy`), and ``malloc_trim(0)`` at the
points where a step stops needing memory (:mod:`memascend.integrations.deepspeed.step_memory`). The
mmap threshold trades time for memory: a lower one maps and unmaps more blocks (page faults at
every step), a higher one keeps more freed memory resident in the heap. With the host block cache
(:mod:`memascend.memory.host_cache`) torch's tensors of 64 KiB or more do not come from glibc at
all, and this policy is left with the smaller ones and the libraries' own allocations. None of it
changes a computed value. The measured trade is in ``baselines/<profile>/ablation/``.

Page calls on tensors' memory: :func:`release_pages` (``madvise(MADV_DONTNEED)``),
:func:`park_locked_pages` / :func:`lock_pages` (``munlock`` + ``madvise``, ``mlock``) and
:func:`resident_bytes` (``mincore``).

All functions are no-ops returning ``False``/``0``/``None`` on a C library without these glibc calls.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

from memascend.errors import UserError

# mallopt parameter numbers (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.lru_cache(maxsize=1)
def _libc() -> Any | None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("mallopt", "malloc_trim")):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


@dataclasses.dataclass(frozen=True, kw_only=True)
class MallocPolicy:
    """glibc ``mallopt`` values: what :func:`set_malloc_policy` sets (the defaults are memascend's
    policy) or, from :func:`startup_malloc_policy`, what glibc started with.

    Attributes:
        mmap_threshold_bytes: blocks at least this large are mmapped and unmapped on free
            (``M_MMAP_THRESHOLD``; setting it fixes the threshold: glibc stops raising it).
        trim_threshold_bytes: free memory at an arena's top above this is returned at once
            (``M_TRIM_THRESHOLD``).
        arena_max: most malloc arenas, threads share them beyond that (``M_ARENA_MAX``); ``None``:
            glibc's own limit (8 per core), which ``mallopt`` cannot set back (it ignores 0).
    """

    mmap_threshold_bytes: int = 4 * 1024 * 1024
    trim_threshold_bytes: int = 16 * 1024 * 1024
    arena_max: int | None = 2


#: glibc's start-up ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` (malloc/malloc.c
#: ``DEFAULT_MMAP_THRESHOLD_MIN``, ``DEFAULT_TRIM_THRESHOLD``; mallopt(3)).
GLIBC_DEFAULT_MMAP_THRESHOLD_BYTES = 128 * 1024
GLIBC_DEFAULT_TRIM_THRESHOLD_BYTES = 128 * 1024
#: Largest ``M_MMAP_THRESHOLD`` glibc accepts on 64-bit (``HEAP_MAX_SIZE / 2``); it ignores more.
_GLIBC_MAX_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024

# MallocPolicy field -> (mallopt parameter, glibc tunable, legacy environment variable).
_PARAMETERS = {
    "mmap_threshold_bytes": (_M_MMAP_THRESHOLD, "glibc.malloc.mmap_threshold", "MALLOC_MMAP_THRESHOLD_"),
    "trim_threshold_bytes": (_M_TRIM_THRESHOLD, "glibc.malloc.trim_threshold", "MALLOC_TRIM_THRESHOLD_"),
    "arena_max": (_M_ARENA_MAX, "glibc.malloc.arena_max", "MALLOC_ARENA_MAX"),
}

_in_force: MallocPolicy | None = None
"""The values :func:`set_malloc_policy` last set in this process (``None``: it never ran)."""


def _parse_glibc_number(text: str) -> int | None:
    """A tunable's value as glibc's ``_dl_strtoul`` reads it (decimal, ``0x`` hex, leading-0 octal)."""
    text = text.strip()
    try:
        if text[:2].lower() == "0x":
            return int(text[2:], 16)
        return int(text, 8) if len(text) > 1 and text.startswith("0") else int(text, 10)
    except ValueError:
        return None


def startup_malloc_policy(environ: Mapping[str, str] | None = None) -> MallocPolicy:
    """The ``mallopt`` values glibc started this process with, as far as they can be known.

    glibc has no getter for them. At start-up it takes each from ``GLIBC_TUNABLES``
    (``glibc.malloc.mmap_threshold``, ``.trim_threshold``, ``.arena_max``) or the legacy variable
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_ARENA_MAX``), whichever comes
    first in the environment, else its defaults (:data:`GLIBC_DEFAULT_MMAP_THRESHOLD_BYTES`,
    :data:`GLIBC_DEFAULT_TRIM_THRESHOLD_BYTES`, its own arena limit). This reads the same variables.

    Args:
        environ: the environment (default: ``os.environ``, which is what glibc read unless code
            changed it since).

    Returns:
        The values; ``arena_max`` is ``None`` when none was given. Unreadable values, and an mmap
        threshold above 32 MiB, count as not given (glibc ignores them too).
    """
    environ = os.environ if environ is None else environ
    given: dict[str, str] = {}
    for name, value in environ.items():
        if name == "GLIBC_TUNABLES":
            for item in value.split(":"):
                key, _, text = item.partition("=")
                given.update({f: text for f, (_, tunable, _) in _PARAMETERS.items() if tunable == key
                              and f not in given})
        else:
            given.update({f: value for f, (_, _, legacy) in _PARAMETERS.items() if legacy == name
                          and f not in given})
    values = {f: _parse_glibc_number(text) for f, text in given.items()}
    mmap = values.get("mmap_threshold_bytes")
    trim = values.get("trim_threshold_bytes")
    arenas = values.get("arena_max")
    return MallocPolicy(
        mmap_threshold_bytes=mmap if mmap is not None and mmap <= _GLIBC_MAX_MMAP_THRESHOLD_BYTES
        else GLIBC_DEFAULT_MMAP_THRESHOLD_BYTES,
        trim_threshold_bytes=trim if trim is not None else GLIBC_DEFAULT_TRIM_THRESHOLD_BYTES,
        arena_max=arenas if arenas else None,
    )


def malloc_policy_in_force() -> MallocPolicy:
    """What :func:`set_malloc_policy` last set, else :func:`startup_malloc_policy`.

    A ``mallopt`` call by other code in the process is not seen (glibc cannot be asked).
    """
    return _in_force if _in_force is not None else startup_malloc_policy()


def start_intra_op_threads() -> None:
    """Start torch's intra-op (OpenMP) worker threads now, if they have not started yet.

    glibc gives a thread its malloc arena at the thread's first ``malloc`` and never moves it: a
    thread that starts after ``M_ARENA_MAX`` arenas exist shares one of them (``reused_arena``), and
    every ``malloc``/``free`` it makes waits on that arena's lock while the arena's other thread
    allocates. libgomp's workers start, and allocate, at torch's first parallel region. Where that
    region comes after :func:`set_malloc_policy`'s two-arena limit and after another thread (an aio
    or gloo thread, a step worker) has taken the second arena, the intra-op worker shares an arena
    with the threads it computes beside. Measured on the default job (SmolLM2-135M bf16, 4 x 256,
    parameters and optimizer on NVMe, 2 cores): the backward took 2.6-3.5 s a step with 0.38-0.51 s
    of system time and ~35 % more ``futex`` calls, against 2.0-2.4 s and 0.15-0.22 s with the worker
    started first (or without the arena limit); peak RSS the same (2,168-2,180 MiB).

    One parallel ``fill_`` of 64 Ki float32 elements (two chunks of ATen's 32 Ki-element grain)
    starts them; with one intra-op thread, or a pool already running, it starts nothing.
    """
    import torch

    if torch.get_num_threads() > 1:
        torch.empty(1 << 16, dtype=torch.float32).fill_(0.0)


def set_malloc_policy(policy: MallocPolicy = MallocPolicy()) -> bool:
    """Set ``policy``'s values in this process's glibc malloc; ``True`` if every call succeeded.

    A policy that limits the arenas (``arena_max``) first starts torch's intra-op threads
    (:func:`start_intra_op_threads`), so that they keep an arena of their own.

    To undo it, keep :func:`malloc_policy_in_force` from before and set that again. glibc offers
    no call that gives the mmap threshold back its dynamic raising, nor one back to its own arena
    limit (``arena_max=None`` leaves the limit as it is), so after such a restore the thresholds
    are the previous values, fixed. The values only decide when free memory goes back to the OS,
    never what a computation produces.
    """
    global _in_force
    libc = _libc()
    if libc is None:
        return False
    if policy.arena_max is not None:
        start_intra_op_threads()
    before = malloc_policy_in_force()
    done = {}
    for name, (param, _, _) in _PARAMETERS.items():
        value = getattr(policy, name)
        if value is not None:
            done[name] = libc.mallopt(param, int(value)) == 1
    _in_force = dataclasses.replace(before, **{name: getattr(policy, name) for name, ok in done.items() if ok})
    return all(done.values())


def trim() -> bool:
    """``malloc_trim(0)``: return every free page of every arena to the OS. ``True`` if some was."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def malloc_stats() -> dict[str, int] | None:
    """glibc ``mallinfo2`` of this process, in bytes (``None`` without glibc >= 2.33).

    Returns:
        ``heap_bytes`` (arena memory obtained with sbrk/mmap'd arenas), ``mmapped_bytes`` (blocks
        mapped one by one), ``in_use_bytes`` (allocated heap blocks), ``free_held_bytes`` (free
        heap blocks the process still holds: allocator overhead / fragmentation),
        ``trimmable_bytes`` (free memory at the main heap's top).
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {"heap_bytes": int(info.arena), "mmapped_bytes": int(info.hblkhd), "in_use_bytes": int(info.uordblks),
            "free_held_bytes": int(info.fordblks), "trimmable_bytes": int(info.keepcost)}


_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_PAGE_BYTES = 4096


def _whole_pages(tensor: Any) -> tuple[int, int]:
    """``(first, last)`` addresses of the whole pages inside ``tensor``'s bytes (``last`` exclusive;
    ``first >= last`` when none is whole)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return -(-start // _PAGE_BYTES) * _PAGE_BYTES, end // _PAGE_BYTES * _PAGE_BYTES


def _page_span(tensor: Any) -> tuple[int, int]:
    """``(first, length)`` of the page-rounded range covering ``tensor``'s bytes."""
    start = tensor.data_ptr() // _PAGE_BYTES * _PAGE_BYTES
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return start, -(-(end - start) // _PAGE_BYTES) * _PAGE_BYTES


def release_pages(tensor: Any) -> int:
    """Return the whole pages under a CPU tensor to the OS; they read as zero until written again.

    Only for memory torch got from ``malloc`` (private anonymous pages): pinned or device tensors
    and tensors smaller than two pages are left alone. The partial pages at both ends (shared with
    the allocator's chunk header or a neighbour) keep their contents.

    Args:
        tensor: a contiguous CPU tensor whose contents are no longer needed.

    Returns:
        Bytes released (0 when nothing was done).
    """
    libc = _libc()
    if libc is None or tensor is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    try:
        if tensor.is_pinned():
            return 0
    except RuntimeError:  # no pinned-memory backend in this torch build: plain malloc memory
        pass
    first, last = _whole_pages(tensor)
    if last - first < 2 * _PAGE_BYTES:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) != 0:
        return 0
    return last - first


@functools.lru_cache(maxsize=1)
def _memory_calls() -> Any | None:
    libc = _libc()
    if libc is None or not all(hasattr(libc, name) for name in ("mlock", "munlock", "madvise")):
        return None
    for name in ("mlock", "munlock", "madvise"):
        fn = getattr(libc, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + ([ctypes.c_int] if name == "madvise" else [])
        fn.restype = ctypes.c_int
    return libc


def can_park() -> bool:
    """Whether :func:`park_locked_pages` and :func:`lock_pages` work here (glibc with mlock/madvise)."""
    return _memory_calls() is not None


def park_locked_pages(tensor: Any, *, huge_pages: bool) -> int:
    """Unlock a locked buffer and hand its whole pages back to the OS, keeping the mapping.

    For page-locked host buffers that are idle between optimizer steps (the optimizer swap
    buffers of :class:`~memascend.integrations.deepspeed.optimizer_swapper.OnDemandSwapBufferManager`,
    allocated by DeepSpeed's aio handle with ``posix_memalign`` + ``mlock``). Freeing them instead
    (DeepSpeed's ``free_cpu_locked_tensor``) unmaps them, and the next step's
    ``new_cpu_locked_tensor`` faults 4 KiB pages in again: a quarter of a million faults per GiB.
    Parking keeps the buffer (same address, still known to the aio handle, so I/O needs no bounce
    buffer) and, with ``huge_pages``, marks it ``MADV_HUGEPAGE`` first, so :func:`lock_pages`
    faults its 2 MiB-aligned stretches in as 2 MiB pages.

    Args:
        tensor: a contiguous CPU tensor whose contents are no longer needed (private anonymous
            memory: after this, its released pages read as zero).
        huge_pages: ask for transparent huge pages on the range (kernel THP mode ``madvise`` or
            ``always``).

    Returns:
        Bytes of whole pages released (0 when nothing was done: no glibc, or fewer than two pages).

    Raises:
        OSError: ``munlock`` or ``madvise(MADV_DONTNEED)`` failed (errno in the message).
    """
    libc = _memory_calls()
    if libc is None or tensor is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    start, length = _page_span(tensor)
    first, last = _whole_pages(tensor)
    if last - first < 2 * _PAGE_BYTES:
        return 0
    if libc.munlock(ctypes.c_void_p(start), ctypes.c_size_t(length)) != 0:
        raise OSError(ctypes.get_errno(), f"munlock of {length} bytes at {start:#x} failed")
    if huge_pages:
        # Best effort: EINVAL where the kernel has no THP; the pages are then 4 KiB ones.
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_HUGEPAGE)
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) of {last - first} bytes at {first:#x} failed")
    return last - first


def lock_pages(tensor: Any) -> int:
    """``mlock`` the pages under a CPU tensor (faulting them in): the inverse of :func:`park_locked_pages`.

    Returns:
        Bytes locked (the page-rounded span).

    Raises:
        UserError: the kernel refused (``RLIMIT_MEMLOCK`` too low for the optimizer's swap buffers,
            or out of memory), with the size and the limit to raise.
    """
    libc = _memory_calls()
    if libc is None:
        return 0
    start, length = _page_span(tensor)
    if libc.mlock(ctypes.c_void_p(start), ctypes.c_size_t(length)) != 0:
        err = ctypes.get_errno()
        raise UserError(f"cannot lock {length / 2**20:.1f} MiB for an optimizer swap buffer "
                        f"({os.strerror(err) if err else 'mlock failed'}); raise the memlock limit "
                        f"(ulimit -l, LimitMEMLOCK=) or lower zero_optimization.sub_group_size")
    return length


def resident_bytes(tensor: Any) -> int | None:
    """Bytes of a CPU tensor's whole pages that are resident in RAM now (``mincore``).

    A buffer that was allocated but never written (``torch.empty`` of a large size, released
    pages) occupies address space, not memory; this is what it costs in RSS.

    Returns:
        Resident bytes, or ``None`` when it cannot be told (not a CPU tensor, no libc).
    """
    libc = _libc()
    if libc is None or tensor is None or tensor.device.type != "cpu":
        return None
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return 0
    start, length = _page_span(tensor)
    vec = (ctypes.c_ubyte * (length // _PAGE_BYTES))()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.mincore.restype = ctypes.c_int
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        return None
    return min(nbytes, sum(v & 1 for v in vec) * _PAGE_BYTES)
