"""Host block cache: torch's CPU allocator for large host tensors (``csrc/pinned_arena/cpu_allocator.cpp``).

MemAscend (arXiv 2505.23254) section 4, "eradicating fragmentation", the allocator half. Torch's
default CPU allocator (c10 ``DefaultCPUAllocator``) takes every host tensor from glibc
``malloc``: a block over glibc's mmap threshold is mapped for the tensor and unmapped when it dies,
so every training step faults the same activation and gradient memory in again, page by page,
and zeroes it (on a virtual machine with free page reporting, the host backs each page again too);
a block under the threshold stays in glibc's arenas, which return memory only from the heap's top
and fragment. Handing the memory back between phases (:mod:`memascend.memory.host_allocator`)
bounds RSS but pays those faults every step.

:func:`install` puts a cache in front of torch's CPU allocator (``c10::SetCPUAllocator``): a
request of at least ``threshold_bytes`` gets a best-fit, 4 KiB-aligned block of an arena of
unlocked, unregistered regions (the pinned arena's sub-allocator configured without ``mlock``,
CUDA registration or hugetlb; ``MADV_HUGEPAGE`` when asked); smaller requests go to the allocator
it replaced. Freed blocks coalesce with free neighbours and keep their pages, so the next step's
tensors of the same shapes land on memory that is already resident: no fault, no zeroing, and a
footprint that is the step's largest set of live large tensors plus the cache's fragmentation
(:func:`stats`: ``reserved_bytes`` against ``peak_in_use_bytes``). A request no free block fits
first unmaps regions without a live block (largest first) where the region it needs would raise
the process's resident high-water mark, as many bytes as it would raise it by (``VmRSS + region -
VmHWM``): a phase whose tensors fit no block another phase left (the optimizer step's fp32 gradient
after the forward's activations) replaces that idle memory instead of adding to the peak, while
below the peak an earlier step reached the regions of every phase stay mapped and later steps reuse
their resident pages instead of faulting them in (and zeroing them) again. Nothing a computation
produces changes: only where host tensors live. The cache is process-wide and lives until exit;
:func:`uninstall` puts the replaced allocator back, and blocks still alive return to the cache
when they die.
"""

from __future__ import annotations

from typing import Any

import torch

from memascend.ops import pinned_arena as _op
from memascend.procfs import status_bytes

#: Requests of at least this many bytes come from the cache; smaller tensors stay with glibc. 64 KiB
#: rather than 1 MiB: a 16-bit hidden state of one 256-token sequence of a 1280-wide model is
#: 640 KiB, and such step tensors left to glibc's heap (under memascend's fixed 4 MiB mmap
#: threshold) fragment it: each pass faulted in more of its free pages than it had in use (a LoRA
#: run on llama-0.5b at 1 x 256: heap 465-641 MiB for 256-282 MiB in use, peak RSS 1.15-1.30 GiB;
#: with 64 KiB, heap 356-358 MiB and 1.01-1.04 GiB, same losses).
DEFAULT_THRESHOLD_BYTES = 64 << 10
#: Size of a cache region mapped on demand (a larger request gets a region of its own size).
DEFAULT_REGION_BYTES = 64 << 20


def install(threshold_bytes: int = DEFAULT_THRESHOLD_BYTES, region_bytes: int = DEFAULT_REGION_BYTES,
            enable_thp: bool = True) -> bool:
    """Serve torch's host tensors of at least ``threshold_bytes`` from the host block cache.

    Args:
        threshold_bytes: smallest request (bytes) the cache serves; > 0.
        region_bytes: bytes of a region mapped on demand, rounded up to 2 MiB.
        enable_thp: ``madvise(MADV_HUGEPAGE)`` on each region.
        The process's first install decides ``region_bytes`` and ``enable_thp`` for good.

    Returns:
        ``True`` when it was put in front of torch's allocator now, ``False`` when it already was
        (the threshold is updated).

    Raises:
        ValueError: ``threshold_bytes`` <= 0.
        memascend.ops.build.OpBuildError: the C++ op cannot be built.
    """
    if threshold_bytes <= 0:
        raise ValueError(f"threshold_bytes must be > 0, got {threshold_bytes}")
    return bool(_op.load().install_host_block_cache(int(threshold_bytes), int(region_bytes), bool(enable_thp)))


