"""Where ``memascend finetune`` writes: a fresh run folder per run, or a ``--output`` it may use.

- No ``--output`` (flag or ``output_dir`` in ``--config``): a new folder
  ``runs/<YYYYmmdd-HHMMSS>-<name>`` per run (``<name>``: the from-scratch preset or the model's
  name), and ``runs/latest`` a symbolic link to the newest one once it exists.
- An explicit ``--output`` that holds anything is refused, unless ``--overwrite-output`` (memascend
  first removes the files it writes there, :data:`MEMASCEND_OUTPUTS`, and nothing else) or
  ``--resume`` (the folder is reused: its ``checkpoints/`` stay, the earlier run's model, report and
  timeline go, so a ``--no-save-model`` run never leaves an old ``model/`` beside its report).

The first process of a run decides (the supervised child and the ranks of ``--nproc`` inherit the
choice through :data:`ENV_OUTPUT_DIR`), so every process of one run writes to one folder.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path

from memascend.config import FROM_SCRATCH_PRESETS, RunConfig
from memascend.errors import UserError

RUNS_ROOT = Path("runs")
"""Where fresh run folders go (relative to the working folder)."""
LATEST = "latest"
"""``runs/latest``: a link to the newest run folder."""
ENV_OUTPUT_DIR = "MEMASCEND_OUTPUT_DIR"
"""Set for the run's other processes: the run folder the first process chose."""

MEMASCEND_OUTPUTS = ("model", "report.json", "steps.jsonl", "memory_timeline.csv", "memory_timeline.png",
                     "tensorboard", "checkpoints")
"""What a run writes into its output folder (:mod:`memascend.train.recipe`, :mod:`memascend.train.run_log`,
:mod:`memascend.telemetry.tensorboard`, :mod:`memascend.train.checkpoints`): all that
``--overwrite-output`` removes."""
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


def _remove(folder: Path, names: tuple[str, ...]) -> None:
    for name in names:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def prepare_explicit_output(folder: Path, *, overwrite: bool, resume: bool) -> None:
    """Make an explicit ``--output`` ready, or refuse it (see the module doc).

    Raises:
        UserError: the folder holds something and neither ``overwrite`` nor ``resume`` is set; or it
            is a file.
    """
    held = _entries(folder)
    if not held:
        return
    if overwrite:
        _remove(folder, tuple(n for n in MEMASCEND_OUTPUTS if not (resume and n in KEPT_ON_RESUME)))
    elif resume:
        _remove(folder, tuple(n for n in MEMASCEND_OUTPUTS if n not in KEPT_ON_RESUME))
    else:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise UserError(f"--output {folder} is not empty ({shown}): give --overwrite-output to replace "
                        "memascend's files there, --resume to continue its run, or another folder")


def settle_output(cfg: RunConfig, *, given: bool, overwrite: bool, first_process: bool) -> tuple[RunConfig, bool]:
    """The run's output folder.

    Args:
        cfg: the run's config (``cfg.output_dir`` as the user gave it, or the default when not given).
        given: whether the user gave ``--output`` (flag or ``output_dir`` in ``--config``).
        overwrite: ``--overwrite-output``.
        first_process: whether this process decides for the run (not the supervised child, not a rank
            of ``--nproc``); it checks an explicit folder and passes a fresh one on in the environment.

    Returns:
        ``(cfg with output_dir set, whether the folder is a fresh run folder)``.

    Raises:
        UserError: as :func:`prepare_explicit_output`.
    """
    if given:
        if first_process:
            prepare_explicit_output(Path(cfg.output_dir), overwrite=overwrite, resume=cfg.train.resume is not None)
        return cfg, False
    inherited = os.environ.get(ENV_OUTPUT_DIR)
    folder = Path(inherited) if inherited and not first_process else fresh_run_dir(cfg)
    if first_process:
        os.environ[ENV_OUTPUT_DIR] = str(folder)
    return replace(cfg, output_dir=str(folder)), True


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
