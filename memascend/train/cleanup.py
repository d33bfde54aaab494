"""The ledger of what a run must undo at exit, filled in as :class:`~memascend.train.recipe.FinetuneRecipe`
sets the run up, and run once at the end (after a success, a failure or an interrupt).

Swap files live in a private folder under the NVMe path and are removed at exit, including on Ctrl-C,
SIGTERM and errors; a raw store is closed by the seam's ``revert`` (a file target is deleted; a device
keeps the store header so the next run reuses it).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from memascend.train.run_log import RunLog
from memascend.train.swapdir import remove_swap_dir


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
