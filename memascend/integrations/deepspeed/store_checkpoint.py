"""The raw store's checkpoints: DeepSpeed 0.19.8's save/load carry the optimizer state in the store.

``DeepSpeedEngine.save_checkpoint``/``load_checkpoint`` copy the optimizer's swap folder with
``shutil.copytree``, which with the raw store applied is empty. The wrappers made here (the seam
patches them in with the raw store, :mod:`~memascend.integrations.deepspeed.raw_store`) carry the
state instead:

* :func:`make_save_checkpoint` (``DeepSpeedEngine.save_checkpoint``): stock save, then the
  optimizer's swapped tensors (gradients excluded, as stock) exported to
  ``<save_dir>/<tag>/memascend_store/rank<NN>/`` (:mod:`memascend.io.checkpoint`: one ``.bin`` per
  tensor and a manifest with CRC32Cs), then ``latest``;
* :func:`make_load_checkpoint` (``DeepSpeedEngine.load_checkpoint``) imports the checkpoint's
  state into the store before stock load runs, so it is there before stock reads it back
  (``reset_swap_buffers``, right after stock's ``copytree``).

Resume works across kinds: a raw-store run imports a folder-of-files checkpoint's
``<tag>/offloaded_tensors/rank<NN>/*.swp`` the same way (and deletes the copies stock's
``copytree`` puts into the key folder); a folder-of-files run resuming a raw-store checkpoint calls
:func:`prepare_folder_resume` before ``load_checkpoint``. A checkpoint with neither (saved with
the optimizer state in DRAM) is refused with one line.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from memascend.errors import UserError
from memascend.integrations.deepspeed.optimizer_dram import dram_swap_file_filter
from memascend.io.durable import write_text_durable

#: Folder (under a checkpoint's tag folder) that holds the exported store of each rank.
CHECKPOINT_SUBDIR = "memascend_store"


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


def _optimizer_swap_folder(engine: Any) -> str | None:
    if not engine.zero_nvme_offload_optimizer():
        return None
    return engine.optimizer.optimizer_swapper.swap_folder


def make_save_checkpoint(original: Any, handle: Any) -> Any:
    """Wrap ``DeepSpeedEngine.save_checkpoint`` (``original``) for the raw store ``handle``
    (a :class:`~memascend.integrations.deepspeed.raw_store.RawStoreHandle`)."""

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


def make_load_checkpoint(original: Any, handle: Any) -> Any:
    """Wrap ``DeepSpeedEngine.load_checkpoint`` (``original``): import the checkpoint's optimizer
    state into ``handle``'s store first.

    Raises (from the wrapper): UserError: the checkpoint's export is incomplete, or it holds no
    NVMe optimizer state for this rank. ChecksumError: a damaged export file. StoreFullError: no room.
    """

    @functools.wraps(original)
    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        """The checkpoint's optimizer state (the store export of a raw-store run, or the swap files
        of a folder-of-files run) imported into the store, then stock load, whose ``copytree``
        copies a folder-of-files checkpoint's swap files into the key folder as well: those copies
        are deleted afterwards. Files of sub-groups this run keeps in DRAM are not imported
        (:func:`~.optimizer_dram.dram_swap_file_filter`: exact resume reads them from the checkpoint)."""
        folder = _optimizer_swap_folder(self)
        resolved = resolve_checkpoint_tag(load_dir, tag)
        copies: list[Path] = []
        if folder is not None and resolved is not None:
            tag_dir = Path(load_dir) / resolved
            rank_dir = checkpoint_rank_dir(tag_dir, handle.world_rank)
            stock_files = _swap_files(stock_offload_rank_dir(tag_dir, handle.world_rank))
            skip = dram_swap_file_filter(self.optimizer)
            if (rank_dir / "manifest.json").is_file():
                handle.import_checkpoint(rank_dir, select=lambda key: not skip(key))
            elif (tag_dir / CHECKPOINT_SUBDIR).is_dir():
                raise _incomplete_export(tag_dir, handle.world_rank)
            elif stock_files:
                prefix = handle.key_prefix(folder)
                copies = [Path(folder) / f.name for f in stock_files]
                handle.import_swap_files({prefix + f.name: f for f in stock_files if not skip(f.name)}, [])
            elif not stock_offload_rank_dir(tag_dir, handle.world_rank).is_dir():
                raise _no_optimizer_state(tag_dir, handle.world_rank)
        try:
            return original(self, load_dir, tag, *args, **kwargs)
        finally:
            for path in copies:
                path.unlink(missing_ok=True)

    return load_checkpoint
