"""Checkpoint lifecycle: atomic saves, a manifest that proves completeness, verify, pick, prune.

A memascend checkpoint is a DeepSpeed checkpoint folder (``<root>/global_step<N>/``, what
``DeepSpeedEngine.save_checkpoint`` writes, plus the raw store's export under
``memascend_store/rank<NN>/``) with one more file, :data:`MANIFEST_NAME`
(``memascend_checkpoint.json``): the step, the training dtype, the world size, every parameter's
name and shape, and the size and SHA-256 (per :data:`~memascend.train.manifest.HASH_CHUNK_BYTES` chunk) of every other file
in the folder.

Saving (:func:`save_checkpoint`) is atomic: DeepSpeed writes into a staging folder beside the
target (``<root>/.partial-global_step<N>-<run id>/``) with ``save_latest=False``; once every rank
has written its files (the raw-store export included), rank 0 hashes and fsyncs every file,
writes the manifest last (fsynced), renames the tag folder into place, fsyncs ``<root>``, and only
then replaces ``<root>/latest`` (write, fsync, rename). A run killed at any point leaves either the
previous checkpoints untouched plus a ``.partial-*`` folder (never picked; removed by the next
save into that root once its process is gone) or the new checkpoint complete.

Periodic checkpoints (``--checkpoint-every N`` steps and/or ``--checkpoint-every-minutes M``) go
to ``<output>/checkpoints/global_step<N>/``; the newest ``--keep-checkpoints K`` are kept.
``--resume auto`` resumes the newest complete one there (and starts from step 0 when there is
none); ``--resume DIR`` resumes the tag ``DIR/latest`` names (or ``DIR`` itself when it is a tag
folder). Before DeepSpeed is started, resume checks the manifest against the run (parameter names
and shapes, dtype, world size) and every file's checksum, so an incomplete, foreign or corrupt
checkpoint stops the run with one line instead of training garbage.

Errors: an incomplete checkpoint or one made for another model is :class:`UserError` (exit 2); a
file whose bytes differ from the manifest, or is missing or truncated, is
:class:`IntegrityError` (exit 4), naming the file and the byte range.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memascend.errors import DeviceError, IntegrityError, UserError
from memascend.io.durable import fsync_dir, write_text_durable
from memascend.io.runlock import pid_alive
from memascend.train.manifest import (  # noqa: F401 - check_compatible: part of this module's API
    MANIFEST_NAME,
    Checkpoint,
    check_compatible,
    read_manifest,
    verify_files,
    write_manifest,
)
from memascend.units import DTYPE_BYTES, format_bytes

#: Sub-folder of ``--output`` that holds periodic checkpoints (what ``--resume auto`` searches).
CHECKPOINTS_SUBDIR = "checkpoints"
#: Prefix of a staging folder; such folders are never resumed.
PARTIAL_PREFIX = ".partial-"
#: Bytes per parameter of a checkpoint besides the training-dtype copy: fp32 master and the two
#: Adam moments (DeepSpeed's optim_states / the swapped optimizer tensors).
OPTIMIZER_BYTES_PER_PARAM = 12
#: Free-space margin on the estimate, and a fixed allowance for small files (configs, scheduler).
SPACE_MARGIN = 1.10
SPACE_FIXED_BYTES = 64 << 20

_TAG_RE = re.compile(r"^global_step(\d+)$")


def tag_for_step(step: int) -> str:
    """``global_step<N>``: DeepSpeed's default tag, used for every memascend checkpoint."""
    return f"global_step{int(step)}"


def param_layout(module: Any) -> dict[str, list[int]]:
    """Every parameter's name and full shape, in registration order (tied weights once).

    Works on a meta-device model and on a ZeRO-3 model (whose partitioned parameters carry
    their full shape in ``ds_shape``).
    """
    out: dict[str, list[int]] = {}
    for name, p in module.named_parameters():
        shape = getattr(p, "ds_shape", None) or p.shape
        out[name] = [int(d) for d in shape]
    return out


