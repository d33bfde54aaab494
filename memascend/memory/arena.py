"""Exact-size pinned host memory: the arena that serves every pinned allocation on the offload path.

Source: MemAscend (arXiv 2505.23254), pinned-memory management. Replaces torch's pinning
(``Tensor.pin_memory`` / ``get_accelerator().pin_memory``), whose CachingHostAllocator rounds every
block up to a power of two (pytorch #95823, #150517: a 129.5 MB tensor pins 256 MB), and DeepSpeed's
``AsyncIOBuilder().load().new_cpu_locked_tensor`` (posix_memalign + mlock per tensor, never
registered with CUDA).

The arena maps a few large regions (hugetlbfs pages when ``HugePages_Free`` covers a region, else
transparent hugepages, else plain pages), locks them with ``mlock``, registers each region once with
``cudaHostRegister`` when a CUDA runtime and device are present (libcudart is loaded at run time),
and hands out 4 KiB-aligned blocks of the exact size asked for (rounded to 4 KiB only, for
O_DIRECT) from a best-fit free list that coalesces neighbours.

Lifetime: a tensor from :meth:`PinnedArena.allocate` owns its block through its storage. The block
returns to the free list when the last tensor viewing that storage is destroyed, so a view that
outlives :meth:`PinnedArena.free` can never read reused memory. :meth:`PinnedArena.free` detaches
the given tensor from its storage at once (it becomes an empty tensor); with no other view alive,
the block is back in the free list when ``free`` returns. The swappers allocate long-lived
buffers and free them explicitly; temporary pinned tensors may simply be dropped.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from memascend.errors import UserError
from memascend.ops import pinned_arena as _op

#: Alignment of every block (bytes): O_DIRECT needs the logical block size, 4 KiB covers NVMe.
ALIGN_BYTES = 4096
#: Regions are multiples of this (bytes): the x86-64 hugepage size.
REGION_ALIGN_BYTES = 2 << 20
#: Size of a region mapped on demand when no free block fits (bytes).
DEFAULT_REGION_BYTES = 64 << 20


class PinnedMemoryError(UserError):
    """The host cannot provide the pinned memory asked for (memlock limit too low, mmap failed).

    The message is one line naming the memlock limit and the bytes needed.
    """


@dataclass(frozen=True, kw_only=True)
class ArenaStats:
    """A snapshot of the arena's accounting; all sizes in bytes."""

    requested_bytes: int
    """Sum of the exact sizes asked for by live allocations."""
    in_use_bytes: int
    """Bytes held by live allocations (each rounded up to 4 KiB)."""
    peak_in_use_bytes: int
    """High-water mark of ``in_use_bytes``."""
    reserved_bytes: int
    """Bytes mapped in regions (what the arena costs the host)."""
    peak_reserved_bytes: int
    """High-water mark of ``reserved_bytes``."""
    locked_bytes: int
    """Bytes of regions locked in RAM (``mlock``, or hugetlbfs pages, which never swap)."""
    registered_bytes: int
    """Bytes of regions registered with ``cudaHostRegister`` (0 without a usable CUDA device)."""
    hugetlb_bytes: int
    """Bytes of regions backed by hugetlbfs pages (``MAP_HUGETLB``)."""
    thp_bytes: int
    """Bytes of regions advised ``MADV_HUGEPAGE`` (transparent hugepages)."""
    free_bytes: int
    """``reserved_bytes - in_use_bytes``."""
    largest_free_bytes: int
    """Largest free block: the biggest allocation served without growing."""
    num_regions: int
    num_allocations: int
    num_free_blocks: int

    @property
    def fragmentation_ratio(self) -> float:
        """External fragmentation, ``1 - largest_free_bytes / free_bytes`` (0.0 when nothing is free)."""
        return 0.0 if self.free_bytes == 0 else 1.0 - self.largest_free_bytes / self.free_bytes

    @property
    def rounding_waste_bytes(self) -> int:
        """Bytes lost to 4 KiB rounding of live allocations: ``in_use_bytes - requested_bytes``."""
        return self.in_use_bytes - self.requested_bytes


@dataclass(frozen=True, kw_only=True)
class ArenaRegion:
    """One mapped region."""

    base: int
    """Start address."""
    size_bytes: int
    backing: str
    """``"hugetlb"``, ``"thp"`` or ``"pages"``."""
    locked: bool
    registered: bool


