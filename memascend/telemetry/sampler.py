"""Background sampler of host (and GPU) memory with phase markers.

Reads ``/proc/<pid>/status`` (VmRSS, VmHWM, VmLck), ``/proc/<pid>/io`` (read_bytes, write_bytes:
storage-layer bytes, O_DIRECT included) and, less often because it walks ``smaps``, USS through
psutil. Where CUDA is present it also records ``torch.cuda.memory_allocated/reserved``.

Phase markers (``load``, ``initialize``, ``eval``, ``forward``, ``backward``, ``step``, ``save``)
are timestamped so a plot shows where the memory went; the peak RSS of every phase is tracked
from the samples taken while it was current.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from memascend.procfs import status_bytes

_STATUS_KEYS = {"VmRSS": "rss_bytes", "VmHWM": "hwm_bytes", "VmLck": "locked_bytes"}


def read_proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS/VmHWM/VmLck of a process, in bytes (keys ``rss_bytes``, ``hwm_bytes``, ``locked_bytes``).

    Raises:
        OSError: the process is gone.
    """
    return {**dict.fromkeys(_STATUS_KEYS.values(), 0), **status_bytes(_STATUS_KEYS, pid)}


def read_proc_io(pid: int | str = "self") -> dict[str, int]:
    """Storage-layer bytes read/written by a process (``read_bytes``, ``write_bytes``); zeros if unavailable."""
    out = {"read_bytes": 0, "write_bytes": 0}
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] = int(rest)
    except OSError:
        pass
    return out


@dataclass
class Sample:
    t_s: float
    """Seconds since the sampler started."""
    rss_bytes: int
    hwm_bytes: int
    locked_bytes: int
    uss_bytes: int | None
    read_bytes: int
    write_bytes: int
    gpu_allocated_bytes: int | None
    gpu_reserved_bytes: int | None
    phase: str


@dataclass
class PhaseMark:
    t_s: float
    phase: str


