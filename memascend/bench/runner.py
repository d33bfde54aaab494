"""Run each configuration twice, stock DeepSpeed then memascend, each in its own process.

Every run is ``python -m memascend finetune ...`` in a fresh subprocess (so one run's allocator
state, page-locked memory and imported patches cannot leak into the other), with the same seed,
data, shapes and offload targets; only ``--engine`` differs. Runs are strictly sequential: never
two training processes at once (memory peaks would add up and step times would interfere).

With a memory cap every run is started by :func:`memascend.bench.cgroup.run_capped` in a fresh
memory cgroup with that hard limit (its outcome, ``<engine>.cap.json`` next to the run's log, says
whether it fit or was OOM-killed and its cgroup peak). A capped search (:func:`run_matrix` with
``search``) runs the configurations in order and stops an engine at its first run that did not
complete: larger models are not tried for it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

from memascend.bench.cgroup import CappedResult, run_capped
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
        cap: the memory-cap outcome where the run ran under a cap.
        skipped: why the run was not started (a capped search stopped this engine earlier).
    """

    engine: str
    returncode: int | None
    output_dir: Path
    log_path: Path
    wall_s: float
    cap: CappedResult | None = None
    skipped: str | None = None

    @property
    def ok(self) -> bool:
        return (self.skipped is None and self.returncode == 0 and self.report_path.is_file()
                and (self.cap is None or self.cap.fit))

    @property
    def status(self) -> str:
        """``ok`` (completed, within the cap if any), ``capped`` (the cap stopped it: OOM-killed, or
        not enforced and over it), ``skipped`` (not run) or ``error`` (anything else: a crash, a
        timeout, the host's OOM killer, no report)."""
        if self.skipped is not None:
            return "skipped"
        if self.cap is not None and self.cap.stopped_by_cap:
            return "capped"
        return "ok" if self.ok else "error"

    def describe(self) -> str:
        """One line: ``ok``, the cap's verdict, ``skipped: ...`` or ``FAILED (exit N)``."""
        if self.skipped is not None:
            return f"skipped ({self.skipped})"
        if self.cap is not None and self.cap.outcome != "fit":
            return self.cap.verdict
        if self.ok:
            return "ok" + (f": {self.cap.verdict}" if self.cap else "")
        if self.returncode is None:
            return "FAILED (timed out)"
        return f"FAILED (exit {self.returncode}{'' if self.returncode != 0 else ', no report.json'})"

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
            resume: bool = False, memory_cap: int | None = None) -> RunOutcome:
    """Run ``cfg`` with ``engine`` in a subprocess; output under ``out_root/<cfg.name>/<engine>``.

    With ``memory_cap`` (bytes) the run is confined to a fresh memory cgroup with that hard limit
    (see :mod:`memascend.bench.cgroup`); its outcome is written to ``<cfg.name>/<engine>.cap.json``.

    With ``resume``, an earlier run into the same folder is taken instead of running again: its
    ``report.json`` (uncapped), or under a cap the ``.cap.json`` of a run with the same cap that
    completed or was stopped by the cap.
    """
    out_dir = out_root / cfg.name / engine
    log_path = out_root / cfg.name / f"{engine}.log"
    cap_path = out_root / cfg.name / f"{engine}.cap.json"
    if resume:
        earlier = _earlier(out_dir, log_path, cap_path, engine, memory_cap)
        if earlier is not None:
            return earlier
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = out_dir / "report.json"
    stale.unlink(missing_ok=True)  # a report left from an earlier run must not pass for this one
    cap_path.unlink(missing_ok=True)
    cmd = finetune_command(cfg, engine, out_dir, nvme_path)
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    swap_before = _swap_dirs(nvme_path)
    t0 = time.monotonic()
    cap = None
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        if memory_cap is not None:
            cap = run_capped(cmd, memory_cap, timeout_s=timeout_s, stdout=log, stderr=subprocess.STDOUT, env=env)
            rc = cap.returncode
            log.write(f"\nmemascend regress: {cap.verdict} ({cap.mechanism})\n")
            cap_path.write_text(json.dumps(cap.to_dict(), indent=2) + "\n")
        else:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    timeout=timeout_s, check=False).returncode
            except subprocess.TimeoutExpired:
                rc = None
                log.write(f"\nmemascend regress: timed out after {timeout_s:.0f} s\n")
        for leftover in _remove_leftover_swap(nvme_path, swap_before):
            log.write(f"memascend regress: removed the swap folder {leftover} the killed run left behind\n")
    return RunOutcome(engine, rc, out_dir, log_path, time.monotonic() - t0, cap)


