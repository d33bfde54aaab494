"""Which checkpoint a run resumes, and whether it may: ``--resume auto`` / ``DIR`` / a tag folder
resolved to one complete checkpoint, the reason it was picked over ``latest``, a resume with no step
left, and every file's checksum verified (shared among the ranks) before DeepSpeed starts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from memascend.errors import IntegrityError, UserError
from memascend.train.checkpoints.layout import LATEST, TAG_RE, complete_checkpoints, latest_tag, periodic_root
from memascend.train.checkpoints.manifest import MANIFEST_NAME, Checkpoint, read_manifest, verify_files
from memascend.train.dist import process_group


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
    tag = latest_tag(base, resume)
    found = complete_checkpoints(base)
    if found and tag is None:
        return found[-1]
    lagging = TAG_RE.match(tag or "")
    if found and lagging and (base / tag).is_dir() and int(lagging.group(1)) < found[-1].step:
        return found[-1]  # 'latest' names an existing older tag: the newer one's save stopped before 'latest'
    if tag is not None:
        if not tag or "/" in tag or not (base / tag).is_dir():
            raise UserError(f"--resume {resume}: {base / LATEST} names '{tag}', which is not a folder there")
        return Checkpoint(base, tag, read_manifest(base / tag))
    if TAG_RE.match(base.name):
        return Checkpoint(base.parent, base.name, read_manifest(base))
    raise UserError(f"--resume {resume}: no checkpoint there (no 'latest' file, no complete global_step<N> folder, "
                    "and not a global_step<N> folder itself)")


def pick_reason(resume: str, ck: Checkpoint) -> str | None:
    """Why :func:`resolve_resume` picked ``ck`` rather than the tag ``latest`` names (``None``: it
    is that one, or ``resume`` is ``auto`` or a tag folder)."""
    if resume == "auto" or ck.load_dir != Path(resume):
        return None
    try:
        tag = latest_tag(ck.load_dir, resume)
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
    d = process_group()
    if d is not None and world_size > 1:
        errs: list[str | None] = [None] * world_size
        d.all_gather_object(errs, err)
        err = next((e for e in errs if e), None)
    if err:
        older = [c for c in complete_checkpoints(ck.load_dir) if c.step < ck.step]
        hint = f"; move {ck.path} away to resume {older[-1].path}" if older else ""
        raise IntegrityError(err + hint)



def load_checkpoint(engine: Any, ck: Checkpoint, train_cfg: Any, user_ds_config: dict | None, *,
                    swap_folder: bool) -> tuple[int, dict | None]:
    """Load the resumed checkpoint ``ck`` into ``engine`` (every rank calls it: DeepSpeed's load is
    collective) and set the run's schedule at its step.

    A folder-of-files run (``swap_folder``: no raw store) resuming a raw-store checkpoint first gets
    the exported optimizer state as stock's swap files
    (:func:`memascend.integrations.deepspeed.store_checkpoint.prepare_folder_resume`). memascend's
    schedule is set from ``train_cfg`` (:mod:`memascend.train.resume_schedule`), not from the saved
    scheduler state, which a constant-rate checkpoint does not have and which holds the old rate;
    a ``"scheduler"`` in the DeepSpeed JSON is DeepSpeed's to restore.

    Returns:
        ``(the step the run continues from, the client state saved with the checkpoint)``.

    Raises:
        UserError: DeepSpeed found no checkpoint to load.
    """
    from memascend.train import resume_schedule

    if swap_folder:  # a raw-store checkpoint keeps its optimizer state outside stock's folder
        from memascend.integrations.deepspeed.store_checkpoint import prepare_folder_resume

        prepare_folder_resume(engine, ck.load_dir, ck.tag)
    owns_schedule = resume_schedule.owns_schedule(user_ds_config)
    load_path, client_state = engine.load_checkpoint(str(ck.load_dir), tag=ck.tag,
                                                     load_lr_scheduler_states=not owns_schedule)
    if load_path is None:
        raise UserError(f"--resume {train_cfg.resume}: DeepSpeed found no checkpoint to load")
    start_step = int(engine.global_steps)
    if owns_schedule:
        resume_schedule.apply_at_step(engine, train_cfg, start_step - int(getattr(engine, "skipped_steps", 0)))
    return start_step, client_state
