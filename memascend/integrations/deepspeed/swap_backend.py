"""An aio-handle-shaped adapter over :class:`~memascend.io.store.TensorStore` for DeepSpeed's swappers.

DeepSpeed 0.19.8's swappers (``AsyncPartitionedParameterSwapper``, ``PartitionedOptimizerSwapper``,
``PipelinedOptimizerSwapper``, ``runtime/swap_tensor/utils.py`` ``swap_in_tensors`` /
``swap_out_tensors``) talk to ``AsyncIOBuilder().load().aio_handle(...)`` through a small surface:
``async_pwrite(buffer, path, 0)`` / ``async_pread(buffer, path, 0)`` (each returns 0), ``wait()``
(returns how many operations completed), ``sync_pwrite`` / ``sync_pread``,
``new_cpu_locked_tensor`` / ``free_cpu_locked_tensor`` and a few getters. :class:`StoreSwapHandle`
offers that surface with the swap-file path used as the tensor key, so the raw store
(:mod:`~memascend.integrations.deepspeed.raw_store`) can substitute it for the aio handle and drop the
folder of ``.swp`` files. Unlike the stock handle, reading works on a raw block device, and every read is
checked against the CRC32C recorded at write time.

Source: MemAscend (arXiv 2505.23254), direct NVMe engine; replaces DeepSpeed's
``deepspeed_aio_handle_t`` (csrc/aio/py_lib) for swapping.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from memascend.errors import UserError
from memascend.io.errors import StoreError
from memascend.io.store import TensorStore, Ticket
from memascend.ops import nvme_io as _op

_LIBC = ctypes.CDLL(None, use_errno=True)


def _mlock(addr: int, nbytes: int) -> None:
    """``mlock(addr, nbytes)``, or a :class:`UserError` naming the memlock limit."""
    if _LIBC.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes)) != 0:
        err = ctypes.get_errno()
        raise UserError(f"mlock of a {nbytes}-byte swap buffer failed ({os.strerror(err)}): raise the memlock limit "
                        "(ulimit -l, limits.conf 'memlock', docker --ulimit memlock=-1) or grant CAP_IPC_LOCK")


class StoreSwapHandle:
    """DeepSpeed aio-handle look-alike; several handles may share one store (e.g. a read and a
    write handle, as ``AsyncPartitionedParameterSwapper`` creates).

    Args:
        store: the rank's device store.
        block_size: reported by :meth:`get_block_size` (bytes); the store's ``request_bytes``
            governs the real request size.
        queue_depth: reported by :meth:`get_queue_depth`; the store's engine governs the real one.
        key_root: folder that DeepSpeed sees as ``nvme_path``; swap paths under it are stored
            under their path relative to it (``zero_stage_3/optimizer/rank0/7.tensor.swp``), so
            keys stay the same from run to run (checkpoint export/import). ``None``: the path as
            given is the key.
        lock_buffers: page-lock (``mlock``) the buffers of :meth:`new_cpu_locked_tensor`, as stock's
            aio handle does (DeepSpeed 0.19.8 ``csrc/pin_memory/page_alloc.cpp``: ``posix_memalign``
            then ``mlock``; ``munlock`` when freed). On for ``--engine baseline``, so that stock on a raw
            target locks what stock on a swap folder locks; off for memascend, whose locked buffers come
            from the pinned arena.
    """

    def __init__(
        self,
        store: TensorStore,
        *,
        block_size: int | None = None,
        queue_depth: int | None = None,
        key_root: str | os.PathLike | None = None,
        lock_buffers: bool = False,
    ) -> None:
        self.store = store
        self._lock_buffers = lock_buffers
        self._block_size = block_size or store.engine.request_bytes
        self._queue_depth = queue_depth or store.engine.queue_depth
        self._key_root = None if key_root is None else os.path.abspath(key_root)
        self._lock = threading.Lock()
        self._pending: list[Ticket] = []
        # (start address, bytes) of the buffers handed out by new_cpu_locked_tensor: DeepSpeed
        # decides per buffer whether to stage it through one of its own (is_pinned).
        self._managed: dict[int, int] = {}

    def key(self, filename: str | os.PathLike) -> str:
        """The store key of swap path ``filename`` (relative to ``key_root`` when under it)."""
        name = str(filename)
        if self._key_root is not None:
            full = os.path.abspath(name)
            if full == self._key_root or full.startswith(self._key_root + os.sep):
                return os.path.relpath(full, self._key_root)
        return name

    # -- transfers ---------------------------------------------------------------------------
    def async_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        """Queue a write of the whole (contiguous, CPU) ``buffer`` under key ``filename``.

        Returns:
            0, as the stock handle (the swappers assert it).

        Raises:
            ValueError: ``file_offset`` != 0 (the swappers always write whole tensors at 0).
            memascend.io.errors.StoreFullError: no room on the device.
        """
        self._check_offset(file_offset)
        t = self.store.submit_write(self.key(filename), buffer)
        with self._lock:
            self._pending.append(t)
        return 0

    def async_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        """Queue a read of key ``filename`` into the start of ``buffer`` (which may be larger than
        what was written, as the swappers' aligned buffers are). Returns 0.

        Raises:
            KeyError: nothing was written under ``filename``.
            ValueError: ``file_offset`` != 0, or ``buffer`` too small.
        """
        self._check_offset(file_offset)
        t = self.store.submit_read(self.key(filename), buffer)
        with self._lock:
            self._pending.append(t)
        return 0

    def wait(self) -> int:
        """Wait for every operation queued on this handle.

        Returns:
            The number of operations completed (what the swappers compare with what they queued).

        Raises:
            memascend.io.errors.StoreIOError / ChecksumError: the first failure (after all have
                finished), naming the key (swap path) and the device offset.
        """
        with self._lock:
            pending, self._pending = self._pending, []
        first: StoreError | None = None
        for t in pending:
            try:
                self.store.wait(t)
            except StoreError as exc:
                first = first or exc
        if first is not None:
            raise first
        return len(pending)

    def sync_pwrite(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        """Write and wait; returns 1 (one operation)."""
        self._check_offset(file_offset)
        self.store.write(self.key(filename), buffer)
        return 1

    def sync_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:
        """Read and wait; returns 1 (one operation)."""
        self._check_offset(file_offset)
        self.store.read(self.key(filename), buffer)
        return 1

    def free(self, filename: str) -> None:
        """Release the extent of key ``filename`` (stock swappers leave dead files behind instead).

        Raises:
            KeyError: unknown key. ValueError: a transfer of it is still queued.
        """
        self.store.free(self.key(filename))

    # -- buffers -----------------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A 4 KiB-aligned CPU tensor of ``num_elem`` elements of ``example_tensor.dtype``, which
        the engine transfers in place (no bounce buffer). Page-locked with ``lock_buffers`` (as stock's
        handle), else not: pass tensors from the pinned arena (:mod:`memascend.memory.arena`) where
        locking is wanted.

        Raises:
            memascend.errors.UserError: ``lock_buffers`` and ``mlock`` failed (the memlock limit).
        """
        nbytes = int(num_elem) * example_tensor.element_size()
        tensor = _op.load().aligned_empty(nbytes).view(example_tensor.dtype)
        if self._lock_buffers and nbytes:
            _mlock(tensor.data_ptr(), nbytes)
        with self._lock:
            self._managed[tensor.data_ptr()] = nbytes
        return tensor

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Forget ``tensor`` as a handle buffer; the memory returns when its last reference goes.

        Returns:
            Whether ``tensor`` came from :meth:`new_cpu_locked_tensor` (as the stock handle).
        """
        with self._lock:
            nbytes = self._managed.pop(tensor.data_ptr(), None)
        if nbytes is not None and self._lock_buffers and nbytes:
            _LIBC.munlock(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes))
        return nbytes is not None

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """DeepSpeed's direct-I/O test (``deepspeed_io_handle_t::is_pinned``): a CPU tensor that
        torch reports pinned or that lies wholly inside a buffer of :meth:`new_cpu_locked_tensor`.
        The swappers stage other tensors through such buffers, as they do with the stock handle."""
        if buffer.device.type != "cpu":
            return False
        if buffer.is_pinned():
            return True
        start = buffer.data_ptr()
        end = start + buffer.numel() * buffer.element_size()
        with self._lock:
            return any(base <= start and end <= base + n for base, n in self._managed.items())

    # -- getters the swappers and DeepSpeed's config checks call -----------------------------
    def get_block_size(self) -> int:
        return self._block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return False

    def get_overlap_events(self) -> bool:
        return True

    def get_intra_op_parallelism(self) -> int:
        return 1

    def get_alignment(self) -> int:
        return self.store.align_bytes

    @staticmethod
    def _check_offset(file_offset: int) -> None:
        if file_offset != 0:
            raise ValueError(
                f"StoreSwapHandle stores whole tensors: file_offset must be 0, got {file_offset}"
            )