def _swap_dirs(nvme_path: Path) -> set[str]:
    try:
        return {p.name for p in Path(nvme_path).iterdir() if p.name.startswith("memascend-")}
    except OSError:
        return set()


def _remove_leftover_swap(nvme_path: Path, before: set[str]) -> list[Path]:
    """Remove the private swap folders (``memascend-<time>-<pid>``) a run created and could not remove
    itself because it was killed (OOM kill, timeout): new since ``before`` and their process gone, so
    a live run sharing the NVMe path keeps its folder."""
    removed = []
    for name in sorted(_swap_dirs(nvme_path) - before):
        m = re.fullmatch(r"memascend-\d{8}-\d{6}-(\d+)", name)
        if m and not psutil.pid_exists(int(m.group(1))):
            shutil.rmtree(Path(nvme_path) / name, ignore_errors=True)
            removed.append(Path(nvme_path) / name)
    return removed


def _earlier(out_dir: Path, log_path: Path, cap_path: Path, engine: str, memory_cap: int | None) -> RunOutcome | None:
    has_report = (out_dir / "report.json").is_file()
    if memory_cap is None:
        return RunOutcome(engine, 0, out_dir, log_path, 0.0) if has_report else None
    try:
        cap = CappedResult.from_dict(json.loads(cap_path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if cap.cap_bytes != memory_cap or not (cap.stopped_by_cap or (cap.fit and has_report)):
        return None
    return RunOutcome(engine, cap.returncode, out_dir, log_path, 0.0, cap)


def run_pair(cfg: BenchConfig, out_root: Path, nvme_path: Path, timeout_s: float,
             on_event: Callable[[str], None] | None = None, resume: bool = False, memory_cap: int | None = None,
             skip: dict[str, str] | None = None) -> dict[str, RunOutcome]:
    """Baseline then memascend for one configuration; engines in ``skip`` (engine -> why) are not run."""
    outcomes = {}
    for engine in ENGINES:
        if skip and engine in skip:
            outcomes[engine] = RunOutcome(engine, None, out_root / cfg.name / engine,
                                          out_root / cfg.name / f"{engine}.log", 0.0, skipped=skip[engine])
        else:
            if on_event:
                on_event(f"{cfg.name}: {engine} ...")
            outcomes[engine] = run_one(cfg, engine, out_root, nvme_path, timeout_s, resume, memory_cap=memory_cap)
        if on_event:
            o = outcomes[engine]
            on_event(f"{cfg.name}: {engine} {o.describe()}" + ("" if o.skipped else f" in {o.wall_s:.0f} s"))
    return outcomes


def run_matrix(configs: Iterable[BenchConfig], out_root: Path, nvme_path: Path, timeout_s: float = 3600.0,
               on_event: Callable[[str], None] | None = None, resume: bool = False, memory_cap: int | None = None,
               search: bool = False) -> dict[str, dict[str, RunOutcome]]:
    """Run every configuration (sequentially) and return ``{config name: {engine: outcome}}``.

    Args:
        memory_cap: run each process under this hard memory cap (bytes).
        search: a largest-model search: ``configs`` are in ascending size, and an engine whose run
            does not complete (stopped by the cap, or failed) is not run on the configs after it.
    """
    results: dict[str, dict[str, RunOutcome]] = {}
    stopped: dict[str, str] = {}
    for cfg in configs:
        pair = run_pair(cfg, out_root, nvme_path, timeout_s, on_event, resume, memory_cap, skip=dict(stopped))
        results[cfg.name] = pair
        if search:
            for engine, o in pair.items():
                if engine not in stopped and o.status in ("capped", "error"):
                    why = {"oom-killed": "OOM-killed under the cap", "over-cap": "over the cap"}.get(
                        o.cap.outcome if o.cap else "", "failed")
                    stopped[engine] = f"{engine} {why} at {cfg.name}"
    return results
