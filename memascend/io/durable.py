"""Writes that survive a crash or a power cut: the whole new file or the old one, on disk.

Used where a later run trusts a file because it exists (a checkpoint's manifest, ``latest``).
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    """``fsync`` a folder, so that entries created or renamed in it are on disk.

    Raises:
        OSError: the folder cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_durable(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably: a temporary file beside it, ``fsync``,
    rename over ``path``, ``fsync`` of the folder. A crash at any point leaves the old file or the
    new one, never a mix (and at most a ``.<name>.tmp-<pid>`` file).

    Raises:
        OSError: the write, sync or rename failed (e.g. ENOSPC); ``path`` is then unchanged.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
