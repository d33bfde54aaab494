"""Run each configuration twice, stock DeepSpeed then memascend, each in its own process.

Every run is ``python -m memascend finetune ...`` in a fresh subprocess (so one run's allocator
state, page-locked memory and imported patches cannot leak into the other), with the same seed,
data, shapes and offload targets; only ``--engine`` differs. Runs are strictly sequential: never
two training processes at once (memory peaks would add up and step times would interfere).

A configuration of several simulated nodes (``BenchConfig.nnodes`` > 1) runs as one launcher per
node, started together on this host (:func:`node_commands`): one run of several processes, the
pair still one engine after the other.

With a memory cap every run is started by :func:`memascend.host.memcap.run_capped` in a fresh
memory cgroup with that hard limit (its outcome, ``<engine>.cap.json`` next to the run's log, says
whether it fit or was OOM-killed and its cgroup peak). A capped search (:func:`run_matrix` with
``search``) runs the configurations in order and stops an engine at its first run that did not
complete: larger models are not tried for it.

With ``repeats`` > 1 the pair runs that many times, alternating the order (baseline first, then
memascend first, ...) so that a drift of the machine's load hits both engines alike; repeat ``k``
> 0 writes to ``<engine>.r<k>``. Each engine's report is then the merge of its repeats
(:func:`merge_repeat_reports`): medians of step time and memory peaks, every repeat's values kept.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from memascend.errors import UserError
from memascend.host.memcap import CappedResult, run_capped
from memascend.regress.matrix import BenchConfig

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
        repeats: the same engine's later runs of the configuration (``regress --repeats``).
    """

    engine: str
    returncode: int | None
    output_dir: Path
    log_path: Path
    wall_s: float
    cap: CappedResult | None = None
    skipped: str | None = None
    repeats: tuple[RunOutcome, ...] = ()

    @property
    def ok(self) -> bool:
        return (self.skipped is None and self.returncode == 0 and self.report_path.is_file()
                and (self.cap is None or self.cap.fit) and all(r.ok for r in self.repeats))

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
        for k, r in enumerate(self.repeats, start=1):
            if not r.ok:
                return f"repeat {k}: {r.describe()}"
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
        """The run's ``report.json`` (merged over the repeats, if any), ``None`` unless ok."""
        if not self.ok:
            return None
        first = json.loads(self.report_path.read_text())
        if not self.repeats:
            return first
        return merge_repeat_reports([first, *(json.loads(r.report_path.read_text()) for r in self.repeats)])

    def required_report(self) -> dict:
        """:meth:`report`, for callers that cannot go on without it.

        Raises:
            UserError: the run did not complete (:meth:`describe` says how), naming its log.
        """
        doc = self.report()
        if doc is None:
            raise UserError(f"the {self.output_dir.name} run: {self.describe()}; see {self.log_path}")
        return doc

    def log_tail(self, lines: int = 5) -> str:
        failed = next((r for r in self.repeats if not r.ok), None)
        if failed is not None and self.returncode == 0:
            return failed.log_tail(lines)
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])


#: Report entries replaced by their median over the repeats (``memory`` keys are per-run peaks).
_MEDIAN_MEMORY_KEYS = ("peak_rss_bytes", "peak_locked_bytes", "sum_rank_peak_rss_bytes",
                       "sum_rank_peak_locked_bytes", "max_node_peak_rss_bytes", "max_node_peak_locked_bytes")


