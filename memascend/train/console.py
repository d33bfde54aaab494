"""What a run prints while it starts and trains, besides the progress bar and the summary table.

* Phase lines: rank 0 prints one line when a phase of the start-up ends (data read, model loaded,
  DeepSpeed initialized, the first held-out loss) and for every evaluation and save, with the seconds
  since the command started: ``[  28.1s] model loaded (134.5M params, bf16)``. They go to stderr
  through ``tqdm.write``, so a line printed while the progress bar is up leaves the bar intact.
* DeepSpeed's chatter, quiet unless ``--verbose``: its logger (``deepspeed.utils.logger``, the
  ``logging`` logger named ``DeepSpeed``) passes ERROR and CRITICAL records only (its consumer-SSD
  write-endurance warning, for one, is a WARNING printed on every rank of every run), and the
  Python-level prints of an op loaded from the build cache ("DeepSpeed ... shm_comm_op built
  successfully") are held back; they are printed after all when the block that made them fails. A
  real compile's output (ninja, the compiler) comes from child processes and is never held back.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import time
from collections.abc import Callable, Iterator

DEEPSPEED_LOGGER = "DeepSpeed"
"""The ``logging`` name of ``deepspeed.utils.logger`` (DeepSpeed 0.19.8, ``utils/logging.py``)."""


_run_start_s: float | None = None
"""When the run's command started (:func:`mark_run_start`); ``None``: not marked."""


def mark_run_start(start_s: float | None = None) -> None:
    """Record when the run's command started: ``start_s`` (the supervising parent's start, from the
    run's handover, :mod:`memascend.train.handover`), else this process's start time."""
    global _run_start_s
    if start_s is None:
        import psutil

        start_s = psutil.Process().create_time()
    _run_start_s = float(start_s)


def run_start_s() -> float:
    """When the run's command started (``time.time()`` seconds): what :func:`mark_run_start`
    recorded, else this process's start time."""
    if _run_start_s is not None:
        return _run_start_s
    import psutil

    return psutil.Process().create_time()


class PhaseLines:
    """Rank 0's phase lines (see the module doc).

    Args:
        enabled: print (rank 0) or stay silent (the other ranks).
        start_s: wall-clock start the seconds count from (default :func:`run_start_s`).
    """

    def __init__(self, enabled: bool, start_s: float | None = None) -> None:
        self.enabled = enabled
        self.start_s = run_start_s() if start_s is None else start_s
        self.lines: list[str] = []

    def elapsed_s(self) -> float:
        """Seconds since the command started."""
        return time.time() - self.start_s

    def line(self, text: str) -> None:
        """Print ``[ elapsed s] text`` on stderr (kept in :attr:`lines`), unless disabled."""
        if not self.enabled:
            return
        from tqdm import tqdm

        out = f"[{self.elapsed_s():6.1f}s] {text}"
        self.lines.append(out)
        tqdm.write(out, file=sys.stderr)
        sys.stderr.flush()


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def quiet_deepspeed_logger(verbose: bool) -> Callable[[], None]:
    """Let only ERROR and CRITICAL records of DeepSpeed's logger through (nothing changes with
    ``verbose``). Works before DeepSpeed is imported: the filter sits on the named logger, which
    DeepSpeed's ``LoggerFactory`` takes over (it sets a level and adds a handler, filters stay).

    Returns:
        A function that removes the filter again.
    """
    if verbose:
        return lambda: None
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    only_errors = _ErrorsOnly()
    logger.addFilter(only_errors)
    return lambda: logger.removeFilter(only_errors)


@contextlib.contextmanager
def quiet_prints(verbose: bool) -> Iterator[None]:
    """Hold back what Python code prints to ``sys.stdout`` in the block (unless ``verbose``); if the
    block raises, what was held back is written to stderr before the error goes on."""
    if verbose:
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        sys.stderr.flush()
        raise


def run_banner(cfg) -> str:
    """The first phase line: model, data, engine and output folder of the run (a ``RunConfig``)."""
    fs = cfg.model.from_scratch
    family = "Llama" if fs is None or fs.arch == "llama" else fs.arch
    model = f"from-scratch {family} ({fs.hidden_size} wide, {fs.num_layers} layers)" if fs else cfg.model.name_or_path
    return f"memascend finetune: {model} on {cfg.data.source}, engine {cfg.engine}, output {cfg.output_dir}"


def format_params(numel: int) -> str:
    """A parameter count as people write it: ``134.5M``, ``1.24B``, ``850K``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if numel >= size:
            return f"{numel / size:.{2 if unit == 'B' else 1}f}{unit}"
    return str(numel)


def progress_bar(total: int, enabled: bool):
    """The run's step progress bar (``tqdm`` on stderr; silent when not ``enabled``)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="fine-tune", unit="step", disable=not enabled, dynamic_ncols=True)
