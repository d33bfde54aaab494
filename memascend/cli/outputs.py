"""Where ``memascend finetune`` writes: a fresh run folder per run, or a ``--output`` it may use.

- No ``--output`` (flag or ``output_dir`` in ``--config``): a new folder
  ``runs/<YYYYmmdd-HHMMSS>-<name>`` per run (``<name>``: the from-scratch preset or the model's
  name), and ``runs/latest`` a symbolic link to the newest one once it exists.
- An explicit ``--output`` that holds anything is refused, unless ``--overwrite-output`` (memascend
  first removes the files it writes there, :func:`memascend_files`, and nothing else: a user's own
  file inside ``model/``, ``tensorboard/`` or ``checkpoints/`` stays, and a subfolder goes only when
  it is left empty) or ``--resume`` (the folder is reused: its ``checkpoints/`` stay, the earlier
  run's model, report and timeline go, so a ``--no-save-model`` run never leaves an old ``model/``
  beside its report).
- Nothing the run reads is ever removed or overwritten: a ``--model``, ``--data``, ``--config``,
  ``--deepspeed-config`` or ``--resume`` path at or inside one of the run's outputs is refused with
  one line naming the conflict, before anything is removed (:func:`check_inputs_apart`).
- The folder is locked for the run's life (:func:`lock_output`, a ``flock`` on the folder held by the
  first process): a second run on the same ``--output`` is refused with one line naming the first
  run's pid, before it removes or writes anything.

The first process of a run decides (the supervised child and the ranks of ``--nproc`` get the
choice in the run's handover, :mod:`memascend.train.handover`), so every process of one run writes to
one folder.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from memascend.config import FROM_SCRATCH_PRESETS, RunConfig
from memascend.errors import UserError
from memascend.io.runlock import RunLock, acquire_run_lock

RUNS_ROOT = Path("runs")
"""Where fresh run folders go (relative to the working folder)."""
LATEST = "latest"
"""``runs/latest``: a link to the newest run folder."""

MEMASCEND_OUTPUTS = ("model", "report.json", "steps.jsonl", "memory_timeline.csv", "memory_timeline.png",
                     "tensorboard", "checkpoints")
"""What a run writes into its output folder (:mod:`memascend.train.recipe`, :mod:`memascend.train.run_log`,
:mod:`memascend.telemetry.tensorboard`, :mod:`memascend.train.checkpoints`). Of the folders among
them, ``--overwrite-output`` removes only the files memascend writes (:func:`memascend_files`)."""
MODEL_FILE_GLOBS = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                    "pytorch_model*.bin", "pytorch_model.bin.index.json", "tokenizer.json", "tokenizer_config.json",
                    "tokenizer.model", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                    "chat_template.json", "vocab.json", "merges.txt")
"""The files of a saved model folder (``OUTPUT/model``: transformers' ``save_pretrained`` of the model
and its tokenizer)."""
KEPT_ON_RESUME = ("checkpoints", "tensorboard")
"""Outputs a ``--resume`` into the same folder keeps (the checkpoints it resumes from; the earlier
steps' TensorBoard events)."""


def run_name(cfg: RunConfig) -> str:
    """A short folder-safe name of the run's model: the from-scratch preset (``llama-1b``) or
    ``from-scratch``, else the model's last path part without ``.gguf`` (``Qwen2.5-0.5B``)."""
    if cfg.model.from_scratch is not None:
        name = next((k for k, v in FROM_SCRATCH_PRESETS.items() if v == cfg.model.from_scratch), "from-scratch")
    else:
        name = Path(cfg.model.name_or_path.rstrip("/")).name.removesuffix(".gguf") or "model"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def fresh_run_dir(cfg: RunConfig, root: Path = RUNS_ROOT, now_s: float | None = None) -> Path:
    """``root/<YYYYmmdd-HHMMSS>-<run_name>``, with ``-2``, ``-3`` ... when that folder exists already."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now_s is None else now_s))
    base = root / f"{stamp}-{run_name(cfg)}"
    path, n = base, 1
    while path.exists() or path.is_symlink():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _entries(folder: Path) -> list[str]:
    """What ``folder`` holds, leaving out empty folders (nothing in them to lose: a checkpoint folder
    the user made or mounted for the run)."""
    try:
        return sorted(p.name for p in folder.iterdir()
                      if not (p.is_dir() and not p.is_symlink() and not any(p.iterdir())))
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise UserError(f"--output {folder} is a file, not a folder") from None


def memascend_files(folder: Path, names: tuple[str, ...] = MEMASCEND_OUTPUTS) -> list[Path]:
    """The paths under ``folder`` that memascend wrote, among its outputs ``names``.

    A top-level output that is a file is memascend's; inside the output folders only memascend's own
    files count: ``model/``'s saved-model files (:data:`MODEL_FILE_GLOBS`), ``tensorboard/``'s event
    files, ``checkpoints/``' tag folders with memascend's manifest and ``latest``. Symbolic links to
    folders are not followed.

    Returns:
        Files and (checkpoint) folders to remove, in a stable order.
    """
    from memascend.telemetry.tensorboard import EVENT_GLOB
    from memascend.train.checkpoints.layout import memascend_checkpoint_entries

    globs = {"model": MODEL_FILE_GLOBS, "tensorboard": (EVENT_GLOB,)}
    found: list[Path] = []
    for name in names:
        path = folder / name
        if path.is_symlink() or not path.exists():
            if path.is_symlink() and name not in globs and name != "checkpoints":
                found.append(path)  # a dangling or file link named like a report: memascend's name
            continue
        if not path.is_dir():
            found.append(path)
        elif name == "checkpoints":
            found += sorted(memascend_checkpoint_entries(path))
        elif name in globs:
            found += sorted(p for p in path.iterdir() if not p.is_dir()
                            and any(fnmatch.fnmatch(p.name, g) for g in globs[name]))
    return found


def _remove(folder: Path, names: tuple[str, ...]) -> None:
    """Remove memascend's files among ``names`` (:func:`memascend_files`), then each output folder
    left empty; a user's file keeps its folder."""
    for path in memascend_files(folder, names):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    for name in names:
        sub = folder / name
        if sub.is_dir() and not sub.is_symlink():
            with contextlib.suppress(OSError):
                sub.rmdir()  # only if empty


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def run_inputs(cfg: RunConfig, config_file: str | None = None) -> dict[str, Path]:
    """What the run reads from local paths: flag -> resolved path (``--model``, each ``--data`` path,
    ``--config``, ``--deepspeed-config``, ``--resume`` unless ``auto``); names that are no local path
    (a built-in corpus, a Hub id) are left out."""
    candidates: list[tuple[str, str | None]] = [("--config", config_file), ("--deepspeed-config", cfg.deepspeed_config)]
    if cfg.model.from_scratch is None:
        candidates.append(("--model", cfg.model.name_or_path))
    candidates += [("--data", part.strip()) for part in cfg.data.source.split(",") if part.strip()]
    if cfg.train.resume not in (None, "auto"):
        candidates.append(("--resume", cfg.train.resume))
    found = {}
    for flag, value in candidates:
        if value and os.path.lexists(value):
            found[f"{flag} {value}"] = Path(os.path.realpath(value))
    return found


def check_inputs_apart(folder: Path, inputs: dict[str, Path], *, resume: bool) -> None:
    """Refuse a run that would remove or overwrite what it reads.

    Every output the run removes or rewrites in ``folder`` (:data:`MEMASCEND_OUTPUTS`; with a resume,
    the kept ``checkpoints/`` and ``tensorboard/`` aside) must not be, nor hold, an input; and where an
    input is a folder holding such an output already (``--data D --output D``), that output is the
    input's too.

    Args:
        folder: the run's output folder.
        inputs: from :func:`run_inputs`.
        resume: the run resumes (its checkpoints are read, not removed).

    Raises:
        UserError: one line naming the input, the output it lies in and the fix.
    """
    real = Path(os.path.realpath(folder))
    for name in MEMASCEND_OUTPUTS:
        if resume and name in KEPT_ON_RESUME:
            continue
        out = real / name
        for given, path in inputs.items():
            if _inside(path, out) or (_inside(out, path) and os.path.lexists(out)):
                raise UserError(f"{given} lies in the run's output {folder / name}, which this run replaces: "
                                "give another --output (or move the input out of it first)")


def prepare_explicit_output(folder: Path, *, overwrite: bool, resume: bool,
                            inputs: dict[str, Path] | None = None) -> None:
    """Make an explicit ``--output`` ready, or refuse it (see the module doc).

    Raises:
        UserError: an input lies in one of the run's outputs (:func:`check_inputs_apart`, checked
            first, nothing removed); the folder holds something and neither ``overwrite`` nor
            ``resume`` is set; or it is a file.
    """
    held = _entries(folder)
    if not held:
        return
    check_inputs_apart(folder, inputs or {}, resume=resume)
    if overwrite:
        _remove(folder, tuple(n for n in MEMASCEND_OUTPUTS if not (resume and n in KEPT_ON_RESUME)))
    elif resume:
        _remove(folder, tuple(n for n in MEMASCEND_OUTPUTS if n not in KEPT_ON_RESUME))
    else:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise UserError(f"--output {folder} is not empty ({shown}): give --overwrite-output to replace "
                        "memascend's files there, --resume to continue its run, or another folder")


@dataclass(eq=False)
class OutputLock:
    """The run lock of the output folder, held by the run's first process for the run's life.

    Attributes:
        folder: the locked output folder.
        lock: the held :class:`~memascend.io.runlock.RunLock` (a ``flock`` on the folder).
        created: the folder did not exist and this lock made it (removed on release if left empty).
    """

    folder: Path
    lock: RunLock
    created: bool

    def release(self) -> None:
        """Drop the lock; a folder it created and the run left empty is removed (idempotent)."""
        self.lock.release()
        if self.created:
            with contextlib.suppress(OSError):
                self.folder.rmdir()  # only if empty
            self.created = False


def lock_output(folder: Path) -> OutputLock:
    """Create ``folder`` if needed and take its run lock without waiting.

    Raises:
        UserError: the folder cannot be created (inside a file, not writable).
        memascend.io.runlock.TargetBusyError: another live run holds it (names its pid).
    """
    from memascend.train.preflight import check_output_dir

    check_output_dir(folder)  # a file or a folder inside one, an unwritable parent: one line
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # what changed since the check
        raise UserError(f"--output {folder} cannot be created: {exc.strerror}") from None
    try:
        lock = acquire_run_lock(folder, what="--output")
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return OutputLock(folder=folder, lock=lock, created=created)


def settle_output(cfg: RunConfig, *, given: bool, overwrite: bool,
                  config_file: str | None = None) -> tuple[RunConfig, bool, OutputLock]:
    """The run's output folder, locked for the run by its first process (the one that decides for the
    run: not the supervised child, not a rank of ``--nproc``, which get the folder in the run's
    handover).

    Args:
        cfg: the run's config (``cfg.output_dir`` as the user gave it, or the default when not given).
        given: whether the user gave ``--output`` (flag or ``output_dir`` in ``--config``).
        overwrite: ``--overwrite-output``.
        config_file: the ``--config`` file, an input the output must not replace.

    Returns:
        ``(cfg with output_dir set, whether the folder is a fresh run folder, the held lock)``; the
        caller releases the lock when the run is over.

    Raises:
        UserError: as :func:`lock_output` and :func:`prepare_explicit_output` (the lock is released).
    """
    folder = Path(cfg.output_dir) if given else fresh_run_dir(cfg)
    lock = lock_output(folder)
    try:
        if given:
            prepare_explicit_output(folder, overwrite=overwrite, resume=cfg.train.resume is not None,
                                    inputs=run_inputs(cfg, config_file))
    except BaseException:
        lock.release()
        raise
    return (cfg if given else replace(cfg, output_dir=str(folder))), not given, lock


def link_latest(run_dir: Path) -> None:
    """Point ``<run_dir's parent>/latest`` at ``run_dir`` (relative link; replaced atomically). A
    ``latest`` that is a real folder (an earlier memascend wrote there) is left as it is."""
    link = run_dir.parent / LATEST
    if not run_dir.is_dir() or (link.exists() and not link.is_symlink()):
        return
    tmp = run_dir.parent / f".{LATEST}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(run_dir.name, target_is_directory=True)
    os.replace(tmp, link)
