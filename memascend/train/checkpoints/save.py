"""Saving checkpoints atomically, periodically, and pruning the old ones (see the package doc for the
order of a save: staging folder, manifest, rename, ``latest``)."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memascend.errors import DeviceError, UserError
from memascend.io.durable import fsync_dir, write_text_durable
from memascend.io.runlock import pid_alive
from memascend.train.checkpoints.layout import LATEST, PARTIAL_PREFIX, complete_checkpoints, tag_for_step
from memascend.train.checkpoints.manifest import MANIFEST_NAME, Checkpoint, read_manifest, write_manifest
from memascend.train.dist import process_group


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


def _barrier() -> None:
    d = process_group()
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
            write_text_durable(base / LATEST, tag)
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
    latest = (base / LATEST).read_text().strip() if (base / LATEST).is_file() else None
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
        d = process_group()
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