def merge_repeat_reports(reports: list[dict]) -> dict:
    """One report for several runs of the same configuration and engine.

    The first report, with ``median_step_s``, ``median_tokens_per_s``, ``median_phase_s``,
    ``median_phase_cpu_s`` and ``median_phase_sys_s`` (per phase), ``median_minor_faults`` and the memory peaks replaced by their medians over the runs,
    and a ``repeats`` entry holding every run's values
    and whether their per-step losses were identical (same seed and data: they must be).

    Raises:
        ValueError: no reports.
    """
    if not reports:
        raise ValueError("no reports to merge")
    merged = copy.deepcopy(reports[0])
    step_s = [float(r["median_step_s"]) for r in reports]
    merged["median_step_s"] = statistics.median(step_s)
    tokens = [r.get("median_tokens_per_s") for r in reports]
    if all(t is not None for t in tokens):
        merged["median_tokens_per_s"] = statistics.median(tokens)
    per_run: dict[str, list] = {"median_step_s": step_s}
    for key in ("median_phase_s", "median_phase_cpu_s", "median_phase_sys_s"):
        phases = [r.get(key) for r in reports]
        # A value some run lacks (a report written before it was measured) gets no median: None.
        merged[key] = None
        if all(phases):
            merged[key] = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
            per_run[key] = phases
    faults = [r.get("median_minor_faults") for r in reports]
    merged["median_minor_faults"] = None
    if all(f is not None for f in faults):
        merged["median_minor_faults"] = statistics.median(faults)
        per_run["median_minor_faults"] = faults
    merged["swap_io"] = merge_swap_io([r.get("swap_io") for r in reports])
    for key in _MEDIAN_MEMORY_KEYS:
        values = [r["memory"].get(key) for r in reports]
        if all(v is not None for v in values):
            merged["memory"][key] = int(statistics.median(values))
            per_run[key] = values
    losses = [[s["loss"] for s in r["steps"]] for r in reports]
    merged["repeats"] = {"n": len(reports), **per_run, "losses_equal": all(x == losses[0] for x in losses)}
    return merged


def merge_swap_io(sections: list[dict | None]) -> dict | None:
    """``report["swap_io"]`` of several runs: the first run's bandwidth, every other number the
    median over the runs (``time_over_floor`` recomputed from the medians); ``None`` where a run
    lacks the section or its medians."""
    if not sections or not all(s and s.get("median_phase") for s in sections):
        return sections[0] if sections and len(sections) == 1 else None
    merged = copy.deepcopy(sections[0])
    merged["median_step"] = {k: statistics.median(s["median_step"][k] for s in sections)
                             for k in sections[0]["median_step"]}
    for phase, first in sections[0]["median_phase"].items():
        row = {}
        for key in first:
            values = [s["median_phase"][phase][key] for s in sections]
            row[key] = None if any(v is None for v in values) else statistics.median(values)
        row["time_over_floor"] = row["time_s"] / row["floor_s"] if row.get("floor_s") else None
        if row.get("worker_s") is not None:
            row["worker_over_floor"] = row["worker_s"] / row["floor_s"] if row.get("floor_s") else None
        merged["median_phase"][phase] = row
    merged["bandwidths"] = [s.get("bandwidth") for s in sections]
    return merged


def finetune_command(cfg: BenchConfig, engine: str, output_dir: Path, nvme_path: Path) -> list[str]:
    """The exact command line of one run of a one-node configuration (see :func:`node_commands`
    for ``cfg.nnodes`` > 1)."""
    return [sys.executable, "-m", "memascend", "finetune",
            *cfg.finetune_args(engine=engine, output_dir=str(output_dir), nvme_path=str(nvme_path))]


def node_commands(cfg: BenchConfig, engine: str, output_dir: Path, nvme_path: Path,
                  master_port: int | str) -> list[list[str]]:
    """One launcher command per simulated node of ``cfg`` (``cfg.nnodes`` of them), started together.

    Node ``k`` runs ``python -m memascend.train.launch`` (torchrun) with ``--nnodes N
    --nproc-per-node cfg.nproc --node-rank k``, rendezvous at ``127.0.0.1:master_port``, then ``-m
    memascend finetune`` with the same arguments on every node except ``--nvme-path``, the node's own
    swap folder (:meth:`BenchConfig.node_nvme_path`); every node writes to ``output_dir`` (global
    rank 0, on node 0, writes the report).
    """
    return [[sys.executable, "-m", "memascend.train.launch", f"--nnodes={cfg.nnodes}",
             f"--nproc-per-node={cfg.nproc}", f"--node-rank={node}", "--master-addr=127.0.0.1",
             f"--master-port={master_port}", "-m", "memascend", "finetune",
             *cfg.finetune_args(engine=engine, output_dir=str(output_dir),
                                nvme_path=cfg.node_nvme_path(str(nvme_path), node))]
            for node in range(cfg.nnodes)]


