"""Checks before the first step that the run can write its checkpoints: free space and writability of
``--save-checkpoint`` and ``<output>/checkpoints``, and no foreign ``global_step<N>`` folder where the
run would save (:func:`~memascend.train.checkpoints.save.save_checkpoint` refuses to replace one; found
only then, after training, the run would end without its checkpoint)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from memascend.errors import UserError
from memascend.train.checkpoints.layout import TAG_RE, complete_checkpoints, periodic_root
from memascend.train.checkpoints.manifest import MANIFEST_NAME
from memascend.units import DTYPE_BYTES, format_bytes

#: Bytes per parameter of a checkpoint besides the training-dtype copy: fp32 master and the two
#: Adam moments (DeepSpeed's optim_states / the swapped optimizer tensors).
OPTIMIZER_BYTES_PER_PARAM = 12
#: Free-space margin on the estimate, and a fixed allowance for small files (configs, scheduler).
SPACE_MARGIN = 1.10
SPACE_FIXED_BYTES = 64 << 20


def estimate_checkpoint_bytes(total_numel: int, dtype: str, trainable_numel: int | None = None) -> int:
    """Upper estimate of one checkpoint's bytes for ``total_numel`` parameters in ``dtype`` of which
    ``trainable_numel`` are trained with AdamW: every parameter in the training dtype (ZeRO-3's
    partitions, frozen ones included) plus the fp32 master and two fp32 moments of the trained ones
    (:data:`OPTIMIZER_BYTES_PER_PARAM`; a frozen LoRA base has no optimizer state), times
    :data:`SPACE_MARGIN`, plus :data:`SPACE_FIXED_BYTES`.

    Args:
        total_numel: parameters of the model, adapters included (elements).
        dtype: the training dtype (``bf16``, ``fp16``, ``fp32``).
        trainable_numel: parameters the optimizer holds (elements); ``None``: all of them.

    Raises:
        UserError: unknown dtype.
    """
    if dtype not in DTYPE_BYTES:
        raise UserError(f"unknown dtype {dtype!r} (bf16, fp16 or fp32)")
    trained = total_numel if trainable_numel is None else trainable_numel
    need = total_numel * DTYPE_BYTES[dtype] + trained * OPTIMIZER_BYTES_PER_PARAM
    return int(need * SPACE_MARGIN) + SPACE_FIXED_BYTES


def _nearest_existing(path: Path) -> Path:
    probe = path.expanduser().absolute()
    while not probe.exists():
        probe = probe.parent
    return probe


def check_checkpoint_target(path: str | os.PathLike, need_bytes: int, what: str) -> None:
    """Refuse a checkpoint folder that cannot be written or lacks ``need_bytes`` of free space,
    before the first step. Creates nothing that outlives the call (the writability probe is a
    temporary folder removed at once).

    Args:
        path: the checkpoint root (may not exist yet).
        need_bytes: free bytes required on its filesystem.
        what: the option named in messages (``--save-checkpoint``, ``--checkpoint-every``).

    Raises:
        UserError: inside a file, not writable (permissions, read-only filesystem), or too small.
    """
    target = Path(path)
    base = _nearest_existing(target)
    if not base.is_dir():
        raise UserError(f"{what} {target} is inside a file ({base}), not a folder")
    try:
        probe = tempfile.mkdtemp(prefix=".memascend-probe-", dir=base)
    except OSError as exc:
        raise UserError(f"{what} {target} is not writable ({base}: {exc.strerror}); choose a writable folder") from None
    os.rmdir(probe)
    free = shutil.disk_usage(base).free
    if free < need_bytes:
        raise UserError(
            f"{what} {target} has {format_bytes(free)} free; a checkpoint of this run needs about "
            f"{format_bytes(need_bytes)}: free space or choose another folder"
        )


def check_checkpoint_space(train_cfg: Any, output_dir: str | os.PathLike, total_numel: int,
                           trainable_numel: int | None = None) -> None:
    """Refuse, before the first step, checkpoint folders the run could not write: ``--save-checkpoint``
    and (with periodic checkpoints) ``<output>/checkpoints``, each needing
    :func:`estimate_checkpoint_bytes` per checkpoint it will hold at once (periodic: up to
    ``keep + 1`` while a new one is written, less the complete ones already there; folders on one
    filesystem add up). ``total_numel`` and ``trainable_numel``: as for :func:`estimate_checkpoint_bytes`.

    Raises:
        UserError: see :func:`check_checkpoint_target`.
    """
    one = estimate_checkpoint_bytes(total_numel, train_cfg.dtype, trainable_numel)
    wants: list[tuple[Path, int, str]] = []
    if train_cfg.save_checkpoint is not None:
        wants.append((Path(train_cfg.save_checkpoint), one, "--save-checkpoint"))
    if train_cfg.checkpoint_every is not None or train_cfg.checkpoint_every_minutes is not None:
        root = periodic_root(output_dir)
        planned = train_cfg.keep_checkpoints + 1
        if train_cfg.checkpoint_every_minutes is None and train_cfg.epochs is None and train_cfg.steps:
            planned = min(planned, max(1, train_cfg.steps // train_cfg.checkpoint_every))
        have = min(len(complete_checkpoints(root)), train_cfg.keep_checkpoints)
        count = max(1, min(planned, train_cfg.keep_checkpoints + 1 - have))
        what = "--checkpoint-every" if train_cfg.checkpoint_every is not None else "--checkpoint-every-minutes"
        wants.append((root, one * count, f"{what} (in {root})"))
    by_dev: dict[int, int] = {}
    for path, need, _ in wants:
        with contextlib.suppress(OSError):
            dev = _nearest_existing(path).stat().st_dev
            by_dev[dev] = by_dev.get(dev, 0) + need
    for path, need, what in wants:
        try:
            need = by_dev.get(_nearest_existing(path).stat().st_dev, need)
        except OSError:
            pass
        check_checkpoint_target(path, need, what)


def check_tag_folders(train_cfg: Any, output_dir: str | os.PathLike, start_step: int, total_steps: int) -> None:
    """Refuse, before the first step, a ``global_step<N>`` folder that is not a memascend checkpoint
    (no manifest: another tool's, or a copy) where this run would save its step-``N`` checkpoint:
    ``--save-checkpoint`` (step ``total_steps``) and, with periodic checkpoints,
    :func:`periodic_root` (the multiples of ``checkpoint_every`` after ``start_step``; with
    ``checkpoint_every_minutes`` any step after it). :func:`save_checkpoint` refuses to replace
    such a folder; found only then, after training, the run would end without its checkpoint.

    Raises:
        UserError: naming the folder and what to do; nothing is created or removed.
    """
    wants: list[tuple[Path, set[int], str]] = []
    if train_cfg.save_checkpoint is not None:
        wants.append((Path(train_cfg.save_checkpoint), {total_steps}, "--save-checkpoint"))
    every = train_cfg.checkpoint_every
    if every is not None or train_cfg.checkpoint_every_minutes is not None:
        steps = range(start_step + 1, total_steps + 1)
        due = set(steps) if train_cfg.checkpoint_every_minutes is not None else {s for s in steps if s % every == 0}
        wants.append((periodic_root(output_dir), due, "periodic checkpoints"))
    for root, steps, what in wants:
        if not root.is_dir():
            continue
        for child in sorted(root.iterdir()):
            m = TAG_RE.match(child.name)
            if m and int(m.group(1)) in steps and not (child / MANIFEST_NAME).is_file():
                raise UserError(
                    f"{what}: {child} exists and is not a memascend checkpoint (no {MANIFEST_NAME}); this run would "
                    f"save its step-{m.group(1)} checkpoint there: move that folder away or choose another folder"
                )