class PinnedArena:
    """Exact-size, 4 KiB-aligned, locked (and CUDA-registered where possible) host memory.

    Thread-safe. Tensors keep the arena alive: dropping the arena object while tensors live is safe.

    Args:
        region_bytes: size of a region mapped when no free block fits, rounded up to 2 MiB.
            An allocation larger than this gets a region of its own size.
        enable_hugetlb: back a region with hugetlbfs pages when ``HugePages_Free`` covers it.
        enable_thp: otherwise advise transparent hugepages (``MADV_HUGEPAGE``).
        enable_mlock: lock regions in RAM; without it the memory is merely aligned.
        enable_cuda_register: ``cudaHostRegister`` each region when a CUDA device is usable.
        release_empty_before_growing: before mapping a region for a request no free block fits,
            unmap regions without a live allocation (largest first) until as many bytes as the
            new region are released, so idle memory is replaced instead of added to (what the
            host block cache does, :mod:`memascend.memory.host_cache`).

    Raises:
        ValueError: ``region_bytes`` is not positive.
        memascend.ops.build.OpBuildError: the C++ op cannot be built.
    """

    def __init__(
        self,
        *,
        region_bytes: int = DEFAULT_REGION_BYTES,
        enable_hugetlb: bool = True,
        enable_thp: bool = True,
        enable_mlock: bool = True,
        enable_cuda_register: bool = True,
        release_empty_before_growing: bool = False,
    ) -> None:
        if not isinstance(region_bytes, int) or region_bytes <= 0:
            raise ValueError(f"region_bytes must be a positive int, got {region_bytes!r}")
        if enable_cuda_register and torch.cuda.is_available():
            # torch answers is_pinned() False for any pointer until it has initialised CUDA itself,
            # even for a registered region (measured on an H100, torch 2.11 + CUDA 13): initialise it
            # first so DeepSpeed's is_pinned checks see the arena's tensors as pinned.
            torch.cuda.init()
        self._ext = _op.load().Arena(
            region_bytes,
            enable_hugetlb=enable_hugetlb,
            enable_thp=enable_thp,
            enable_mlock=enable_mlock,
            enable_cuda_register=enable_cuda_register,
            release_empty_before_growing=release_empty_before_growing,
        )

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D CPU tensor of exactly ``numel`` elements of ``dtype`` in arena memory.

        Contents are uninitialised (zero on first use of a region, stale after reuse).

        Args:
            numel: number of elements, >= 0 (0 still takes one 4 KiB granule).
            dtype: any torch dtype with a fixed element size.

        Returns:
            Tensor of shape ``(numel,)``; ``data_ptr() % 4096 == 0``.

        Raises:
            ValueError: ``numel`` is negative or not an int.
            PinnedMemoryError: a new region cannot be mapped or locked (memlock limit).
            RuntimeError: the arena is closed.
        """
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        if self._ext.closed:
            raise RuntimeError("PinnedArena.allocate() after close()")
        try:
            return self._ext.allocate_tensor(numel, dtype)
        except RuntimeError as exc:
            raise PinnedMemoryError(str(exc)) from exc

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` in arena memory, same shape and dtype (exact-size ``pin_memory``).

        Raises:
            PinnedMemoryError: as :meth:`allocate`.
        """
        out = self.allocate(tensor.numel(), tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out

    def free(self, tensor: torch.Tensor) -> None:
        """Detach ``tensor`` from its arena block and return the block once no view holds it.

        ``tensor`` becomes an empty tensor. If no other tensor views the same storage, the block is
        back in the free list (coalesced) when this returns; otherwise when the last view dies.

        Raises:
            ValueError: ``tensor`` does not view a live block of this arena.
        """
        base = tensor.untyped_storage().data_ptr()
        if not self._ext.is_live(base):
            raise ValueError("tensor does not view a live allocation of this PinnedArena")
        with torch.no_grad():
            tensor.set_()

    def reserve(self, nbytes: int) -> int:
        """Make sure a free block of ``nbytes`` exists; map one region of that size if not.

        Lets a pool that knows its total size up front get one exactly sized region instead of
        growing by ``region_bytes`` steps.

        Returns:
            Bytes newly mapped (``round_up(nbytes, 2 MiB)``), or 0 when a block already fits.

        Raises:
            PinnedMemoryError: the region cannot be mapped or locked.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        try:
            return self._ext.reserve(nbytes)
        except RuntimeError as exc:
            raise PinnedMemoryError(str(exc)) from exc

    def release_empty_regions(self) -> int:
        """Unmap regions without live allocations; returns the bytes released."""
        return self._ext.release_empty_regions()

    def close(self) -> None:
        """Stop allocating and unmap every region as soon as it holds no live allocation."""
        self._ext.close()

    def __enter__(self) -> PinnedArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queries ---------------------------------------------------------------------------------
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """True when all of ``tensor``'s bytes lie in a locked region of this arena.

        On a CUDA host the regions are also registered, so ``tensor.is_pinned()`` agrees there.
        """
        if tensor.device.type != "cpu":
            return False
        start = tensor.data_ptr()
        if tensor.numel() == 0:
            nbytes = 0
        else:  # the byte span the (possibly strided) view touches
            last = sum(
                (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
            )
            nbytes = (last + 1) * tensor.element_size()
        for region in self.regions():
            if region.base <= start and start + nbytes <= region.base + region.size_bytes:
                return region.locked
        return False

    def stats(self) -> ArenaStats:
        """Current accounting (see :class:`ArenaStats`)."""
        return ArenaStats(**self._ext.stats())

    def regions(self) -> list[ArenaRegion]:
        """The mapped regions, in mapping order."""
        return [
            ArenaRegion(
                base=r["base"],
                size_bytes=r["bytes"],
                backing=r["backing"],
                locked=r["locked"],
                registered=r["registered"],
            )
            for r in self._ext.regions()
        ]

    def free_blocks(self) -> list[tuple[int, int]]:
        """Free blocks as ``(address, size_bytes)``, ordered by address."""
        return [tuple(b) for b in self._ext.free_blocks()]

    @property
    def region_bytes(self) -> int:
        """Size of an on-demand region, bytes (after rounding to 2 MiB)."""
        return self._ext.region_bytes

    @property
    def closed(self) -> bool:
        return self._ext.closed

    @property
    def cuda_status(self) -> str:
        """``"available: N CUDA device(s)"`` or ``"not available: <reason>"`` (cudaHostRegister)."""
        return self._ext.cuda_status


_default_lock = threading.Lock()
_default: PinnedArena | None = None


def default_arena() -> PinnedArena:
    """The process-wide arena, created on first use with default settings.

    Install a differently configured one with :func:`set_default_arena`.
    """
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = PinnedArena()
        return _default


def set_default_arena(arena: PinnedArena | None) -> PinnedArena | None:
    """Make ``arena`` the process-wide arena (``None``: create a fresh default on next use).

    Returns:
        The previous default arena (not closed: its tensors stay valid).
    """
    global _default
    with _default_lock:
        previous, _default = _default, arena
        return previous

