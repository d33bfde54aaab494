"""TensorBoard event files of a run (``--report-to tensorboard``): per-step scalars, written by rank 0
as the run goes into ``OUTPUT/tensorboard/`` (``tensorboard --logdir OUTPUT/tensorboard``).

The writer is torch's ``torch.utils.tensorboard.SummaryWriter`` (it needs the ``tensorboard``
package, a dependency of memascend). Each optimizer step's record (``steps.jsonl``'s line) becomes
the scalars of :data:`STEP_SCALARS` at that step; the held-out loss is ``eval/loss`` at the step it
was measured after (the one before training at the start step). Events are flushed after every step,
so a run that dies keeps what it logged.
"""

from __future__ import annotations

from pathlib import Path

TENSORBOARD_DIR = "tensorboard"
"""The folder under ``--output`` that holds the event files."""

EVENT_GLOB = "events.out.tfevents.*"
"""TensorBoard's event file names."""

STEP_SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "time_s": "train/step_s",
    "rss_bytes": "memory/rss_bytes",
    "locked_bytes": "memory/locked_bytes",
    "nvme_read_bytes": "nvme/read_bytes",
    "nvme_write_bytes": "nvme/write_bytes",
    "eval_loss": "eval/loss",
}
"""Step record key (``StepRecord.to_dict()``) -> TensorBoard tag. Units: bytes (per step for the NVMe
counters; RSS and locked at the step's end), seconds, tokens per second; a key that is ``None`` or
missing in a record is not written for that step."""


def check_tensorboard() -> None:
    """Raise when the ``tensorboard`` package cannot be imported (without importing it).

    Raises:
        UserError: naming the package and ``--report-to none``.
    """
    import importlib.util

    from memascend.errors import UserError

    if importlib.util.find_spec("tensorboard") is None:
        raise UserError("--report-to tensorboard needs the tensorboard package (pip install tensorboard), "
                        "or give --report-to none")


class TensorBoardLog:
    """Event files in ``log_dir`` (created). Event files of an earlier run there are removed first
    (as ``steps.jsonl`` is replaced), so the folder shows this run only.

    Args:
        log_dir: the folder (``OUTPUT/tensorboard``).

    Raises:
        UserError: the ``tensorboard`` package is not installed.
    """

    def __init__(self, log_dir: Path) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.created_dir = not self.log_dir.exists()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for old in self.log_dir.glob(EVENT_GLOB):
            old.unlink(missing_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        self.closed = False

    def step(self, record: dict) -> None:
        """Write one optimizer step's scalars (``record["step"]`` is the TensorBoard step)."""
        step = int(record["step"])
        for key, tag in STEP_SCALARS.items():
            value = record.get(key)
            if value is not None:
                self._writer.add_scalar(tag, float(value), step)
        self._writer.flush()

    def eval(self, step: int, loss: float | None) -> None:
        """The held-out loss measured after optimizer step ``step`` (0: before training)."""
        if loss is not None:
            self._writer.add_scalar(STEP_SCALARS["eval_loss"], float(loss), step)
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if not self.closed:
            self._writer.close()
            self.closed = True

    def discard(self) -> None:
        """Close and remove this run's event files (and the folder, if this log created it and it is
        left empty)."""
        self.close()
        for path in self.log_dir.glob(EVENT_GLOB):
            path.unlink(missing_ok=True)
        if self.created_dir:
            try:
                self.log_dir.rmdir()
            except OSError:
                pass