def command_line(cfg: BenchConfig, engine: str, output_dir: Path, nvme_path: Path) -> str:
    """The shell line that reruns one engine's run (written to the results): the finetune command,
    or with several nodes each node's launcher in the background (``... & ... & wait``), the port
    left to ``$MASTER_PORT`` (the runner picks a free one per run)."""
    if cfg.nnodes == 1:
        return " ".join(finetune_command(cfg, engine, output_dir, nvme_path))
    cmds = node_commands(cfg, engine, output_dir, nvme_path, "$MASTER_PORT")
    return " & ".join(" ".join(c) for c in cmds) + " & wait"


#: Set by a launcher for its ranks: the node launchers of a multi-node run must not inherit them.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "CROSS_RANK",
                 "MASTER_ADDR", "MASTER_PORT")


def run_nodes(cmds: list[list[str]], log_paths: list[Path], env: dict, timeout_s: float,
              grace_s: float = 10.0) -> tuple[int | None, int | None]:
    """Start every node's command at once (``cmds[k]`` writing to ``log_paths[k]``) and wait for all.

    A node that fails fails the run: the other nodes (which would wait for it in a collective) are
    stopped (SIGTERM to each node's process group, SIGKILL after ``grace_s`` seconds).

    Returns:
        ``(status, failed node)``: ``(0, None)`` when every node exited 0; the first failing node's
        exit status and index (in the order they ended); ``(None, None)`` when ``timeout_s`` seconds
        passed first (every node is then killed).
    """
    procs = []
    try:
        for cmd, log_path in zip(cmds, log_paths, strict=True):
            with open(log_path, "a") as log:  # the child keeps its own descriptor
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = next((k for k, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None:
                return codes[failed], failed
            if all(c == 0 for c in codes):
                return 0, None
            if time.monotonic() > deadline:
                return None, None
            time.sleep(0.2)
    finally:
        _stop_all(procs, grace_s)


def _stop_all(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``, to the process group of each node still running."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.1)


def run_one(cfg: BenchConfig, engine: str, out_root: Path, nvme_path: Path, timeout_s: float,
            resume: bool = False, memory_cap: int | None = None, tag: str = "") -> RunOutcome:
    """Run ``cfg`` with ``engine`` in a subprocess; output under ``out_root/<cfg.name>/<engine><tag>``.

    With ``memory_cap`` (bytes) the run is confined to a fresh memory cgroup with that hard limit
    (see :mod:`memascend.host.memcap`); its outcome is written to ``<cfg.name>/<engine>.cap.json``.

    With ``resume``, an earlier run into the same folder is taken instead of running again: its
    ``report.json`` (uncapped), or under a cap the ``.cap.json`` of a run that completed or was
    stopped by the cap, under the same cap or one whose outcome carries over
    (:meth:`~memascend.host.memcap.CappedResult.under_cap`: fit under a smaller cap, OOM-killed
    under a larger one), so one folder resumed with 4, 8 then 16 GiB runs only what is new.

    With ``cfg.nnodes`` > 1 every node's launcher runs at once (:func:`node_commands`,
    :func:`run_nodes`): node 0 logs to ``<engine>.log``, node ``k`` to ``<engine>.node<k>.log``, and
    any node failing fails the run (its log's last lines are copied into ``<engine>.log``).

    Raises:
        UserError: ``memory_cap`` with ``cfg.nnodes`` > 1 (see :func:`check_memory_cap_nodes`).
    """
    check_memory_cap_nodes([cfg], memory_cap)
    out_dir = out_root / cfg.name / f"{engine}{tag}"
    log_path = out_root / cfg.name / f"{engine}{tag}.log"
    cap_path = out_root / cfg.name / f"{engine}{tag}.cap.json"
    if resume:
        earlier = _earlier(out_dir, log_path, cap_path, engine, memory_cap)
        if earlier is not None:
            return earlier
    out_dir.mkdir(parents=True, exist_ok=True)
    stale = out_dir / "report.json"
    stale.unlink(missing_ok=True)  # a report left from an earlier run must not pass for this one
    cap_path.unlink(missing_ok=True)
    cfg.write_deepspeed_json(engine, str(out_dir))
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    swap_paths = [Path(cfg.node_nvme_path(str(nvme_path), node)) for node in range(cfg.nnodes)]
    swap_before = {p: _swap_dirs(p) for p in swap_paths}
    t0 = time.monotonic()
    cap = None
    with open(log_path, "w") as log:
        if cfg.nnodes > 1:
            rc = _run_simulated_nodes(cfg, engine, out_dir, nvme_path, log, env, timeout_s)
        else:
            rc, cap = _run_single(finetune_command(cfg, engine, out_dir, nvme_path), log, env, timeout_s,
                                  memory_cap, cap_path)
        for leftover in (p for path in swap_paths for p in _remove_leftover_swap(path, swap_before[path])):
            log.write(f"memascend regress: removed the swap folder {leftover} the killed run left behind\n")
    return RunOutcome(engine, rc, out_dir, log_path, time.monotonic() - t0, cap)


def _run_single(cmd: list[str], log, env: dict, timeout_s: float, memory_cap: int | None,
                cap_path: Path) -> tuple[int | None, CappedResult | None]:
    """One process (under ``memory_cap`` where given, its outcome written to ``cap_path``), output to
    ``log``: its exit status (``None``: timed out) and the cap's outcome."""
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    if memory_cap is not None:
        cap = run_capped(cmd, memory_cap, timeout_s=timeout_s, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.write(f"\nmemascend regress: {cap.verdict} ({cap.mechanism})\n")
        cap_path.write_text(json.dumps(cap.to_dict(), indent=2) + "\n")
        return cap.returncode, cap
    try:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
                              check=False).returncode, None
    except subprocess.TimeoutExpired:
        log.write(f"\nmemascend regress: timed out after {timeout_s:.0f} s\n")
        return None, None


def _run_simulated_nodes(cfg: BenchConfig, engine: str, out_dir: Path, nvme_path: Path, log, env: dict,
                         timeout_s: float) -> int | None:
    """Every node of ``cfg`` at once (:func:`run_nodes`); node 0 writes to ``log``, node ``k`` to
    ``<log>.node<k>.log`` beside it. Returns :func:`run_nodes`'s status."""
    from memascend.train.dist import free_port

    env = {k: v for k, v in env.items() if k not in _LAUNCHER_ENV}
    cmds = node_commands(cfg, engine, out_dir, nvme_path, free_port())
    main_log = Path(log.name)
    logs = [main_log] + [main_log.with_name(f"{main_log.stem}.node{k}.log") for k in range(1, cfg.nnodes)]
    for node, cmd in enumerate(cmds):
        Path(cfg.node_nvme_path(str(nvme_path), node)).mkdir(parents=True, exist_ok=True)
        log.write(f"$ [node {node}] " + " ".join(cmd) + "\n")
    for extra in logs[1:]:
        extra.write_text("")
    log.flush()
    rc, failed = run_nodes(cmds, logs, env, timeout_s)
    log.seek(0, os.SEEK_END)  # node 0 appended to the same file
    if rc is None:
        log.write(f"\nmemascend regress: timed out after {timeout_s:.0f} s (every node stopped)\n")
    elif failed is not None:
        tail = "\n".join(logs[failed].read_text(errors="replace").strip().splitlines()[-5:])
        log.write(f"\nmemascend regress: node {failed} failed (exit {rc}), the other nodes were stopped; "
                  f"last lines of {logs[failed].name}:\n{tail}\n")
    return rc


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
    cap = cap.under_cap(memory_cap)
    if cap is None or not (cap.stopped_by_cap or (cap.fit and has_report)):
        return None
    return RunOutcome(engine, cap.returncode, out_dir, log_path, 0.0, cap)


def run_pair(cfg: BenchConfig, out_root: Path, nvme_path: Path, timeout_s: float,
             on_event: Callable[[str], None] | None = None, resume: bool = False, memory_cap: int | None = None,
             skip: dict[str, str] | None = None, repeats: int = 1) -> dict[str, RunOutcome]:
    """Baseline then memascend for one configuration, ``repeats`` times in alternating order (the
    later repeats in each outcome's ``repeats``); engines in ``skip`` (engine -> why) are not run.

    Raises:
        ValueError: ``repeats`` < 1.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runs: dict[str, list[RunOutcome]] = {}
    for rep in range(repeats):
        tag = "" if rep == 0 else f".r{rep}"
        label = "" if repeats == 1 else f" (repeat {rep + 1}/{repeats})"
        for engine in ENGINES if rep % 2 == 0 else ENGINES[::-1]:
            if skip and engine in skip:
                if rep == 0:
                    runs[engine] = [RunOutcome(engine, None, out_root / cfg.name / engine,
                                               out_root / cfg.name / f"{engine}.log", 0.0, skipped=skip[engine])]
                    if on_event:
                        on_event(f"{cfg.name}: {engine} {runs[engine][0].describe()}")
                continue
            if on_event:
                on_event(f"{cfg.name}: {engine}{label} ...")
            o = run_one(cfg, engine, out_root, nvme_path, timeout_s, resume, memory_cap=memory_cap, tag=tag)
            runs.setdefault(engine, []).append(o)
            if on_event:
                on_event(f"{cfg.name}: {engine}{label} {o.describe()} in {o.wall_s:.0f} s")
    return {e: replace(runs[e][0], repeats=tuple(runs[e][1:])) for e in ENGINES}


def check_memory_cap_nodes(configs: Iterable[BenchConfig], memory_cap: int | None) -> None:
    """Refuse ``--memory-cap`` for simulated multi-node configurations (a cap confines one process
    tree; several node launchers are several).

    Raises:
        UserError: ``memory_cap`` is set and a configuration has ``nnodes`` > 1.
    """
    multi = [c.name for c in configs if c.nnodes > 1]
    if memory_cap is not None and multi:
        raise UserError(f"--memory-cap does not apply to configs with several simulated nodes ({', '.join(multi)}): "
                        "leave them out with --only")


def run_matrix(configs: Iterable[BenchConfig], out_root: Path, nvme_path: Path, timeout_s: float = 3600.0,
               on_event: Callable[[str], None] | None = None, resume: bool = False, memory_cap: int | None = None,
               search: bool = False, repeats: int = 1) -> dict[str, dict[str, RunOutcome]]:
    """Run every configuration (sequentially) and return ``{config name: {engine: outcome}}``.

    Args:
        memory_cap: run each process under this hard memory cap (bytes).
        search: a largest-model search: ``configs`` are in ascending size, and an engine whose run
            does not complete (stopped by the cap, or failed) is not run on the configs after it.
        repeats: runs of each pair (see :func:`run_pair`).

    Raises:
        UserError: ``memory_cap`` with a configuration of several simulated nodes.
    """
    configs = tuple(configs)
    check_memory_cap_nodes(configs, memory_cap)
    results: dict[str, dict[str, RunOutcome]] = {}
    stopped: dict[str, str] = {}
    for cfg in configs:
        pair = run_pair(cfg, out_root, nvme_path, timeout_s, on_event, resume, memory_cap, skip=dict(stopped),
                        repeats=repeats)
        results[cfg.name] = pair
        if search:
            for engine, o in pair.items():
                if engine not in stopped and o.status in ("capped", "error"):
                    why = {"oom-killed": "OOM-killed under the cap", "over-cap": "over the cap"}.get(
                        o.cap.outcome if o.cap else "", "failed")
                    stopped[engine] = f"{engine} {why} at {cfg.name}"
    return results