def uninstall() -> bool:
    """Put back the CPU allocator :func:`install` replaced; ``False`` if the cache was not in force."""
    return bool(_op.load().uninstall_host_block_cache())


def installed() -> bool:
    """Whether the cache is torch's CPU allocator now."""
    return bool(_op.load().host_block_cache_installed())


def owns(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage is a live block of the cache."""
    return tensor.device.type == "cpu" and bool(
        _op.load().host_block_cache_owns(tensor.untyped_storage().data_ptr()))


def release_empty(max_bytes: int | None = None) -> int:
    """Unmap the cache's regions that hold no live block, largest first, until at least
    ``max_bytes`` are given back (``None``: all of them); returns the bytes given back to the OS."""
    op = _op.load()
    return int(op.host_block_cache_release_empty() if max_bytes is None else op.host_block_cache_release_empty(max(0, int(max_bytes))))


def process_rss_and_peak_bytes(status_path: str = "/proc/self/status") -> tuple[int, int] | None:
    """This process's resident set and its high-water mark (``VmRSS``, ``VmHWM`` of
    ``/proc/self/status``), bytes; ``None`` where the file or the fields are missing."""
    try:
        usage = status_bytes({"VmRSS": "rss", "VmHWM": "peak"}, path=status_path)
    except (OSError, ValueError):
        return None
    return (usage["rss"], usage["peak"]) if len(usage) == 2 else None


def make_room(locked_bytes: int, *, within_peak: bool = True) -> int:
    """Before locking ``locked_bytes`` of buffers that do not come from the cache (the aio handle's
    or the pinned arena's): unmap idle cache regions (:func:`release_empty`) so the buffers take
    those pages instead of adding to the process's peak.

    With ``within_peak`` only what would raise the process's resident high-water mark is given back:
    ``VmRSS + locked_bytes - VmHWM`` bytes (:func:`process_rss_and_peak_bytes`), none while the
    buffers fit under the peak an earlier phase already reached. The cache then keeps its pages for
    the next forward, which would otherwise fault (and zero, and with transparent hugepages compact)
    them in again every step, and the peak stays what it was: a step that sets the peak releases
    exactly as much as without ``within_peak``. Without it (or where ``/proc/self/status`` cannot be
    read), ``locked_bytes`` are given back. Does nothing (returns 0) when the cache is not torch's
    allocator.

    Returns:
        Bytes given back to the OS.
    """
    if locked_bytes <= 0 or not installed():
        return 0
    need = locked_bytes
    if within_peak:
        usage = process_rss_and_peak_bytes()
        if usage is not None:
            rss_bytes, peak_bytes = usage
            need = min(locked_bytes, max(0, rss_bytes + locked_bytes - peak_bytes))
    return release_empty(need) if need > 0 else 0


def stats() -> dict[str, Any] | None:
    """The cache's counters, or ``None`` before the first :func:`install`.

    Returns:
        ``requested_bytes``/``in_use_bytes`` (live blocks, exact and 4 KiB-rounded),
        ``peak_in_use_bytes``, ``reserved_bytes``/``peak_reserved_bytes`` (mapped regions; the
        pages of free blocks stay resident once touched), ``free_bytes``, ``largest_free_bytes``,
        ``thp_bytes``, ``num_regions``, ``num_allocations``, ``num_free_blocks``,
        ``threshold_bytes``, ``num_served`` (blocks handed out since the first install),
        ``installed``.
    """
    result = _op.load().host_block_cache_stats()
    return None if result is None else dict(result)
