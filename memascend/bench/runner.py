"""Run each configuration twice, stock DeepSpeed then memascend, each in its own process.

Every run is ``python -m memascend finetune ...`` in a fresh subprocess (so one run's allocator
state, page-locked memory and imported patches cannot leak into the other), with the same seed,
data, shapes and offload targets; only ``--engine`` differs. Runs are strictly sequential: never
two training processes at once (memory peaks would add up and step times would interfere).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from memascend.bench.matrix import BenchConfig

ENGINES = ("baseline", "memascend")


@dataclass(frozen=True)
class RunOutcome:
    """One engine's run of one configuration.

    Attributes:
        engine: ``baseline`` or ``memascend``.
        returncode: the finetune process's exit status (``None``: timed out).
        output_dir: the run's ``--output`` folder (``report.json``, ``memory_timeline.csv``).
        log_path: stdout+stderr of the process.
        wall_s: seconds the process ran.
    """

    engine: str
    returncode: int | None
    output_dir: Path
    log_path: Path
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.report_path.is_file()

    @property
    def report_path(self) -> Path:
        return self.output_dir / "report.json"

    @property
    def timeline_path(self) -> Path:
        return self.output_dir / "memory_timeline.csv"

    def report(self) -> dict | None:
        return json.loads(self.report_path.read_text()) if self.ok else None

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


def finetune_command(cfg: BenchConfig, engine: str, output_dir: Path, nvme_path: Path) -> list[str]:
    """The exact command line of one run (also written to the results for reruns)."""
    return [sys.executable, "-m", "memascend", "finetune",
            *cfg.finetune_args(engine=engine, output_dir=str(output_dir), nvme_path=str(nvme_path))]


def run_one(cfg: BenchConfig, engine: str, out_root: Path, nvme_path: Path, timeout_s: float,
            resume: bool = False) -> RunOutcome:
    """Run ``cfg`` with ``engine`` in a subprocess; output under ``out_root/<cfg.name>/<engine>``.

    With ``resume``, a ``report.json`` already there (from an earlier, completed run into the same
    folder) is taken instead of running again.
    """
    out_dir = out_root / cfg.name / engine
    log_path = out_root / cfg.name / f"{engine}.log"
    if resume and (out_dir / "report.json").is_file():
        return RunOutcome(engine, 0, out_dir, log_path, 0.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = out_dir / "report.json"
    stale.unlink(missing_ok=True)  # a report left from an earlier run must not pass for this one
    cmd = finetune_command(cfg, engine, out_dir, nvme_path)
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            rc: int | None = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            timeout=timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = None
            log.write(f"\nmemascend regress: timed out after {timeout_s:.0f} s\n")
    return RunOutcome(engine, rc, out_dir, log_path, time.monotonic() - t0)


def run_pair(cfg: BenchConfig, out_root: Path, nvme_path: Path, timeout_s: float,
             on_event: Callable[[str], None] | None = None, resume: bool = False) -> dict[str, RunOutcome]:
    """Baseline then memascend for one configuration."""
    outcomes = {}
    for engine in ENGINES:
        if on_event:
            on_event(f"{cfg.name}: {engine} ...")
        outcomes[engine] = run_one(cfg, engine, out_root, nvme_path, timeout_s, resume)
        if on_event:
            o = outcomes[engine]
            on_event(f"{cfg.name}: {engine} {'ok' if o.ok else f'FAILED (exit {o.returncode})'} in {o.wall_s:.0f} s")
    return outcomes


def run_matrix(configs: Iterable[BenchConfig], out_root: Path, nvme_path: Path, timeout_s: float = 3600.0,
               on_event: Callable[[str], None] | None = None, resume: bool = False) -> dict[str, dict[str, RunOutcome]]:
    """Run every configuration (sequentially) and return ``{config name: {engine: outcome}}``."""
    return {cfg.name: run_pair(cfg, out_root, nvme_path, timeout_s, on_event, resume) for cfg in configs}
