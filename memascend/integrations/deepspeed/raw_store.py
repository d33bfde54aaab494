"""The device store as the I/O layer of DeepSpeed 0.19.8's parameter and optimizer swappers.

Stock ZeRO-Infinity keeps one ``.swp`` file per swapped tensor under ``nvme_path`` and moves them
with the aio handle the swappers build from the module-level ``AsyncIOBuilder`` of
``runtime/swap_tensor/partitioned_param_swapper.py``, ``partitioned_optimizer_swapper.py`` and
``pipelined_optimizer_swapper.py`` (and of memascend's own
:mod:`~memascend.integrations.deepspeed.param_swapper`). :func:`apply_raw_store` creates a
:class:`~memascend.io.store.TensorStore` on a raw block device (or one preallocated file) for this
rank and replaces those ``AsyncIOBuilder`` names with a builder whose handles are
:class:`~memascend.integrations.deepspeed.swap_backend.StoreSwapHandle` over that store: every swap path becomes a store
key (relative to the run's key folder), no ``.swp`` file is created. Everything else in DeepSpeed
(which tensors are swapped, buffers, prefetching) is unchanged, so it works with stock DeepSpeed
(``--engine baseline``) and with memascend's memory seam alike.

DeepSpeed still sees ``nvme_path`` as a folder: the swappers ``makedirs``/``rmtree`` their
sub-folders there and checkpointing calls ``disk_usage``/``copytree`` on it. That folder, the *key
folder*, is a small scratch directory that only ever holds empty sub-folders.

Checkpoints (``DeepSpeedEngine.save_checkpoint``/``load_checkpoint``) copy the optimizer's swap
folder with ``shutil.copytree``, which here is empty. Two more patches carry the state:
``save_checkpoint`` then exports the optimizer's swapped tensors (gradients excluded, as stock) to
``<save_dir>/<tag>/memascend_store/rank<NN>/`` (:mod:`memascend.io.checkpoint`: one ``.bin`` per
tensor and a manifest with CRC32Cs); ``load_checkpoint`` notes the folder, and
``DeepSpeedZeroOptimizer_Stage3.reset_swap_buffers`` (which stock ``load_checkpoint`` calls right
after its ``copytree``) imports it first, so the state is in the store at the very point stock
would have copied the files.

Resume works across kinds. A raw-store run resuming a folder-of-files checkpoint imports the
stock ``<tag>/offloaded_tensors/rank<NN>/*.swp`` files into the store at the same point (and deletes
the copies stock's ``copytree`` put into the key folder); a folder-of-files run resuming a raw-store
checkpoint calls :func:`prepare_folder_resume` before ``load_checkpoint``, which writes the export's
tensors as the ``.swp`` files stock then reads. A checkpoint with neither (saved with the optimizer
state in DRAM) is refused with one line.

I/O accounting. A run report's ``nvme.read_bytes``/``write_bytes`` come from ``/proc/self/io``
over the training window: bytes the whole process (every thread, io_uring's io-wq workers
included) sent to or fetched from the storage layer, including page-cache misses of anything
else the process touches then (shared libraries, Python modules, lazily loaded code), and not
counting reads served from the page cache. The store counts its own transfers
(:meth:`TensorStore.io_counters`: payload bytes, and device bytes = each request rounded up to the
store's ``align_bytes``), reported as ``nvme.store.train_io_bytes`` (the same window) and
``nvme.store.io_bytes`` (whole run: header and extent table writes, checkpoint export/import).

Why a raw-store run shows slightly more ``/proc/self/io`` bytes than a folder run of the same
job: alignment padding, nothing else. The store moves each tensor as one extent whose length is
rounded up to 4 KiB (``align_bytes``; the engine zero-fills the tail on write and reads it back),
whereas DeepSpeed's aio on ext4 only needs the 512-byte logical block for O_DIRECT. DeepSpeed's
optimizer swap buffers are 512-aligned, not 4 KiB-aligned (llama-tiny: three 13,109,248-byte
buffers, 2,048 bytes past a 4 KiB boundary), so every transfer of one costs 2,048 extra device
bytes. The header (4 KiB) and extent table are written at create and close, outside the window;
CRCs live in the extent table, not next to the data; bounce buffers (the last request of such a
buffer is staged through one) cost a copy, not I/O. Measured on 2 CPU cores, ext4 on virtio (``memascend finetune
--from-scratch llama-tiny --seq-len 32 --micro-batch 2 --eval-blocks 2 --no-save-model --dtype bf16
--steps 4 --nvme-path DIR|FILE.store``, DeepSpeed 0.19.8, memascend engine): folder run
181,432,320 B read / 207,654,912 B written; store run 181,444,608 / 207,667,200, exactly the
store's ``train_io_bytes`` device counters, whose payload is 181,424,128 / 207,642,624 (padding
20,480 / 24,576 B = 10 reads and 12 writes x 2,048 B). The folder run's own excess over the same
payload (8,192 / 12,288 B) is filesystem metadata and other page-cache misses. Compare swap
traffic with ``train_io_bytes``; the padding scales with transfers of non-4-KiB-multiple buffers
(at most 4 KiB - 512 B each).

All patches go through a :class:`~memascend.integrations.deepspeed.patches.PatchRegistry` of this
module and :func:`revert_raw_store` restores the very same objects.

Source: MemAscend (arXiv 2505.23254), direct NVMe engine.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memascend.errors import UserError
from memascend.integrations.deepspeed.patches import PatchRecord, PatchRegistry
from memascend.integrations.deepspeed.swap_backend import StoreSwapHandle
from memascend.io import checkpoint as store_checkpoint
from memascend.io.durable import write_text_durable
from memascend.io.runlock import RunLock, acquire_run_lock, pid_alive
from memascend.io.store import DEFAULT_QUEUE_DEPTH, DEFAULT_REQUEST_BYTES, TensorStore

#: Owner identity written into the header of stores made by :func:`apply_raw_store` on a target
#: memascend keeps (a block device, a file that existed before the run): a target left by an
#: earlier run carries it and is reused without ``allow_overwrite``; another tool's store is refused.
FINETUNE_OWNER_UUID = uuid.uuid5(uuid.NAMESPACE_URL, "https://memascend/finetune-swap-store")
#: Owner identity of a store *file* that :func:`apply_raw_store` created: the file is memascend's
#: and is deleted when the store closes. One found at start-up (under a run lock nobody holds) was
#: left by a run that died; it is reused and deleted like a file of this run.
FINETUNE_CREATED_FILE_UUID = uuid.uuid5(uuid.NAMESPACE_URL, "https://memascend/finetune-swap-store-file")
#: Prefix of the scratch key folders in the temp dir; the creating pid is part of the name so the
#: folders of dead runs can be told apart and removed.
KEY_ROOT_PREFIX = "memascend-store-keys-"
#: Folder (under a checkpoint's tag folder) that holds the exported store of each rank.
CHECKPOINT_SUBDIR = "memascend_store"

#: Modules whose module-level ``AsyncIOBuilder`` builds the swappers' aio handles.
_BUILDER_MODULES = (
    "deepspeed.runtime.swap_tensor.partitioned_param_swapper",
    "deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper",
    "deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper",
    "memascend.integrations.deepspeed.param_swapper",
)

_lock = threading.Lock()
_registry = PatchRegistry()
_active: RawStoreHandle | None = None


def checkpoint_rank_dir(tag_dir: str | os.PathLike, world_rank: int) -> Path:
    """``<tag_dir>/memascend_store/rank<NN>``: where a rank's store export lives in a checkpoint."""
    return Path(tag_dir) / CHECKPOINT_SUBDIR / f"rank{world_rank:02d}"


