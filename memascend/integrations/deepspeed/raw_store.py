"""The device store as the I/O layer of DeepSpeed 0.19.8's parameter and optimizer swappers.

Stock ZeRO-Infinity keeps one ``.swp`` file per swapped tensor under ``nvme_path`` and moves them
with the aio handles its swappers build from the module-level ``AsyncIOBuilder`` of
``runtime/swap_tensor/partitioned_param_swapper.py``, ``partitioned_optimizer_swapper.py`` and
``pipelined_optimizer_swapper.py`` (and of memascend's
:mod:`~memascend.integrations.deepspeed.param_swapper`). :func:`open_raw_store` creates a
:class:`~memascend.io.store.TensorStore` on a raw block device (or one preallocated file) for this
rank and, through the seam's registry, replaces:

* those ``AsyncIOBuilder`` names, with a builder whose handles are
  :class:`~memascend.integrations.deepspeed.swap_backend.StoreSwapHandle` over the store: every
  swap path becomes a store key (relative to the run's key folder), no ``.swp`` file is created;
* ``DeepSpeedEngine.save_checkpoint``/``load_checkpoint``, so checkpoints carry the optimizer
  state in the store (:mod:`~memascend.integrations.deepspeed.store_checkpoint`).

Everything else in DeepSpeed (which tensors are swapped, buffers, prefetching) is unchanged, so it
works with stock DeepSpeed (``--engine baseline``) and with memascend's optimizations alike.
DeepSpeed still sees ``nvme_path`` as a folder (the swappers ``makedirs``/``rmtree`` their
sub-folders there, checkpointing calls ``disk_usage``/``copytree`` on it): that *key folder* is a
small scratch directory that only ever holds empty sub-folders.

Apply it with :func:`memascend.integrations.deepspeed.apply_raw_store`; the seam's
:func:`~memascend.integrations.deepspeed.revert` restores the very same objects and closes the
store.

I/O accounting: the store counts its own transfers (:meth:`TensorStore.io_counters`: payload
bytes, and device bytes = each request rounded up to the store's ``align_bytes``), reported as
``nvme.store.train_io_bytes`` (the training window) and ``nvme.store.io_bytes`` (the whole run:
header and extent table writes, checkpoint export/import). A report's
``nvme.read_bytes``/``write_bytes`` come from ``/proc/self/io`` instead (the whole process,
page-cache misses of anything it touches included): compare swap traffic with
``train_io_bytes``. Against a folder run of the same job the device bytes differ only by alignment
padding: DeepSpeed's swap buffers are 512-byte aligned, the store's extents ``align_bytes`` (4 KiB).

Source: MemAscend (arXiv 2505.23254), direct NVMe engine.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memascend.errors import UserError
from memascend.integrations.deepspeed.patches import PatchRegistry
from memascend.integrations.deepspeed.store_checkpoint import (
    CHECKPOINT_SUBDIR,
    checkpoint_rank_dir,
    make_load_checkpoint,
    make_save_checkpoint,
    prepare_folder_resume,
    resolve_checkpoint_tag,
    stock_offload_rank_dir,
)
from memascend.integrations.deepspeed.swap_backend import StoreSwapHandle
from memascend.io import checkpoint as io_checkpoint
from memascend.io.runlock import RunLock, acquire_run_lock, pid_alive
from memascend.io.store import DEFAULT_QUEUE_DEPTH, DEFAULT_REQUEST_BYTES, TensorStore

__all__ = [
    "CHECKPOINT_SUBDIR",
    "FINETUNE_CREATED_FILE_UUID",
    "FINETUNE_OWNER_UUID",
    "KEY_ROOT_PREFIX",
    "RawStoreHandle",
    "checkpoint_rank_dir",
    "open_raw_store",
    "prepare_folder_resume",
    "resolve_checkpoint_tag",
    "stock_offload_rank_dir",
]

#: Owner identity written into the header of stores made by :func:`open_raw_store` on a target
#: memascend keeps (a block device, a file that existed before the run): a target left by an
#: earlier run carries it and is reused without ``allow_overwrite``; another tool's store is refused.
FINETUNE_OWNER_UUID = uuid.uuid5(uuid.NAMESPACE_URL, "https://memascend/finetune-swap-store")
#: Owner identity of a store *file* that :func:`open_raw_store` created: the file is memascend's
#: and is deleted when the store closes. One found at start-up (under a run lock nobody holds) was
#: left by a run that died; it is reused and deleted like a file of this run.
FINETUNE_CREATED_FILE_UUID = uuid.uuid5(uuid.NAMESPACE_URL, "https://memascend/finetune-swap-store-file")
#: Prefix of the scratch key folders in the temp dir; the creating pid is part of the name so the
#: folders of dead runs can be told apart and removed.
KEY_ROOT_PREFIX = "memascend-store-keys-"

#: Modules whose module-level ``AsyncIOBuilder`` builds the swappers' aio handles.
_BUILDER_MODULES = (
    "deepspeed.runtime.swap_tensor.partitioned_param_swapper",
    "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper",
    "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper",
    "memascend.integrations.deepspeed.param_swapper",
)


@dataclass(eq=False)
class RawStoreHandle:
    """The store a rank swaps to, as returned by :func:`open_raw_store`.

    Attributes:
        store: the rank's :class:`TensorStore`.
        target: the block device or file it lives on.
        key_root: the folder to give DeepSpeed as ``nvme_path`` (``offload_param``/``offload_optimizer``).
        world_rank: the rank that owns it.
        created_file: memascend created the store file (this run, or a run that died and left it):
            deleted at close. A file the user had is never deleted.
        owns_key_root: the key folder is a scratch folder of this handle (removed at close).
        run_lock: the exclusive lock on the target, held until close.
        restore_size_bytes: a file that existed empty is truncated back to this size at close.
        peak_used_bytes: the most bytes of extents in use seen by :meth:`sample_usage`.
    """

    store: TensorStore
    target: Path
    key_root: Path
    world_rank: int
    created_file: bool
    owns_key_root: bool
    run_lock: RunLock | None = None
    restore_size_bytes: int | None = None
    peak_used_bytes: int = 0
    train_io: Any = None
    """:class:`~memascend.io.store.IOCounters` of the training window (set by the runner)."""
    exported: list[str] = field(default_factory=list)
    imported: list[str] = field(default_factory=list)
    export_s: float = 0.0
    import_s: float = 0.0
    lock_handle_buffers: bool = False
    """The handles page-lock their ``new_cpu_locked_tensor`` buffers (``--engine baseline``: stock's
    aio handle does; :class:`~.swap_backend.StoreSwapHandle`)."""
    _closed: bool = False

    @property
    def is_block_device(self) -> bool:
        return self.store.info.is_block_device

    def new_aio_handle(self, *args: Any, **kwargs: Any) -> StoreSwapHandle:
        """Called as DeepSpeed calls ``aio_op.aio_handle(block_size=, queue_depth=, single_submit=,
        overlap_events=, intra_op_parallelism=)``; only block size and queue depth are kept (for the
        getters): the store's engine sets the real request size and depth."""
        names = ("block_size", "queue_depth", "single_submit", "overlap_events", "intra_op_parallelism")
        given = dict(zip(names, args), **kwargs)
        return StoreSwapHandle(
            self.store,
            block_size=given.get("block_size"),
            queue_depth=given.get("queue_depth"),
            key_root=self.key_root,
            lock_buffers=self.lock_handle_buffers,
        )

    def sample_usage(self) -> int:
        """Record and return the bytes of extents in use now."""
        used = self.store.used_bytes
        self.peak_used_bytes = max(self.peak_used_bytes, used)
        return used

    def key_prefix(self, folder: str | os.PathLike) -> str:
        """Store-key prefix of the swap paths under DeepSpeed folder ``folder`` (ends with ``/``)."""
        rel = os.path.relpath(os.path.abspath(folder), self.key_root)
        if rel.startswith(".."):
            raise UserError(f"swap folder {folder} is not under the store's key folder {self.key_root}")
        return "" if rel == "." else rel.rstrip(os.sep) + os.sep

    def export_checkpoint(self, tag_dir: str | os.PathLike, swap_folder: str | os.PathLike) -> Path:
        """Export the tensors swapped under ``swap_folder`` (the optimizer's), gradients excluded as
        stock's ``copytree`` excludes them, to ``<tag_dir>/memascend_store/rank<NN>/``.

        Returns:
            The manifest path.

        Raises:
            ChecksumError, StoreIOError: a tensor cannot be read back intact.
        """
        prefix = self.key_prefix(swap_folder)
        dest = checkpoint_rank_dir(tag_dir, self.world_rank)
        if dest.exists():
            shutil.rmtree(dest)
        t0 = time.monotonic()
        manifest = io_checkpoint.export_files(
            self.store, dest, select=lambda k: k.startswith(prefix) and "gradient" not in os.path.basename(k)
        )
        self.export_s += time.monotonic() - t0
        self.exported = [k for k in self.store.keys() if k.startswith(prefix) and "gradient" not in k]
        return manifest

    def import_swap_files(self, files: dict[str, Path], copies: list[Path]) -> list[str]:
        """Load a stock checkpoint's swap files (key -> file) into the store, then delete
        ``copies`` (what stock's ``copytree`` put into the key folder).

        Raises:
            UserError: a file is missing. StoreFullError: no room.
        """
        t0 = time.monotonic()
        try:
            keys = io_checkpoint.import_swap_files(self.store, files)
        finally:
            for path in copies:
                path.unlink(missing_ok=True)
        self.import_s += time.monotonic() - t0
        self.imported = keys
        self.sample_usage()
        return keys

    def import_checkpoint(self, rank_dir: str | os.PathLike, select: Any = None) -> list[str]:
        """Load a rank's export (:meth:`export_checkpoint`) into the store, replacing those keys
        (only the keys for which ``select`` returns true, if given).

        Raises:
            UserError: no manifest or a damaged file (names the tensor).
        """
        t0 = time.monotonic()
        keys = io_checkpoint.import_files(self.store, rank_dir, select=select)
        self.import_s += time.monotonic() - t0
        self.imported = keys
        self.sample_usage()
        return keys

    def report(self) -> dict:
        """The ``nvme.store`` section of a run report."""
        self.sample_usage()
        engine = self.store.engine
        return {
            "target": str(self.target),
            "kind": "block_device" if self.is_block_device else "file",
            "backend": engine.backend,
            "direct_io": bool(engine.direct),
            "queue_depth": int(engine.queue_depth),
            "request_bytes": int(engine.request_bytes),
            "align_bytes": int(self.store.align_bytes),
            "capacity_bytes": int(self.store.capacity_bytes),
            "used_bytes": int(self.store.used_bytes),
            "peak_used_bytes": int(self.peak_used_bytes),
            "tensors": len(self.store),
            "enable_crc": bool(self.store.enable_crc),
            "checkpoint_exported_tensors": len(self.exported),
            "checkpoint_imported_tensors": len(self.imported),
            "checkpoint_export_s": self.export_s,
            "checkpoint_import_s": self.import_s,
            # the store's own byte counters (see the module doc, "I/O accounting")
            "io_bytes": self.store.io_counters().as_dict(),
            "train_io_bytes": self.train_io.as_dict() if self.train_io is not None else None,
        }

    def close(self) -> None:
        """Free every key, close the store (the header stays, marking a kept target as this
        owner's store for the next run), delete a store file memascend created (never one the user
        had: that one is kept, or truncated back to empty if it was empty), remove the key folder
        and release the run lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                self.store.wait_all()
                for key in self.store.keys():
                    self.store.free(key)
            finally:
                self.store.close()
        finally:
            if self.created_file and not self.is_block_device:
                self.target.unlink(missing_ok=True)
            elif self.restore_size_bytes is not None and not self.is_block_device:
                with contextlib.suppress(OSError):
                    os.truncate(self.target, self.restore_size_bytes)
            if self.owns_key_root:
                shutil.rmtree(self.key_root, ignore_errors=True)
            if self.run_lock is not None:
                self.run_lock.release()


class _StoreOp:
    """What ``AsyncIOBuilder().load()`` returns while the store is applied: ``aio_handle(...)``."""

    def __init__(self, handle: RawStoreHandle) -> None:
        self.aio_handle = handle.new_aio_handle


def _make_builder(handle: RawStoreHandle) -> type:
    op = _StoreOp(handle)

    class StoreIOBuilder:
        """Stands in for ``deepspeed.ops.op_builder.AsyncIOBuilder`` in the swapper modules."""

        NAME = "memascend_nvme_io"

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def load(self, verbose: bool = True) -> _StoreOp:
            return op

        def is_compatible(self, verbose: bool = False) -> bool:
            return True

    return StoreIOBuilder


def open_raw_store(
    registry: PatchRegistry,
    target: str | os.PathLike,
    *,
    world_rank: int,
    allow_overwrite: bool = False,
    enable_crc: bool = True,
    size_bytes: int | None = None,
    key_root: str | os.PathLike | None = None,
    queue_depth: int = DEFAULT_QUEUE_DEPTH,
    request_bytes: int = DEFAULT_REQUEST_BYTES,
    backend: str = "auto",
    min_capacity_bytes: int | None = None,
    lock_handle_buffers: bool = False,
) -> RawStoreHandle:
    """Create this rank's store on ``target`` and make DeepSpeed's swappers use it, patching through
    ``registry``. Callers go through :func:`memascend.integrations.deepspeed.apply_raw_store`, which
    passes the seam's registry and refuses a second store; the seam's ``revert()`` undoes this and
    closes the store.

    Call before ``deepspeed.zero.Init``/``deepspeed.initialize``, giving DeepSpeed ``handle.key_root``
    as ``nvme_path`` (swappers built earlier keep their aio handles).

    Args:
        registry: where the patches are recorded.
        target: raw block device (``/dev/nvme0n1p3``, a loop device) or a file (created and
            preallocated with ``posix_fallocate`` to ``size_bytes``). One per rank.
        world_rank: this process's rank (names the checkpoint export folder).
        allow_overwrite: accept a target carrying a filesystem, a partition table, another owner's
            store or, for a file, any content (the file is then kept at close). A store left by an
            earlier run's raw store is reused without it. A mounted or otherwise held
            device, and a target another run holds the run lock of, are refused regardless.
        enable_crc: CRC32C per extent, checked on every read.
        size_bytes: file size (required for a file target that does not exist; ignored for devices).
        key_root: folder DeepSpeed will see as ``nvme_path`` (default: a new temporary folder,
            removed by :meth:`RawStoreHandle.close`).
        queue_depth, request_bytes, backend: engine settings (see :meth:`TensorStore.create`).
        min_capacity_bytes: refuse a target with less store space, before writing to it.
        lock_handle_buffers: the swap handles page-lock their buffers as stock's (``--engine baseline``).

    A refused target is left exactly as it was (a file this call created is removed).

    Returns:
        The handle (store, key folder, checkpoint export/import, report, close).

    Raises:
        DeviceRefusedError: the target is in use or carries data (one line naming what was found).
        TargetBusyError: another live run holds the target's run lock.
        UserError: an unusable target.
    """
    path = Path(target)
    existed = path.exists()
    # Locked before anything is read or written; a new file is created empty by the lock itself.
    run_lock = acquire_run_lock(path, create_file=not existed, what="--nvme-path")
    store = None
    mark = len(registry)
    try:
        prior = _prior_store_kind(path) if existed else "new"
        store = _create_store(path, prior, size_bytes=size_bytes, allow_overwrite=allow_overwrite,
                              queue_depth=queue_depth, request_bytes=request_bytes, enable_crc=enable_crc,
                              backend=backend, min_capacity_bytes=min_capacity_bytes)
        handle = _new_handle(store, path, prior, run_lock, key_root=key_root, world_rank=world_rank,
                             lock_handle_buffers=lock_handle_buffers)
        _patch_deepspeed(registry, handle)
    except BaseException:
        _undo_open(registry, mark, store, path, existed=existed, run_lock=run_lock)
        raise
    return handle


def _new_handle(store: TensorStore, path: Path, prior: str, run_lock: RunLock, *,
                key_root: str | os.PathLike | None, world_rank: int, lock_handle_buffers: bool) -> RawStoreHandle:
    """The handle of ``store`` on ``path``, with its key folder (:func:`_make_key_root`). What its
    close deletes or restores follows from the target's ``prior`` kind (:func:`_prior_store_kind`):
    a new or leftover file is deleted, a file that was empty is truncated back to 0 bytes; a scratch
    key folder (``key_root`` not given) is removed."""
    return RawStoreHandle(
        store=store,
        target=path,
        key_root=_make_key_root(key_root, world_rank),
        world_rank=world_rank,
        created_file=prior in ("new", "leftover"),
        owns_key_root=key_root is None,
        run_lock=run_lock,
        restore_size_bytes=0 if prior == "empty" else None,
        lock_handle_buffers=lock_handle_buffers,
    )


def _undo_open(registry: PatchRegistry, mark: int, store: TensorStore | None, path: Path, *,
               existed: bool, run_lock: RunLock) -> None:
    """Undo a failed :func:`open_raw_store`: the patches recorded after ``mark`` are restored, the
    store (if created) closed, the target file removed if the call created it, the run lock released."""
    registry.restore_after(mark)
    if store is not None:
        store.close()
    if not existed:
        path.unlink(missing_ok=True)
    run_lock.release()


def _create_store(path: Path, prior: str, **options: Any) -> TensorStore:
    """:meth:`TensorStore.create` on ``path`` with the owner identity its ``prior`` kind calls for
    (:func:`_prior_store_kind`; a new or leftover file is memascend's, deleted at close)."""
    created = prior in ("new", "leftover")
    if prior == "leftover":
        _note(f"--nvme-path {path} holds the store of an earlier memascend run that did not finish; "
              "reusing it (it is deleted at exit)")
    return TensorStore.create(path, owner_uuid=FINETUNE_CREATED_FILE_UUID if created else FINETUNE_OWNER_UUID,
                              **options)


def _make_key_root(key_root: str | os.PathLike | None, world_rank: int) -> Path:
    """The key folder (created if missing, resolved): ``key_root``, or a new scratch folder in the
    temp dir named after the rank and pid (scratch folders of dead runs are removed first)."""
    if key_root is None:
        _remove_dead_key_roots()
        root = Path(tempfile.mkdtemp(prefix=f"{KEY_ROOT_PREFIX}rank{world_rank}-pid{os.getpid()}-"))
    else:
        root = Path(key_root)
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve()


def _prior_store_kind(path: Path) -> str:
    """What an existing target holds: ``device``, ``empty`` (a file of 0 bytes), ``leftover`` (a
    store file memascend created in a run that is gone: the run lock was free), ``store`` (a kept
    store or another owner's: :meth:`TensorStore.create` decides) or ``data``."""
    from memascend.io.device import probe_info, read_head
    from memascend.io.engine import crc_bytes
    from memascend.io.header import STORE_MAGIC, StoreHeader

    if probe_info(path).is_block_device:
        return "device"
    if path.stat().st_size == 0:
        return "empty"
    head = read_head(path, 4096)
    if head[:8] != STORE_MAGIC:
        return "data"
    try:
        owner = StoreHeader.unpack(head, crc_bytes).owner_uuid
    except UserError:
        return "data"
    return "leftover" if owner == FINETUNE_CREATED_FILE_UUID else "store"


def _remove_dead_key_roots() -> None:
    """Remove the scratch key folders of runs whose process is gone (they hold only empty
    sub-folders; a live run's folder is left alone)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{KEY_ROOT_PREFIX}rank*-pid*-*"):
        pid_part = folder.name.split("-pid", 1)[1].split("-", 1)[0]
        if pid_part.isdigit() and not pid_alive(int(pid_part)):
            shutil.rmtree(folder, ignore_errors=True)


def _note(message: str) -> None:
    print(f"memascend: note: {message}", file=sys.stderr, flush=True)


def _patch_deepspeed(registry: PatchRegistry, handle: RawStoreHandle) -> None:
    builder = _make_builder(handle)
    for name in _BUILDER_MODULES:
        registry.patch(importlib.import_module(name), "AsyncIOBuilder", builder)

    from deepspeed.runtime.engine import DeepSpeedEngine

    registry.patch(DeepSpeedEngine, "save_checkpoint", make_save_checkpoint(DeepSpeedEngine.save_checkpoint, handle))
    registry.patch(DeepSpeedEngine, "load_checkpoint", make_load_checkpoint(DeepSpeedEngine.load_checkpoint, handle))
