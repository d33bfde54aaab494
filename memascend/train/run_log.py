"""What a run did, written as it goes, so that a run that crashes still shows it up to the crash.

Rank 0 writes into ``--output``:

* ``steps.jsonl``: one JSON object per optimizer step (the same record as ``report.json``'s
  ``steps[i]``), appended and flushed to the kernel when the step ends (a SIGKILL or OOM kill keeps
  every finished line; ``fsync`` is left to the checkpoints, which need it);
* ``report.json``: a partial report from the end of the set-up on (``"complete": false``, a
  ``status`` of ``running``, ``failed`` or ``interrupted``, the steps so far and the memory peaks so
  far), replaced atomically (write to a temporary file, rename) after every step and at the end by
  the full report (``"complete": true``);
* ``memory_timeline.csv``: one row per memory sample, appended while the run goes (the sampler
  streams it), rewritten whole at the end;
* ``tensorboard/``: with ``--report-to tensorboard``, the step records and held-out losses as
  TensorBoard scalars (:class:`memascend.telemetry.tensorboard.TensorBoardLog`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from memascend.telemetry import MemorySampler
from memascend.telemetry.tensorboard import TENSORBOARD_DIR, TensorBoardLog

STEPS_LOG = "steps.jsonl"
REPORT = "report.json"
TIMELINE_CSV = "memory_timeline.csv"


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` through a temporary file and a rename, so that a
    reader (or a crash) only ever sees the old or the new whole file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


class RunLog:
    """Rank 0's running record of a run (see the module doc).

    Args:
        out_dir: the run's ``--output`` folder (exists).
        sampler: the run's memory sampler; its CSV is streamed to ``memory_timeline.csv``.
        header: what is known before the first step (engine, config, model, data), copied into
            every partial report.
        tensorboard: also write TensorBoard event files into ``out_dir/tensorboard``.

    Raises:
        UserError: ``tensorboard`` without the ``tensorboard`` package.
    """

    def __init__(self, out_dir: Path, sampler: MemorySampler, header: dict, *, tensorboard: bool = False) -> None:
        self.out_dir = out_dir
        self.sampler = sampler
        self.header = dict(header)
        self.steps: list[dict] = []
        self._t0 = time.time()
        self.tensorboard = TensorBoardLog(out_dir / TENSORBOARD_DIR) if tensorboard else None
        (out_dir / STEPS_LOG).unlink(missing_ok=True)  # a log of an earlier run in this folder
        self._steps_file = open(out_dir / STEPS_LOG, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        sampler.stream_csv(out_dir / TIMELINE_CSV)
        self._write_partial("running")

    def step(self, record: dict) -> None:
        """Log one finished optimizer step (``record`` as in ``report.json``'s ``steps``)."""
        self.steps.append(record)
        self._steps_file.write(json.dumps(record) + "\n")
        self._steps_file.flush()
        if self.tensorboard is not None:
            self.tensorboard.step(record)
        self._write_partial("running")

    def eval(self, step: int, loss: float | None) -> None:
        """Log a held-out loss measured outside a step record (before training: ``step`` is the
        start step; after it, when the last step did not evaluate)."""
        if self.tensorboard is not None:
            self.tensorboard.eval(step, loss)

    def fail(self, exc: BaseException, *, discard: bool = False) -> None:
        """Mark the partial report as ended by ``exc`` (Ctrl-C/SIGTERM: ``interrupted``); with
        ``discard`` (a refused run: bad input), remove what this log wrote instead."""
        self.close()
        if discard:
            for name in (STEPS_LOG, REPORT, TIMELINE_CSV):
                (self.out_dir / name).unlink(missing_ok=True)
            if self.tensorboard is not None:
                self.tensorboard.discard()
            return
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
        self._write_partial(status, error=f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Close the step log and the event file, stop streaming the timeline (idempotent)."""
        if not self._steps_file.closed:
            self._steps_file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        self.sampler.stream_csv(None)

    def _write_partial(self, status: str, error: str | None = None) -> None:
        write_json_atomic(
            self.out_dir / REPORT,
            {
                **self.header,
                "complete": False,
                "status": status,
                "error": error,
                "steps": self.steps,
                "num_steps": len(self.steps),
                "memory": self.sampler.summary(),
                "wall_s": time.time() - self._t0,
            },
        )
