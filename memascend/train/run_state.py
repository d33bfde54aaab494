"""The run-state folder that a supervised run's parent shares with its ranks, and the ranks' error lines.

:func:`memascend.train.supervisor.supervise` makes the folder (:func:`make_state_dir`,
``<tmp>/memascend-run-state-<parent pid>-<random>``) and removes it when the job ends. A parent that
is itself killed outright (SIGKILL) leaves it behind; the next supervised run reclaims it
(:func:`orphaned_state_dirs`): only when its parent and every rank it records are gone, as the swap
folder of a dead run is reclaimed.

Error lines: every rank of a launch with several ranks meets the same bad input (a refused
checkpoint folder, a busy swap folder) and raises the same error. Under a supervising parent each
rank records its ``memascend: error: ...`` line in the folder (:func:`say_error`); rank 0 prints its
own at once, and the parent prints, when the launch has ended, the lines other ranks had that rank 0
did not, each once (:func:`other_ranks_lines`). Without a supervising parent every rank prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from memascend.io.runlock import pid_alive

STATE_DIR_ENV = "MEMASCEND_RUN_STATE_DIR"
"""Environment variable naming the folder where ranks write their run-state files."""
STATE_PREFIX = "memascend-run-state-"
"""Name prefix of run-state folders (in the system's temporary folder)."""
_STATE_RE = re.compile(rf"^{re.escape(STATE_PREFIX)}(\d+)-[A-Za-z0-9_]+$")
_ERRORS_RE = re.compile(r"^errors-rank(\d+)\.txt$")


def make_state_dir() -> Path:
    """A new run-state folder named for this (the supervising) process's pid."""
    return Path(tempfile.mkdtemp(prefix=f"{STATE_PREFIX}{os.getpid()}-"))


def _recorded_pids(folder: Path) -> list[int]:
    pids = []
    for path in folder.glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            pids.append(int(json.loads(path.read_text()).get("pid")))
    return pids


def orphaned_state_dirs(root: str | os.PathLike | None = None) -> list[Path]:
    """Run-state folders under ``root`` (default: the system's temporary folder) whose supervising
    process and recorded ranks are all gone. Folders of other names, and of a live process (or a
    pid reused since), are never listed."""
    base = Path(root if root is not None else tempfile.gettempdir())
    found = []
    with contextlib.suppress(OSError):
        for child in sorted(base.iterdir()):
            m = _STATE_RE.match(child.name)
            if not m or child.is_symlink() or not child.is_dir() or int(m.group(1)) == os.getpid():
                continue
            if pid_alive(int(m.group(1))) or any(pid_alive(pid) for pid in _recorded_pids(child)):
                continue
            found.append(child)
    return found


def say_error(line: str) -> None:
    """Print ``line`` (a ``memascend: error: ...`` line) on stderr, once per launch: a rank of a
    supervised launch with several ranks also records it in the run-state folder, and a rank other
    than 0 leaves the printing to the parent (:func:`other_ranks_lines`)."""
    folder, rank = os.environ.get(STATE_DIR_ENV), os.environ.get("RANK")
    several = (os.environ.get("WORLD_SIZE") or "1").isdigit() and int(os.environ.get("WORLD_SIZE") or 1) > 1
    if folder and rank is not None and rank.isdigit() and several and os.path.isdir(folder):
        try:
            with open(os.path.join(folder, f"errors-rank{int(rank)}.txt"), "a") as f:
                f.write(line.replace("\n", " ") + "\n")
        except OSError:
            pass
        else:
            if int(rank) != 0:
                return
    print(line, file=sys.stderr, flush=True)


def other_ranks_lines(folder: str | os.PathLike) -> list[str]:
    """The error lines ranks other than 0 recorded (:func:`say_error`) that rank 0 did not print,
    each once, in rank order."""
    by_rank: dict[int, list[str]] = {}
    with contextlib.suppress(OSError):
        for path in Path(folder).iterdir():
            m = _ERRORS_RE.match(path.name)
            if m:
                with contextlib.suppress(OSError, UnicodeDecodeError):
                    by_rank[int(m.group(1))] = [ln for ln in path.read_text().splitlines() if ln.strip()]
    seen = set(by_rank.get(0, []))
    out = []
    for rank in sorted(r for r in by_rank if r != 0):
        for line in by_rank[rank]:
            if line not in seen:
                seen.add(line)
                out.append(line)
    return out
