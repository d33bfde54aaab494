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

A write into ``--output`` that fails (a full disk, an I/O error) is a
:class:`~memascend.errors.DeviceError` naming the folder (:func:`output_errors`), not a traceback; the
partial report is then marked ``failed`` where the disk still allows it (:func:`write_json_atomic`'s
in-place fallback), and no temporary file is left behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memascend.errors import DeviceError
from memascend.telemetry import MemorySampler
from memascend.telemetry.tensorboard import TENSORBOARD_DIR, TensorBoardLog

STEPS_LOG = "steps.jsonl"
REPORT = "report.json"
TIMELINE_CSV = "memory_timeline.csv"


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def write_json_atomic(path: Path, obj: Any, *, in_place_when_full: bool = False) -> None:
    """Write ``obj`` as indented JSON to ``path`` through a temporary file and a rename, so that a
    reader (or a crash) only ever sees the old or the new whole file.

    Args:
        path: the file.
        obj: what to write (JSON-serialisable).
        in_place_when_full: when the disk is full (the temporary copy does not fit), overwrite
            ``path`` itself if the new text fits in the space its old text already holds (no new
            blocks needed on a filesystem that overwrites in place): a last record, such as a report
            marked ``failed``, is then still written. The write is no longer atomic then.

    Raises:
        OSError: the write or the rename failed (e.g. ENOSPC); the temporary file is removed and
            ``path`` is as it was (unless the in-place fallback ran and failed too).
    """
    text = json.dumps(obj, indent=2) + "\n"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if not (in_place_when_full and exc.errno in _DISK_FULL and _overwrite_within_allocation(path, text)):
            raise


def _overwrite_within_allocation(path: Path, text: str) -> bool:
    """Overwrite ``path`` with ``text`` where ``text`` fits in the bytes the file already has on disk;
    whether it was written."""
    data = text.encode()
    try:
        st = path.stat()
        if len(data) > st.st_blocks * 512:
            return False
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate(len(data))
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        return False
    return True


@contextlib.contextmanager
def output_errors(out_dir: Path, what: str) -> Iterator[None]:
    """Turn an ``OSError`` of writing ``what`` into ``out_dir`` (``--output``) into one
    :class:`~memascend.errors.DeviceError` line: a full disk says so with the space left.

    Raises:
        DeviceError: the write failed (ENOSPC/EDQUOT: "--output X is full"; otherwise the OS error).
    """
    try:
        yield
    except OSError as exc:
        if exc.errno in _DISK_FULL or _says_disk_full(exc):
            free = ""
            with contextlib.suppress(OSError):
                from memascend.units import format_bytes

                free = f" ({format_bytes(shutil.disk_usage(out_dir).free)} free)"
            raise DeviceError(f"--output {out_dir} is full{free}: writing {what} failed; free space there (or give "
                              "another --output) and resume from the last complete checkpoint") from None
        raise DeviceError(f"--output {out_dir}: writing {what} failed: {exc.strerror or exc}") from None
    except Exception as exc:
        if not _says_disk_full(exc):
            raise
        raise DeviceError(f"--output {out_dir} is full: writing {what} failed ({_first_line(exc)}); free space "
                          "there (or give another --output) and resume from the last complete checkpoint") from None


def _says_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (not an ``OSError``: safetensors' ``SafetensorError`` when the model is saved)
    reports a full disk in its text, as writers in Rust or C++ do ("No space left on device (os
    error 28)")."""
    return "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc)


def _first_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


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
        """Log one finished optimizer step (``record`` as in ``report.json``'s ``steps``).

        Raises:
            DeviceError: writing into ``--output`` failed (a full disk: :func:`output_errors`),
                including the timeline the sampler streams.
        """
        self.steps.append(record)
        with output_errors(self.out_dir, STEPS_LOG):
            self._steps_file.write(json.dumps(record) + "\n")
            self._steps_file.flush()
        with output_errors(self.out_dir, TIMELINE_CSV):
            csv_error = getattr(self.sampler, "csv_error", None)
            if csv_error is not None:
                raise csv_error
        if self.tensorboard is not None:
            with output_errors(self.out_dir, TENSORBOARD_DIR):
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
        with contextlib.suppress(DeviceError):  # the run's own error is what the user sees
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
        """Close the step log and the event file, stop streaming the timeline (idempotent; each is
        closed even when another fails, e.g. a flush on a full disk).

        Raises:
            DeviceError: a final flush into ``--output`` failed.
        """
        with output_errors(self.out_dir, STEPS_LOG), contextlib.ExitStack() as closing:
            if self.tensorboard is not None:
                closing.callback(self.tensorboard.close)
            closing.callback(self.sampler.stream_csv, None)
            if not self._steps_file.closed:
                self._steps_file.close()

    def _write_partial(self, status: str, error: str | None = None) -> None:
        """Replace ``report.json`` with the partial report. A final status (not ``running``) is still
        written when the disk is too full for an atomic replacement: in place, and without the step
        records (``steps.jsonl`` holds them) if the whole report does not fit where the old one was."""
        rep = {
            **self.header,
            "complete": False,
            "status": status,
            "error": error,
            "steps": self.steps,
            "num_steps": len(self.steps),
            "memory": self.sampler.summary(),
            "wall_s": time.time() - self._t0,
        }
        final = status != "running"
        with output_errors(self.out_dir, REPORT):
            try:
                write_json_atomic(self.out_dir / REPORT, rep, in_place_when_full=final)
            except OSError as exc:
                if not (final and exc.errno in _DISK_FULL):
                    raise
                write_json_atomic(self.out_dir / REPORT, {**rep, "steps": [], "steps_in": STEPS_LOG},
                                  in_place_when_full=True)
