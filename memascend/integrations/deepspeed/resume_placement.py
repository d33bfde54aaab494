"""Exact resume across optimizer placements: a sub-group saved in DRAM and swapped now, or the reverse.

With the optimizer on NVMe, DeepSpeed 0.19.8 saves a sub-group kept in DRAM (``optimizer_dram_numel``,
or below the swapper's ``min_aio_bytes``) with its fp32 master in the ZeRO optimizer state file's
``fp32_flat_groups`` and its Adam moments in the file's optimizer ``state``; a swapped sub-group
saves an empty tensor in both places and its values in the swap files
``{ds_id}.tensor.swp`` / ``{key}-{ds_id}.tensor.swp`` that the checkpoint carries
(``<tag>/offloaded_tensors/rank<NN>/``, or the raw store's export ``<tag>/memascend_store/rank<NN>/``).
A resumed run may place a sub-group otherwise (another ``optimizer_dram_numel``, or
``--host-memory-budget auto`` on a host with other free memory). :mod:`.exact_resume` restores
each sub-group where this run keeps it:

* saved swapped, kept in DRAM here: :func:`load_swapped_into_dram` reads the master and moments
  from the checkpoint's swap copies (CRC32C-checked for a raw-store export) into
  ``fp32_partitioned_groups_flat[i]`` and ``optimizer.state``; the copies that stock's load then
  puts into this run's swap folder (``copytree``, or a raw-store checkpoint's files written for a
  folder run) are deleted by :func:`settle`, and a raw store does not import them
  (:func:`~.optimizer_dram.dram_swap_file_filter`), so no later checkpoint carries stale copies;
* saved in DRAM, swapped here: :func:`defer_swap_out` keeps the saved tensors until
  ``reset_swap_buffers`` (which stock's load calls after copying the swap files back), where
  :func:`settle` swaps the sub-group in through the optimizer swapper, copies the saved master and
  moments into it and swaps it out, as the first optimizer step of a fresh run writes it. Stock's
  ``reset_swap_buffers`` then reads it back and sets the 16-bit parameters from the master.

Replaces (with ``fix_exact_resume``): ``DeepSpeedZeroOptimizer_Stage3.reset_swap_buffers``
(:func:`make_reset_swap_buffers`: :func:`settle`, then the original).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memascend.errors import IntegrityError, UserError
from memascend.integrations.deepspeed.optimizer_dram import SWAP_SUFFIX, belongs_to, dram_ds_ids
from memascend.integrations.deepspeed.store_checkpoint import checkpoint_rank_dir, stock_offload_rank_dir

PENDING_ATTR = "_memascend_resume_placement"
"""Attribute of a stage-3 optimizer: ``{sub_group_id: (saved fp32 master, saved state)}`` waiting
for :func:`settle` (sub-groups saved in DRAM that this run swaps)."""

_READ_CHUNK_BYTES = 16 << 20


class CheckpointSwapFiles:
    """Where a checkpoint keeps one rank's swapped optimizer tensors: stock's swap-folder copy
    ``<tag>/offloaded_tensors/rank<NN>/<name>``, else the raw store's export
    ``<tag>/memascend_store/rank<NN>/`` (manifest entry whose key ends in this swap folder's
    ``optimizer/rank<N>/<name>``)."""

    def __init__(self, engine: Any, load_dir: str | os.PathLike, tag: str) -> None:
        rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
        self.tag_dir = Path(load_dir) / str(tag)
        self.stock_dir = stock_offload_rank_dir(self.tag_dir, rank)
        self.export_dir = checkpoint_rank_dir(self.tag_dir, rank)
        self.want = Path(engine.optimizer.optimizer_swapper.swap_folder).parts[-2:]
        self._manifest: dict[str, dict] | None = None

    def _export_entries(self) -> dict[str, dict]:
        if self._manifest is None:
            from memascend.io.checkpoint import read_manifest

            self._manifest = {}
            if (self.export_dir / "manifest.json").is_file():
                for entry in read_manifest(self.export_dir):
                    key = Path(entry["key"])
                    if key.parent.parts[-2:] == self.want:
                        self._manifest[key.name] = entry
        return self._manifest

    def locate(self, name: str) -> tuple[Path, int | None]:
        """``(file, expected CRC32C or None)`` of swap file ``name``.

        Raises:
            UserError: the checkpoint holds no copy of it.
        """
        if (self.stock_dir / name).is_file():
            return self.stock_dir / name, None
        entry = self._export_entries().get(name)
        if entry is not None:
            return self.export_dir / entry["file"], entry.get("crc32c")
        raise UserError(f"checkpoint {self.tag_dir}: no copy of the swapped optimizer tensor {name} (neither in "
                        f"{self.stock_dir} nor in {self.export_dir}/manifest.json); the checkpoint is incomplete")

    def read_into(self, name: str, out: Any) -> None:
        """Fill ``out`` (a contiguous CPU tensor) from the first ``out.nbytes`` bytes of swap file
        ``name`` (a swap file is the I/O-aligned swap buffer: the tensor, then padding).

        Raises:
            UserError: no copy (:meth:`locate`). IntegrityError: the file is shorter than ``out``.
            ChecksumError: an export file's CRC32C differs from its manifest's.
        """
        import torch

        path, expected = self.locate(name)
        want = out.numel() * out.element_size()
        size = path.stat().st_size
        if size < want:
            raise IntegrityError(f"checkpoint file {path} holds {size} bytes, the optimizer tensor {name} needs {want}")
        dest = memoryview(out.view(-1).view(torch.uint8).numpy())
        crc = 0
        op = None
        if expected is not None:
            from memascend.ops import nvme_io

            op = nvme_io.load()
        staging = bytearray(_READ_CHUNK_BYTES)
        view = memoryview(staging)
        pos = 0
        with open(path, "rb") as f:
            while n := f.readinto(view):
                if op is not None:
                    crc = op.crc32c_bytes(bytes(view[:n]), crc)
                take = max(0, min(n, want - pos))
                dest[pos:pos + take] = view[:take]
                pos += n
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        if expected is not None and crc != expected:
            from memascend.io.errors import ChecksumError

            raise ChecksumError(f"checksum mismatch reading optimizer tensor {name} from {path}: the checkpoint "
                                "file is corrupt", key=name, offset_bytes=0, expected_crc32c=expected, actual_crc32c=crc)


def load_swapped_into_dram(zero_opt: Any, sub_group_id: int, saved_state: dict, files: CheckpointSwapFiles) -> None:
    """A sub-group saved swapped and kept in DRAM here: its fp32 master and the state tensors saved
    empty (``exp_avg``, ``exp_avg_sq``) are read from the checkpoint's swap copies; other state
    values (``step``) are taken from ``saved_state``.

    Raises:
        UserError, IntegrityError, ChecksumError: as :meth:`CheckpointSwapFiles.read_into`.
    """
    import torch

    fp32 = zero_opt.fp32_partitioned_groups_flat[sub_group_id]
    files.read_into(f"{fp32.ds_id}{SWAP_SUFFIX}", fp32.data)
    state = zero_opt.optimizer.state[fp32]
    for key, value in saved_state.items():
        if torch.is_tensor(value) and value.numel() == 0:
            tensor = torch.empty(fp32.numel(), dtype=value.dtype)
            files.read_into(f"{key}-{fp32.ds_id}{SWAP_SUFFIX}", tensor)
            state[key] = tensor
        else:
            state[key] = value.clone() if torch.is_tensor(value) else value


def defer_swap_out(zero_opt: Any, sub_group_id: int, saved_state: dict, saved_fp32: Any) -> None:
    """A sub-group saved in DRAM and swapped here: keep the saved master and state for :func:`settle`.

    Raises:
        UserError: the saved master has another number of elements than this sub-group.
    """
    numel = int(zero_opt.fp16_partitioned_groups_flat_numel[sub_group_id])
    if saved_fp32.numel() != numel:
        raise UserError(f"optimizer sub-group {sub_group_id} of the checkpoint has {saved_fp32.numel()} elements, "
                        f"this run's has {numel} (another model or sub_group_size)")
    zero_opt.__dict__.setdefault(PENDING_ATTR, {})[sub_group_id] = (saved_fp32, saved_state)


def _swap_out_saved(zero_opt: Any, sub_group_id: int, saved_fp32: Any, saved_state: dict) -> None:
    """Write a saved master and state to this run's swap files of the sub-group, through the
    optimizer swapper (swap in, copy, swap out: the new state tensors are registered as the first
    step of a fresh run registers them)."""
    import torch

    swapper = zero_opt.optimizer_swapper
    fp32 = zero_opt.fp32_partitioned_groups_flat[sub_group_id]
    swapper.swap_in_optimizer_state(parameter=fp32)
    fp32.data.copy_(saved_fp32.data)
    state = zero_opt.optimizer.state[fp32]
    for key, value in saved_state.items():
        current = state.get(key)
        if (torch.is_tensor(value) and torch.is_tensor(current) and current.numel() > 0
                and current.numel() == value.numel()):
            current.data.copy_(value.data)  # registered and swapped in: the swapper writes this tensor
        else:
            state[key] = value.clone() if torch.is_tensor(value) else value
    swapper.swap_out_optimizer_state(parameter=fp32)


def settle(zero_opt: Any) -> list[int]:
    """Finish a resume across placements, after the checkpoint's swap files are back in this run's
    swap target: delete the swap-folder copies of sub-groups kept in DRAM here, and write the
    sub-groups saved in DRAM that this run swaps (:func:`defer_swap_out`).

    Returns:
        The sub-groups written to the swap target.
    """
    pending = zero_opt.__dict__.pop(PENDING_ATTR, None) or {}
    if not getattr(zero_opt, "swap_optimizer", False):
        return []
    folder = Path(zero_opt.optimizer_swapper.swap_folder)
    ds_ids = dram_ds_ids(zero_opt)
    if ds_ids and folder.is_dir():
        for path in folder.iterdir():
            if path.is_file() and any(belongs_to(path.name, d) for d in ds_ids):
                path.unlink()
    for sub_group_id, (saved_fp32, saved_state) in sorted(pending.items()):
        _swap_out_saved(zero_opt, sub_group_id, saved_fp32, saved_state)
    return sorted(pending)


def make_reset_swap_buffers(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap ``DeepSpeedZeroOptimizer_Stage3.reset_swap_buffers`` (0.19.8; stock ``load_checkpoint``
    calls it right after copying the swap files back): :func:`settle`, then the original."""

    @functools.wraps(original)
    def reset_swap_buffers(self):
        settle(self)
        return original(self)

    return reset_swap_buffers