@dataclass
class MemorySampler:
    """Samples this process every ``interval_s`` seconds in a daemon thread.

    Use as a context manager; call :meth:`phase` at phase boundaries. Thread-safe.
    """

    interval_s: float = 0.25
    uss_every: int = 8
    """Take USS (expensive: walks smaps) every this many samples."""
    samples: list[Sample] = field(default_factory=list)
    marks: list[PhaseMark] = field(default_factory=list)
    phase_peak_rss_bytes: dict[str, int] = field(default_factory=dict)
    phase_peak_locked_bytes: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._proc = psutil.Process(os.getpid())
        self._t0 = time.monotonic()
        self._phase = "start"
        self._lock = threading.Lock()
        # Held across a whole sample (reads + attribution) and by phase(): a sample belongs to the
        # phase that was current during all of its reads, never to one that began mid-read.
        self._sample_lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._n = 0
        self._csv = None  # open file the samples are streamed to (stream_csv)
        # why streaming the timeline stopped (a full disk), or None: sampling goes on without the
        # stream, and the run's log raises this at its next step
        self.csv_error: OSError | None = None
        self._cuda = None
        try:
            import torch

            if torch.cuda.is_available():
                self._cuda = torch.cuda
        except ImportError:  # pragma: no cover - torch is a dependency
            pass

    def __enter__(self) -> MemorySampler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="memascend-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.sample()
        self.stream_csv(None)

    def phase(self, name: str) -> None:
        """Mark the start of phase ``name`` (and take a sample right away).

        Waits for a sample in flight in the sampler thread, so memory touched after this returns is
        never attributed to the phase before.
        """
        with self._sample_lock:
            with self._lock:
                self._phase = name
                self.marks.append(PhaseMark(time.monotonic() - self._t0, name))
            self.sample()

    @property
    def current_phase(self) -> str:
        return self._phase

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except OSError:
                return

    def sample(self) -> Sample:
        """Read this process's memory and I/O counters now and attribute them to the current phase."""
        with self._sample_lock:
            return self._sample()

    def _sample(self) -> Sample:
        status = read_proc_status()
        io = read_proc_io()
        uss = None
        if self._n % self.uss_every == 0:
            try:
                uss = int(self._proc.memory_full_info().uss)
            except (psutil.Error, OSError):
                uss = None
        gpu_alloc = gpu_res = None
        if self._cuda is not None:
            gpu_alloc, gpu_res = int(self._cuda.memory_allocated()), int(self._cuda.memory_reserved())
        with self._lock:
            self._n += 1
            s = Sample(
                t_s=time.monotonic() - self._t0,
                uss_bytes=uss,
                gpu_allocated_bytes=gpu_alloc,
                gpu_reserved_bytes=gpu_res,
                phase=self._phase,
                **status,
                **io,
            )
            self.samples.append(s)
            if self._csv is not None:
                try:
                    self._csv.write(_csv_row(s) + "\n")
                    self._csv.flush()
                except OSError as exc:
                    self._stop_stream(exc)
            ph = self._phase
            self.phase_peak_rss_bytes[ph] = max(self.phase_peak_rss_bytes.get(ph, 0), s.rss_bytes)
            self.phase_peak_locked_bytes[ph] = max(self.phase_peak_locked_bytes.get(ph, 0), s.locked_bytes)
        return s

    # ---- summaries -------------------------------------------------------------------------
    def peak(self, key: str) -> int:
        with self._lock:
            return max((getattr(s, key) or 0) for s in self.samples) if self.samples else 0

    def summary(self) -> dict:
        """Peaks over the run, in bytes. ``peak_rss_bytes`` is max(sampled RSS, the kernel's VmHWM)."""
        with self._lock:
            hwm = max((s.hwm_bytes for s in self.samples), default=0)
            rss = max((s.rss_bytes for s in self.samples), default=0)
            uss = max((s.uss_bytes or 0 for s in self.samples), default=0)
            locked = max((s.locked_bytes for s in self.samples), default=0)
            gpu = max((s.gpu_reserved_bytes or 0 for s in self.samples), default=0)
            return {
                "peak_rss_bytes": max(hwm, rss),
                "peak_sampled_rss_bytes": rss,
                "peak_uss_bytes": uss,
                "peak_locked_bytes": locked,
                "peak_gpu_reserved_bytes": gpu if self._cuda is not None else None,
                "phase_peak_rss_bytes": dict(self.phase_peak_rss_bytes),
                "phase_peak_locked_bytes": dict(self.phase_peak_locked_bytes),
                "num_samples": len(self.samples),
            }

    def write_csv(self, path: str | os.PathLike) -> None:
        """One row per sample (:data:`CSV_COLUMNS`); byte columns; empty cells where a value was
        not taken."""
        with self._lock:
            rows = list(self.samples)
        Path(path).write_text("\n".join([",".join(CSV_COLUMNS), *(_csv_row(s) for s in rows)]) + "\n")

    def _stop_stream(self, exc: OSError) -> None:
        """Stop streaming the timeline after a failed write (the file is closed, the error kept in
        :attr:`csv_error`); the samples stay in memory. Called with ``_lock`` held."""
        self.csv_error = self.csv_error or exc
        with contextlib.suppress(OSError):
            self._csv.close()
        self._csv = None

    def stream_csv(self, path: str | os.PathLike | None) -> None:
        """Write the samples so far to ``path`` as :meth:`write_csv` does, then append every new
        sample as it is taken (flushed), so the timeline survives a crash; ``None`` stops."""
        with self._lock:
            if self._csv is not None:
                try:
                    self._csv.close()
                except OSError as exc:
                    self._stop_stream(exc)
                self._csv = None
            if path is None:
                return
            f = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by stream_csv(None)
            f.write("\n".join([",".join(CSV_COLUMNS), *(_csv_row(s) for s in self.samples)]) + "\n")
            f.flush()
            self._csv = f


#: Columns of the memory timeline CSV, in order.
CSV_COLUMNS = (
    "t_s",
    "phase",
    "rss_bytes",
    "uss_bytes",
    "hwm_bytes",
    "locked_bytes",
    "read_bytes",
    "write_bytes",
    "gpu_allocated_bytes",
    "gpu_reserved_bytes",
)


def _csv_row(s: Sample) -> str:
    vals = []
    for c in CSV_COLUMNS:
        v = getattr(s, c)
        vals.append("" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v)))
    return ",".join(vals)