def stock_offload_rank_dir(tag_dir: str | os.PathLike, world_rank: int) -> Path:
    """``<tag_dir>/offloaded_tensors/rank<NN>``: where stock ``save_checkpoint`` copies a rank's
    optimizer swap folder (``DeepSpeedEngine._save_checkpoint``'s ``copytree``)."""
    return Path(tag_dir) / "offloaded_tensors" / f"rank{world_rank:02d}"


def resolve_checkpoint_tag(load_dir: str | os.PathLike, tag: Any = None) -> str | None:
    """``tag``, else the contents of ``<load_dir>/latest`` (as ``load_checkpoint`` resolves it), else ``None``."""
    if tag is not None:
        return str(tag)
    latest = Path(load_dir) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def _swap_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


def _no_optimizer_state(tag_dir: Path, world_rank: int) -> UserError:
    return UserError(
        f"checkpoint {tag_dir} holds no NVMe optimizer state for rank {world_rank} (neither "
        f"{stock_offload_rank_dir(tag_dir, world_rank)} with swap files nor "
        f"{checkpoint_rank_dir(tag_dir, world_rank)}/manifest.json): it was saved by a run whose "
        "optimizer state was not on NVMe; resume it with the same --offload settings it was saved with"
    )


def prepare_folder_resume(engine: Any, load_dir: str | os.PathLike, tag: Any = None) -> list[Path]:
    """Let a folder-of-files run (no raw store applied) resume a checkpoint of a raw-store run.

    Stock ``load_checkpoint`` copies ``<tag>/offloaded_tensors/rank<NN>/`` into the optimizer's
    swap folder and reads the state back from there; a raw-store checkpoint keeps that folder
    empty and the state in ``<tag>/memascend_store/rank<NN>/``. Call this before
    ``engine.load_checkpoint``: it writes each exported tensor as the ``.swp`` file stock expects
    in the swap folder (CRC32C-checked), so stock's load then finds them. A stock checkpoint, or
    a run without the optimizer on NVMe, is left alone.

    Returns:
        The swap files written (empty when there was nothing to do).

    Raises:
        UserError: the checkpoint holds neither kind of optimizer state for this rank, or an
            export entry does not belong to this swap folder.
        ChecksumError: an export file is corrupt.
    """
    from memascend.io.checkpoint import copy_export_to_folder, read_manifest

    folder = _optimizer_swap_folder(engine)
    resolved = resolve_checkpoint_tag(load_dir, tag)
    if folder is None or resolved is None:
        return []
    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    tag_dir = Path(load_dir) / resolved
    if _swap_files(stock_offload_rank_dir(tag_dir, rank)):
        return []
    export = checkpoint_rank_dir(tag_dir, rank)
    if not (export / "manifest.json").is_file():
        if (tag_dir / CHECKPOINT_SUBDIR).is_dir():
            raise _incomplete_export(tag_dir, rank)
        if stock_offload_rank_dir(tag_dir, rank).is_dir():
            return []  # stock checkpoint of a run with nothing swapped
        raise _no_optimizer_state(tag_dir, rank)
    # Keys are relative to the saving run's key folder (= nvme_path): .../optimizer/rank<N>/<file>.
    want = Path(folder).parts[-2:]
    files = {}
    for entry in read_manifest(export):
        key = Path(entry["key"])
        if key.parent.parts[-2:] != want:
            raise UserError(
                f"checkpoint {tag_dir}: exported tensor '{entry['key']}' does not belong to this run's "
                f"optimizer swap folder ({'/'.join(want)}); resume with the same --nproc it was saved with"
            )
        files[entry["key"]] = Path(folder) / key.name
    return copy_export_to_folder(export, files)


