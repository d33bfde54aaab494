"""The parts a fine-tuning run is made of, composed by :class:`memascend.train.recipe.FinetuneRecipe`.

Early checks (dtype, ``--output``), the model's meta-device shape, the collectives the ranks share
(broadcast, sum), held-out evaluation, the swap target (the swap folder's run lock, or the raw
store), and the :class:`Cleanup` ledger of what must be undone at exit. Swap files live in a private
folder under the NVMe path and are removed at exit, including on Ctrl-C, SIGTERM and errors. When
``--nvme-path`` names a block device or a ``.store`` file (:mod:`memascend.train.store_target`),
parameters and optimizer state go to a raw store instead
(:mod:`memascend.integrations.deepspeed.raw_store`), closed at exit (a file target is deleted; a
device keeps the store header so the next run reuses it).

:func:`run_finetune` stays importable from here (the CLI's entry point); it is
:func:`memascend.train.recipe.run_finetune`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from memascend.config import OffloadConfig, RunConfig
from memascend.config.render import model_shape
from memascend.errors import UserError
from memascend.io.runlock import TargetBusyError
from memascend.telemetry import MemorySampler
from memascend.train.run_log import RunLog
from memascend.train.store_target import resolve_store_target, store_file_bytes
from memascend.train.swapdir import lock_swap_folder, remove_swap_dir
from memascend.units import format_bytes


def run_finetune(cfg: RunConfig) -> dict | None:
    """Run one fine-tuning job: :func:`memascend.train.recipe.run_finetune` (same arguments, result
    and errors)."""
    from memascend.train.recipe import run_finetune as run

    return run(cfg)


def check_dtype_supported(dtype: str, device_type: str) -> None:
    """Raise when the accelerator cannot train in ``dtype``.

    Raises:
        UserError: fp16 or bf16 unsupported on this device; names the alternatives.
    """
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if dtype == "fp16" and not acc.is_fp16_supported():
        raise UserError(f"--dtype fp16 is not supported on this device ({device_type}); use bf16 or fp32")
    if dtype == "bf16" and not acc.is_bf16_supported():
        raise UserError(f"--dtype bf16 is not supported on this device ({device_type}); use fp16 or fp32")


def check_output_dir(out_dir: Path) -> None:
    """Fail early if ``--output`` cannot be created or written (without creating anything).

    Raises:
        UserError: ``out_dir`` lies inside a file, or its nearest existing folder is not writable.
    """
    probe = out_dir.resolve()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"--output is inside a file, not a folder: {out_dir}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"--output is not writable: {out_dir}")


def meta_shape(src, cfg: RunConfig):
    """Parameter layout (:class:`memascend.config.render.ModelShape`) from a meta-device instance (no
    memory, no weights read).

    Raises:
        UserError: transformers has no causal LM for the model's config.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memascend.models.loading import from_scratch_config

    try:
        hf_cfg = from_scratch_config(cfg.model.from_scratch) if cfg.model.from_scratch else AutoConfig.from_pretrained(src.hf_dir)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(hf_cfg)
    except (ValueError, KeyError, OSError) as exc:  # an architecture transformers has no causal LM for
        raise UserError(
            f"model {src.origin}: no causal-LM model can be built from its config.json "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from None
    return model_shape(meta)


def broadcast(obj, rank: int):
    """Rank 0's ``obj`` on every rank (a picklable object; collective)."""
    import torch.distributed as tdist

    box = [obj if rank == 0 else None]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj, world_size: int) -> list:
    """Every rank's ``obj`` (picklable), indexed by rank, on every rank (collective)."""
    import torch.distributed as tdist

    box: list = [None] * world_size
    tdist.all_gather_object(box, obj)
    return box


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum of ``values`` over the ranks, in float64 (``values`` itself with one rank)."""
    import torch
    import torch.distributed as tdist

    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return list(values)
    from deepspeed.accelerator import get_accelerator

    # nccl reduces device tensors only; gloo (CPU accelerator) takes host tensors.
    t = torch.tensor(values, dtype=torch.float64, device=get_accelerator().current_device_name())
    tdist.all_reduce(t)
    return t.cpu().tolist()


def evaluate(engine, blocks, micro_batch: int, info, sampler: MemorySampler) -> float | None:
    """Token-weighted mean cross-entropy over the held-out blocks (all ranks take part); ``None``
    when there are fewer blocks than ranks."""
    import torch

    n = len(blocks) // info.world_size * info.world_size
    if n == 0:
        return None
    sampler.phase("eval")
    engine.eval()
    mine = list(range(info.rank, n, info.world_size))
    loss_sum = tok_sum = 0.0
    with torch.no_grad():
        for i in range(0, len(mine), micro_batch):
            idx = torch.tensor(mine[i : i + micro_batch])
            ids, labels = blocks.input_ids[idx], blocks.labels[idx]
            dev = engine.device
            out = engine(input_ids=ids.to(dev), labels=labels.to(dev))
            count = float((labels[:, 1:] != -100).sum())
            loss_sum += float(out.loss) * count
            tok_sum += count
    engine.train()
    loss_sum, tok_sum = all_reduce_sum([loss_sum, tok_sum])
    return loss_sum / tok_sum if tok_sum else None


def progress_bar(total: int, enabled: bool):
    """The run's step progress bar (``tqdm`` on stderr; silent when not ``enabled``)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="fine-tune", unit="step", disable=not enabled, dynamic_ncols=True)


