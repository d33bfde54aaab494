"""Where a run's checkpoints are and what they are named: the tag folders (``global_step<N>``), the
staging folders of saves in progress (``.partial-*``), ``latest``, the periodic checkpoints' root
(``<output>/checkpoints``), and the complete checkpoints found under a root."""

from __future__ import annotations

import os
import re
from pathlib import Path

from memascend.errors import IntegrityError, UserError
from memascend.train.checkpoints.manifest import MANIFEST_NAME, Checkpoint, read_manifest

#: Sub-folder of ``--output`` that holds periodic checkpoints (what ``--resume auto`` searches).
CHECKPOINTS_SUBDIR = "checkpoints"
#: Prefix of a staging folder; such folders are never resumed.
PARTIAL_PREFIX = ".partial-"
LATEST = "latest"
"""The file in a checkpoint root that names the newest tag (DeepSpeed's)."""

TAG_RE = re.compile(r"^global_step(\d+)$")
"""A tag folder's name; group 1 is the step."""


def tag_for_step(step: int) -> str:
    """``global_step<N>``: DeepSpeed's default tag, used for every memascend checkpoint."""
    return f"global_step{int(step)}"


def memascend_checkpoint_entries(root: str | os.PathLike) -> list[Path]:
    """memascend's checkpoints in ``root``: ``global_step<N>`` folders holding memascend's manifest,
    and the ``latest`` file (symbolic links are never listed; a missing root lists nothing)."""
    base = Path(root)
    found: list[Path] = []
    if not base.is_dir():
        return found
    for child in base.iterdir():
        if child.is_symlink():
            continue
        if child.is_dir() and TAG_RE.fullmatch(child.name) and (child / MANIFEST_NAME).is_file():
            found.append(child)
        elif child.name == LATEST and child.is_file():
            found.append(child)
    return found


def complete_checkpoints(root: str | os.PathLike) -> list[Checkpoint]:
    """Complete checkpoints (tag folders with a readable manifest) under ``root``, oldest first.
    Staging folders and tag folders without a manifest are skipped; a damaged manifest is too."""
    base = Path(root)
    found = []
    if not base.is_dir():
        return found
    for child in base.iterdir():
        if not TAG_RE.match(child.name) or not child.is_dir():
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


def latest_tag(base: Path, resume: str) -> str | None:
    """The tag ``base/latest`` names (``None`` without the file).

    Raises:
        UserError: the file cannot be read (``resume``: the ``--resume`` value the message names).
    """
    latest = base / LATEST
    if not latest.is_file():
        return None
    try:
        return latest.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--resume {resume}: cannot read {latest}: {exc}") from None