@dataclass(eq=False)
class RawStoreHandle:
    """The store a rank swaps to, as returned by :func:`apply_raw_store`.

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
    _pending_import: Any = None
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
        manifest = store_checkpoint.export_files(
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
            keys = store_checkpoint.import_swap_files(self.store, files)
        finally:
            for path in copies:
                path.unlink(missing_ok=True)
        self.import_s += time.monotonic() - t0
        self.imported = keys
        self.sample_usage()
        return keys

    def import_checkpoint(self, rank_dir: str | os.PathLike) -> list[str]:
        """Load a rank's export (:meth:`export_checkpoint`) into the store, replacing those keys.

        Raises:
            UserError: no manifest or a damaged file (names the tensor).
        """
        t0 = time.monotonic()
        keys = store_checkpoint.import_files(self.store, rank_dir)
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


def apply_raw_store(
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
) -> RawStoreHandle:
    """Create this rank's store on ``target`` and make DeepSpeed's swappers use it.

    Call before ``deepspeed.zero.Init``/``deepspeed.initialize`` and give DeepSpeed
    ``handle.key_root`` as ``nvme_path``. Swappers built earlier keep their aio handles.

    Args:
        target: raw block device (``/dev/nvme0n1p3``, a loop device) or a file (created and
            preallocated with ``posix_fallocate`` to ``size_bytes``). One per rank.
        world_rank: this process's rank (names the checkpoint export folder).
        allow_overwrite: accept a target carrying a filesystem, a partition table, another owner's
            store or, for a file, any content (the file is then kept at close). A store left by an
            earlier :func:`apply_raw_store` is reused without it. A mounted or otherwise held
            device, and a target another run holds the run lock of, are refused regardless.
        enable_crc: CRC32C per extent, checked on every read.
        size_bytes: file size (required for a file target that does not exist; ignored for devices).
        key_root: folder DeepSpeed will see as ``nvme_path`` (default: a new temporary folder,
            removed by :meth:`RawStoreHandle.close`).
        queue_depth, request_bytes, backend: engine settings (see :meth:`TensorStore.create`).
        min_capacity_bytes: refuse a target with less store space, before writing to it.

    A refused target is left exactly as it was (a file this call created is removed).

    Returns:
        The handle (store, key folder, checkpoint export/import, report, close).

    Raises:
        DeviceRefusedError: the target is in use or carries data (one line naming what was found).
        TargetBusyError: another live run holds the target's run lock.
        UserError: already applied (call :func:`revert_raw_store`), or an unusable target.
    """
    global _active
    with _lock:
        if _active is not None:
            raise UserError("a raw store is already applied to DeepSpeed; call revert_raw_store() first")
        path = Path(target)
        existed = path.exists()
        # Locked before anything is read or written; a new file is created empty by the lock itself.
        run_lock = acquire_run_lock(path, create_file=not existed, what="--nvme-path")
        store = None
        try:
            prior = _prior_store_kind(path) if existed else "new"
            created = prior in ("new", "leftover")
            if prior == "leftover":
                _note(f"--nvme-path {path} holds the store of an earlier memascend run that did not finish; "
                      "reusing it (it is deleted at exit)")
            store = TensorStore.create(
                path,
                size_bytes=size_bytes,
                allow_overwrite=allow_overwrite,
                owner_uuid=FINETUNE_CREATED_FILE_UUID if created else FINETUNE_OWNER_UUID,
                queue_depth=queue_depth,
                request_bytes=request_bytes,
                enable_crc=enable_crc,
                backend=backend,
                min_capacity_bytes=min_capacity_bytes,
            )
            own_root = key_root is None
            if own_root:
                _remove_dead_key_roots()
                root = Path(tempfile.mkdtemp(prefix=f"{KEY_ROOT_PREFIX}rank{world_rank}-pid{os.getpid()}-"))
            else:
                root = Path(key_root)
            root.mkdir(parents=True, exist_ok=True)
            handle = RawStoreHandle(
                store=store,
                target=path,
                key_root=root.resolve(),
                world_rank=world_rank,
                created_file=created,
                owns_key_root=own_root,
                run_lock=run_lock,
                restore_size_bytes=0 if prior == "empty" else None,
            )
            _patch_all(handle)
        except BaseException:
            _registry.restore_all()
            if store is not None:
                store.close()
            if not existed:
                path.unlink(missing_ok=True)
            run_lock.release()
            raise
        _active = handle
        return handle


def _prior_store_kind(path: Path) -> str:
    """What an existing target holds: ``device``, ``empty`` (a file of 0 bytes), ``leftover`` (a
    store file memascend created in a run that is gone: the run lock was free), ``store`` (a kept
    store or another owner's: :meth:`TensorStore.create` decides) or ``data``."""
    from memascend.io.device import probe_info, read_head
    from memascend.io.header import STORE_MAGIC, StoreHeader
    from memascend.io.store import _crc_bytes

    if probe_info(path).is_block_device:
        return "device"
    if path.stat().st_size == 0:
        return "empty"
    head = read_head(path, 4096)
    if head[:8] != STORE_MAGIC:
        return "data"
    try:
        owner = StoreHeader.unpack(head, _crc_bytes).owner_uuid
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


def revert_raw_store(*, close: bool = False) -> None:
    """Restore every attribute :func:`apply_raw_store` patched; with ``close``, also close the
    store (:meth:`RawStoreHandle.close`). Safe to call twice."""
    global _active
    with _lock:
        _registry.restore_all()
        handle, _active = _active, None
    if close and handle is not None:
        handle.close()


def active_raw_store() -> RawStoreHandle | None:
    """The applied handle, or ``None``."""
    return _active


def raw_store_patch_records() -> tuple[PatchRecord, ...]:
    """The attribute patches in force (owner, name, original, replacement)."""
    return _registry.records()


def _patch_all(handle: RawStoreHandle) -> None:
    import importlib

    builder = _make_builder(handle)
    for name in _BUILDER_MODULES:
        module = importlib.import_module(name)
        _registry.patch(module, "AsyncIOBuilder", builder)

    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    _registry.patch(DeepSpeedEngine, "save_checkpoint", _make_save_checkpoint(DeepSpeedEngine.save_checkpoint, handle))
    _registry.patch(DeepSpeedEngine, "load_checkpoint", _make_load_checkpoint(DeepSpeedEngine.load_checkpoint, handle))
    _registry.patch(
        DeepSpeedZeroOptimizer_Stage3,
        "reset_swap_buffers",
        _make_reset_swap_buffers(DeepSpeedZeroOptimizer_Stage3.reset_swap_buffers, handle),
    )


def _optimizer_swap_folder(engine: Any) -> str | None:
    if not engine.zero_nvme_offload_optimizer():
        return None
    return engine.optimizer.optimizer_swapper.swap_folder


def _make_save_checkpoint(original, handle: RawStoreHandle):
    @functools.wraps(original)
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """Stock save with ``save_latest=False``, then the optimizer's swapped state exported from
        the store (the stock ``copytree`` of the swap folder copies an empty folder), then, once
        every rank's export is on disk (fsynced, manifest last), ``latest`` (stock 0.19.8 writes
        ``latest`` before returning, so a run killed during the export left a ``latest`` naming a
        checkpoint without its optimizer state)."""
        resolved = str(tag) if tag is not None else f"global_step{self.global_steps}"
        result = original(self, save_dir, resolved, client_state if client_state is not None else {},
                          False, exclude_frozen_parameters)
        folder = _optimizer_swap_folder(self)
        if folder is not None:
            handle.export_checkpoint(Path(save_dir) / resolved, folder)
        if save_latest:
            from deepspeed import comm as ds_comm

            several = ds_comm.is_initialized() and ds_comm.get_world_size() > 1
            if several:
                ds_comm.barrier()
            if self.global_rank == 0:
                _write_latest(Path(save_dir), resolved)
            if several:
                ds_comm.barrier()
        return result

    return save_checkpoint


def _write_latest(save_dir: Path, tag: str) -> None:
    """``<save_dir>/latest`` = ``tag``, atomically and durably (:func:`write_text_durable`)."""
    write_text_durable(save_dir / "latest", tag)


def _incomplete_export(tag_dir: Path, world_rank: int) -> UserError:
    return UserError(
        f"checkpoint {tag_dir} is incomplete: {checkpoint_rank_dir(tag_dir, world_rank)} has no manifest.json "
        "(the raw store's export of the optimizer state never finished); resume an earlier checkpoint"
    )


def _make_load_checkpoint(original, handle: RawStoreHandle):
    @functools.wraps(original)
    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        """Stock load; the checkpoint's optimizer state is imported into the store where stock
        copies files: the store export of a raw-store run, or the swap files of a folder-of-files
        run (stock's ``copytree`` copies those into the key folder first; they are deleted after
        the import)."""
        folder = _optimizer_swap_folder(self)
        resolved = resolve_checkpoint_tag(load_dir, tag)
        if folder is not None and resolved is not None:
            tag_dir = Path(load_dir) / resolved
            rank_dir = checkpoint_rank_dir(tag_dir, handle.world_rank)
            stock_files = _swap_files(stock_offload_rank_dir(tag_dir, handle.world_rank))
            if (rank_dir / "manifest.json").is_file():
                handle._pending_import = ("export", rank_dir)
            elif (tag_dir / CHECKPOINT_SUBDIR).is_dir():
                raise _incomplete_export(tag_dir, handle.world_rank)
            elif stock_files:
                prefix = handle.key_prefix(folder)
                files = {prefix + f.name: f for f in stock_files}
                copies = [Path(folder) / f.name for f in stock_files]
                handle._pending_import = ("swap_files", files, copies)
            elif not stock_offload_rank_dir(tag_dir, handle.world_rank).is_dir():
                raise _no_optimizer_state(tag_dir, handle.world_rank)
        try:
            return original(self, load_dir, tag, *args, **kwargs)
        finally:
            handle._pending_import = None

    return load_checkpoint


def _make_reset_swap_buffers(original, handle: RawStoreHandle):
    @functools.wraps(original)
    def reset_swap_buffers(self):
        """Import the pending store export, then stock (which reads the optimizer state back)."""
        pending, handle._pending_import = handle._pending_import, None
        if pending is not None and pending[0] == "export":
            handle.import_checkpoint(pending[1])
        elif pending is not None:
            handle.import_swap_files(pending[1], pending[2])
        return original(self)

    return reset_swap_buffers