class Cleanup:
    """What must be undone at exit, filled in as the run progresses.

    Attributes:
        swap_dir, swap_lock: the run's private swap folder (removed) and the folder's run lock
            (released).
        revert: the seam's ``revert`` once ``apply`` ran (patches, host cache, ``mallopt`` policy,
            raw store).
        raw_store: the raw store's handle once opened (closed by the seam's ``revert``).
        created_out_dir: ``--output`` when this run created it (removed after a failure if empty).
        run_log: rank 0's :class:`RunLog` (closed and marked by ``FinetuneRecipe.fail``).
    """

    def __init__(self) -> None:
        self.swap_dir: Path | None = None
        self.swap_lock = None
        self.revert = None
        self.raw_store = None
        self.created_out_dir: Path | None = None
        self.run_log: RunLog | None = None

    def run(self, *, failed: bool = False) -> None:
        """Undo everything; every step runs even when an earlier one raises (the first error is
        re-raised at the end). After a failed run, an output folder this run created and left
        empty is removed too."""
        first: BaseException | None = None
        for step in (self._swap_dir, self._revert, self._raw_store, *((self._out_dir,) if failed else ())):
            try:
                step()
            except BaseException as exc:  # noqa: BLE001 - finish the cleanup, raise the first
                first = first or exc
        if first is not None:
            raise first

    def _swap_dir(self) -> None:
        remove_swap_dir(self.swap_dir)
        if self.swap_lock is not None:
            self.swap_lock.release()

    def _revert(self) -> None:
        if self.revert is not None:
            self.revert()

    def _raw_store(self) -> None:
        # The seam's one revert closes the store (its patches restored too). Also when the
        # interrupt came between apply_raw_store's return and self.raw_store being set: the applied
        # store is known to the seam, and its file must not stay behind.
        seam = sys.modules.get("memascend.integrations.deepspeed")
        if seam is not None and (self.raw_store is not None or seam.active_raw_store() is not None):
            seam.revert()

    def _out_dir(self) -> None:
        if self.created_out_dir is not None:
            with contextlib.suppress(OSError):
                self.created_out_dir.rmdir()  # only if empty


def lock_swap_folder_for_run(nvme_path: str, info, run_id: str):
    """Take the swap folder's run lock (one rank per host and folder holds it for the launch) and
    remove the run folders of runs that died there; every rank fails with one line if another run
    holds it.

    Returns:
        The lock this rank holds, or ``None`` (another rank of this host holds it).

    Raises:
        TargetBusyError: another live run uses the folder.
    """
    import socket

    import torch.distributed as tdist

    key = (socket.gethostname(), os.path.realpath(os.path.expanduser(nvme_path)))
    keys = [key]
    if tdist.is_initialized() and info.world_size > 1:
        keys = [None] * info.world_size
        tdist.all_gather_object(keys, key)
    lock, error = None, None
    if keys.index(key) == info.rank:
        try:
            lock, removed = lock_swap_folder(nvme_path, run_id)
        except UserError as exc:
            error = exc
        else:
            for folder, size_bytes in removed:
                print(f"memascend: note: removed {folder} ({format_bytes(size_bytes)}), the swap folder of an "
                      "earlier run that did not finish", file=sys.stderr, flush=True)
    errors = [error]
    if tdist.is_initialized() and info.world_size > 1:
        errors = [None] * info.world_size
        tdist.all_gather_object(errors, None if error is None else str(error))
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        if lock is not None:
            lock.release()
        raise error if error is not None else TargetBusyError(str(first))
    return lock


def open_raw_store(offload: OffloadConfig, info, need_bytes: int, *, lock_handle_buffers: bool = False):
    """Create this rank's raw store and route DeepSpeed's swappers to it
    (:func:`memascend.integrations.deepspeed.apply_raw_store`; the seam's ``revert`` closes it).

    The target is this node's (:func:`memascend.train.store_target.resolve_store_target` with the
    local rank); the store's key folder and checkpoint exports use the global rank.

    Args:
        need_bytes: NVMe bytes this rank's run requires (the store file's size comes from it).
        lock_handle_buffers: page-lock the swap handles' buffers as stock's aio handle does (the
            baseline engine: stock on a raw target then locks what stock on a swap folder locks).

    Raises:
        UserError: bad target list, refused target (filesystem, partition table, other store, a
            non-empty file that is not a store, mounted) without ``--nvme-overwrite``, a target
            another run holds, or a device smaller than the run needs (checked before the store
            header is written: a refused target is left as it was).
    """
    from memascend.integrations import deepspeed as seam

    # --nvme-path names this node's NVMe: its list (or PATH.rank<N>) is indexed by the local rank
    target = resolve_store_target(offload.nvme_path, info.local_rank, info.ranks_on_node)
    return seam.apply_raw_store(
        target,
        world_rank=info.rank,
        allow_overwrite=offload.nvme_overwrite,
        enable_crc=offload.enable_crc,
        size_bytes=store_file_bytes(need_bytes),
        min_capacity_bytes=need_bytes,
        lock_handle_buffers=lock_handle_buffers,
    )