def meta_param_layout(src: Any, model_cfg: Any) -> dict[str, list[int]]:
    """:func:`param_layout` of the run's model built on the meta device (no memory, no weights
    read), as ``runner.meta_shape`` builds it: what a checkpoint records and resume compares."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memascend.models.loading import from_scratch_config

    hf_cfg = from_scratch_config(model_cfg.from_scratch) if model_cfg.from_scratch else AutoConfig.from_pretrained(src.hf_dir)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_cfg)
    return param_layout(meta)


def estimate_checkpoint_bytes(total_numel: int, dtype: str) -> int:
    """Upper estimate of one checkpoint's bytes for ``total_numel`` parameters trained in ``dtype``
    with AdamW: the parameters in the training dtype plus the fp32 master and two fp32 moments
    (:data:`OPTIMIZER_BYTES_PER_PARAM`), times :data:`SPACE_MARGIN`, plus :data:`SPACE_FIXED_BYTES`.

    Raises:
        UserError: unknown dtype.
    """
    if dtype not in DTYPE_BYTES:
        raise UserError(f"unknown dtype {dtype!r} (bf16, fp16 or fp32)")
    per = DTYPE_BYTES[dtype] + OPTIMIZER_BYTES_PER_PARAM
    return int(total_numel * per * SPACE_MARGIN) + SPACE_FIXED_BYTES


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


def check_checkpoint_space(train_cfg: Any, output_dir: str | os.PathLike, total_numel: int) -> None:
    """Refuse, before the first step, checkpoint folders the run could not write: ``--save-checkpoint``
    and (with periodic checkpoints) ``<output>/checkpoints``, each needing
    :func:`estimate_checkpoint_bytes` per checkpoint it will hold at once (periodic: up to
    ``keep + 1`` while a new one is written, less the complete ones already there; folders on one
    filesystem add up).

    Raises:
        UserError: see :func:`check_checkpoint_target`.
    """
    one = estimate_checkpoint_bytes(total_numel, train_cfg.dtype)
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
            m = _TAG_RE.match(child.name)
            if m and int(m.group(1)) in steps and not (child / MANIFEST_NAME).is_file():
                raise UserError(
                    f"{what}: {child} exists and is not a memascend checkpoint (no {MANIFEST_NAME}); this run would "
                    f"save its step-{m.group(1)} checkpoint there: move that folder away or choose another folder"
                )


def verify_checkpoint(ck: Checkpoint, *, rank: int = 0, world_size: int = 1) -> None:
    """:func:`verify_files` with the files shared among the ranks (each hashes its share; every
    rank then raises the first failure any rank found, naming the newest older complete checkpoint
    beside it, if any, as the way out).

    Raises:
        IntegrityError: see :func:`verify_files`.
    """
    err = None
    try:
        verify_files(ck, share=(rank, world_size))
    except IntegrityError as exc:
        err = str(exc)
    d = _dist()
    if d is not None and world_size > 1:
        errs: list[str | None] = [None] * world_size
        d.all_gather_object(errs, err)
        err = next((e for e in errs if e), None)
    if err:
        older = [c for c in complete_checkpoints(ck.load_dir) if c.step < ck.step]
        hint = f"; move {ck.path} away to resume {older[-1].path}" if older else ""
        raise IntegrityError(err + hint)


# ---- finding checkpoints -----------------------------------------------------------------------


def complete_checkpoints(root: str | os.PathLike) -> list[Checkpoint]:
    """Complete checkpoints (tag folders with a readable manifest) under ``root``, oldest first.
    Staging folders and tag folders without a manifest are skipped; a damaged manifest is too."""
    base = Path(root)
    found = []
    if not base.is_dir():
        return found
    for child in base.iterdir():
        if not _TAG_RE.match(child.name) or not child.is_dir():
            continue
        try:
            manifest = read_manifest(child)
        except (UserError, IntegrityError):
            continue
        found.append(Checkpoint(base, child.name, manifest))
    return sorted(found, key=lambda c: c.step)


def periodic_root(output_dir: str | os.PathLike) -> Path:
    """``<output>/checkpoints``: where periodic checkpoints go and ``--resume auto`` looks."""
    return Path(output_dir) / CHECKPOINTS_SUBDIR


def _latest_tag(base: Path, resume: str) -> str | None:
    """The tag ``base/latest`` names (``None`` without the file)."""
    latest = base / "latest"
    if not latest.is_file():
        return None
    try:
        return latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--resume {resume}: cannot read {latest}: {exc}") from None


def resolve_resume(resume: str, output_dir: str | os.PathLike) -> Checkpoint | None:
    """The checkpoint ``--resume`` names.

    ``auto``: the newest complete checkpoint in :func:`periodic_root` (``None`` when there is none:
    the run starts from step 0). A tag folder with a manifest: that one. Another folder: the newest
    folder: the tag ``latest`` names, which must be complete; but the newest complete checkpoint
    (:func:`complete_checkpoints`) when ``latest`` is missing or names an older tag folder than that
    one, as a save cut off between renaming its tag folder into place and writing ``latest`` leaves
    it (:func:`pick_reason` says so).

    Raises:
        UserError: nothing to resume in an explicit folder, or ``latest`` names a tag that is not a
            folder there or an incomplete checkpoint (no newer complete one). IntegrityError: its
            manifest is damaged.
    """
    if resume == "auto":
        found = complete_checkpoints(periodic_root(output_dir))
        return found[-1] if found else None
    base = Path(resume)
    if not base.is_dir():
        raise UserError(f"--resume {resume}: no such folder")
    if (base / MANIFEST_NAME).is_file():
        return Checkpoint(base.parent, base.name, read_manifest(base))
    tag = _latest_tag(base, resume)
    found = complete_checkpoints(base)
    if found and tag is None:
        return found[-1]
    lagging = _TAG_RE.match(tag or "")
    if found and lagging and (base / tag).is_dir() and int(lagging.group(1)) < found[-1].step:
        return found[-1]  # 'latest' names an existing older tag: the newer one's save stopped before 'latest'
    if tag is not None:
        if not tag or "/" in tag or not (base / tag).is_dir():
            raise UserError(f"--resume {resume}: {base / 'latest'} names '{tag}', which is not a folder there")
        return Checkpoint(base, tag, read_manifest(base / tag))
    if _TAG_RE.match(base.name):
        return Checkpoint(base.parent, base.name, read_manifest(base))
    raise UserError(f"--resume {resume}: no checkpoint there (no 'latest' file, no complete global_step<N> folder, "
                    "and not a global_step<N> folder itself)")


def pick_reason(resume: str, ck: Checkpoint) -> str | None:
    """Why :func:`resolve_resume` picked ``ck`` rather than the tag ``latest`` names (``None``: it
    is that one, or ``resume`` is ``auto`` or a tag folder)."""
    if resume == "auto" or ck.load_dir != Path(resume):
        return None
    try:
        tag = _latest_tag(ck.load_dir, resume)
    except UserError:
        tag = "?"
    if tag == ck.tag:
        return None
    said = "there is no 'latest' file" if tag is None else f"'latest' names {tag}"
    return (f"the newest complete checkpoint there; {said} (a save cut off before it wrote 'latest', or "
            "'latest' was removed)")


def nothing_left(train_cfg: Any, output_dir: str | os.PathLike, *, output_given: bool) -> str | None:
    """The line for a resume with no step left to run, or ``None``: ``--resume`` names a checkpoint
    already at the run's last step (``--steps``). Such a run ends at once with exit code 0 and
    leaves the output folder, the checkpoints and everything else as they are. Read before anything
    is written; a checkpoint that cannot be resolved returns ``None`` (the run then reports it).

    ``--resume auto`` is checked only with an explicit ``--output`` (otherwise the run gets a fresh
    folder, which holds no checkpoint), and ``--epochs`` runs are not (their steps are counted from
    the data).
    """
    resume = train_cfg.resume
    if resume is None or train_cfg.epochs is not None or (resume == "auto" and not output_given):
        return None
    try:
        ck = resolve_resume(resume, output_dir)
    except (UserError, IntegrityError):
        return None
    if ck is None or ck.step != train_cfg.steps:
        return None
    return (f"--resume {resume}: {ck.path} is at step {ck.step}, the run's last (--steps {train_cfg.steps}): nothing "
            "left to do; nothing was written (give a larger --steps to train on)")


# ---- saving ------------------------------------------------------------------------------------


def remove_stale_partials(root: str | os.PathLike) -> list[Path]:
    """Remove staging folders (``.partial-<tag>-<YYYYmmdd-HHMMSS>-<pid>``) and temporary ``latest``
    files (``.latest.tmp-<pid>``, :func:`~memascend.io.durable.write_text_durable`'s) under ``root``
    whose process is gone: what a save killed mid-way left. Returns what was removed."""
    base = Path(root)
    removed = []
    if not base.is_dir():
        return removed
    for child in base.iterdir():
        m = re.match(rf"^{re.escape(PARTIAL_PREFIX)}global_step\d+-(?:old-)?\d{{8}}-\d{{6}}-(\d+)$", child.name)
        if m and child.is_dir() and not pid_alive(int(m.group(1))):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
        m = re.match(r"^\.latest\.tmp-(\d+)$", child.name)
        if m and child.is_file() and not child.is_symlink() and not pid_alive(int(m.group(1))):
            child.unlink(missing_ok=True)
            removed.append(child)
    return removed


def _dist():
    import torch.distributed as tdist

    return tdist if tdist.is_available() and tdist.is_initialized() else None


def _barrier() -> None:
    d = _dist()
    if d is not None and d.get_world_size() > 1:
        d.barrier()


def save_checkpoint(
    engine: Any,
    root: str | os.PathLike,
    *,
    run_id: str,
    info: dict,
    rank: int,
    client_state: dict | None = None,
) -> Checkpoint:
    """Save ``engine`` atomically as ``<root>/global_step<N>`` (N = ``engine.global_steps``) and
    point ``<root>/latest`` at it. Every rank calls it (DeepSpeed's save is collective).

    Replaces a direct ``DeepSpeedEngine.save_checkpoint(root, tag)`` (0.19.8 writes ``latest``
    before a raw store's export and fsyncs nothing): DeepSpeed saves into a staging folder with
    ``save_latest=False``, then rank 0 writes the manifest (:func:`write_manifest`), renames the tag
    folder into place and replaces ``latest``. A memascend checkpoint of the same tag already there
    is replaced; any other folder of that name is refused.

    Args:
        run_id: the run's id (same on every rank): names the staging folder.
        info: manifest facts (``dtype``, ``world_size``, ``param_shapes``, ...); ``step`` is added.
        client_state: passed to DeepSpeed (stored in its model_states file).

    Returns:
        The saved checkpoint.

    Raises:
        UserError: ``<root>/global_step<N>`` exists and is not a memascend checkpoint.
        DeviceError: writing failed (disk full, I/O error; an ``OSError``, or torch.save's
            ``RuntimeError`` of a failed write): the staging folder is removed, earlier checkpoints
            and ``latest`` are left as they were.
    """
    base = Path(root)
    step = int(engine.global_steps)
    tag = tag_for_step(step)
    staging = base / f"{PARTIAL_PREFIX}{tag}-{run_id}"
    final = base / tag
    if rank == 0:
        base.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(base)
        if final.exists() and not (final / MANIFEST_NAME).is_file():
            raise UserError(f"checkpoint folder {final} exists and is not a memascend checkpoint; move it away")
        if staging.exists():
            shutil.rmtree(staging)
    _barrier()
    manifest_s = 0.0
    try:
        engine.save_checkpoint(str(staging), tag=tag, client_state=client_state or {}, save_latest=False)
        _barrier()
        if rank == 0:
            t_manifest = time.monotonic()
            write_manifest(staging / tag, {**info, "step": step, "tag": tag})
            manifest_s = time.monotonic() - t_manifest
            old = None
            if final.exists():
                old = base / f"{PARTIAL_PREFIX}{tag}-old-{run_id}"
                os.replace(final, old)
            os.replace(staging / tag, final)
            fsync_dir(base)
            write_text_durable(base / "latest", tag)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException as exc:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        io_failure = isinstance(exc, OSError) or (isinstance(exc, RuntimeError) and "writ" in str(exc).lower())
        if not io_failure:
            raise
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        found = complete_checkpoints(base)
        kept = f"the last complete checkpoint, {found[-1].path}, is intact" if found else "no earlier checkpoint there"
        raise DeviceError(
            f"saving checkpoint {final} failed: {reason}; nothing of it was kept ({kept}): free space on "
            f"{base} or choose another folder"
        ) from None
    _barrier()
    manifest = read_manifest(final) if rank == 0 else {"step": step}
    return Checkpoint(base, tag, manifest, manifest_s)


def prune(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete memascend checkpoints under ``root`` (never a
    folder without a memascend manifest, never the one ``latest`` names). Returns what was removed."""
    base = Path(root)
    found = complete_checkpoints(base)
    latest = (base / "latest").read_text().strip() if (base / "latest").is_file() else None
    removed = []
    for ck in found[: max(0, len(found) - max(1, keep))]:
        if ck.tag == latest:
            continue
        shutil.rmtree(ck.path, ignore_errors=True)
        removed.append(ck.path)
    return removed


class PeriodicCheckpointer:
    """Decides after each optimizer step whether to save, saves, and prunes.

    Args:
        root: where the checkpoints go (:func:`periodic_root`).
        every_steps: save when the step number is a multiple of it (``None``: off).
        every_minutes: save when this many minutes passed since the last save or the start
            (``None``: off); the decision is rank 0's, shared with every rank.
        keep: newest checkpoints kept.
        save: ``save(root) -> Checkpoint``, called on every rank.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        every_steps: int | None,
        every_minutes: float | None,
        keep: int,
        save: Callable[[Path], Checkpoint],
        rank: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = Path(root)
        self.every_steps = every_steps
        self.every_s = None if every_minutes is None else float(every_minutes) * 60.0
        self.keep = keep
        self._save = save
        self._rank = rank
        self._clock = clock
        self._last_s = clock()
        self.saved: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.every_steps is not None or self.every_s is not None

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1-based, just finished) should be saved (same answer on every rank)."""
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        if self.every_s is None:
            return False
        local = self._clock() - self._last_s >= self.every_s
        d = _dist()
        if d is not None and d.get_world_size() > 1:
            box = [local]
            d.broadcast_object_list(box, src=0)
            local = bool(box[0])
        return local

    def maybe_checkpoint(self, step: int) -> Checkpoint | None:
        """Save after step ``step`` when due (then prune to ``keep``); returns the checkpoint or ``None``."""
        if not self.enabled or not self.due(step):
            return None
        ck = self._save(self.root)
        self._last_s = self._clock()
        self.saved.append(ck.tag)
        if self._rank == 0:
            prune(self.root, self.keep)
        return ck


def check_finite_loss(step: int, loss: float, *, skipped: bool, allow: bool) -> None:
    """Stop the run on a non-finite loss (unless ``allow``, or ``skipped``: the caller passes true
    only for an fp16 loss-scale overflow step that DeepSpeed skipped).

    Raises:
        TrainingError: the loss of ``step`` is NaN or infinite.
    """
    from memascend.errors import TrainingError

    if allow or skipped or math.isfinite(loss):
        return
    raise TrainingError(
        f"step {step}: the training loss is {loss} (not finite); the run stopped without writing a model or a "
        "checkpoint from this state: lower --lr, check the data, or pass --allow-nonfinite-loss to continue anyway"
    )
