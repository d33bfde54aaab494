"""Compare a memascend run with the baseline run of the same configuration, and with golden results.

Two kinds of checks, each a :class:`Check` with the measured value, its limit and a verdict:

* pair checks (same run): per-step losses equal (bit-for-bit where the thresholds say so), peak
  host RSS, peak locked memory and median step time of memascend over the baseline's, against the
  :class:`~memascend.regress.thresholds.Thresholds` of the configuration;
* golden checks: this run's memascend numbers against the golden results recorded for this
  hardware profile (``baselines/<profile>/<matrix>.json``), with :class:`GoldenTolerances`.

Memory is host-wide: with several ranks on one host the per-rank peaks are summed
(``report["memory"]["sum_rank_peak_*"]``), which bounds the host's peak. A configuration of several
simulated nodes (``BenchConfig.nnodes`` > 1) is compared per node instead: the largest node's sum of
its ranks' peaks (``report["memory"]["max_node_peak_*"]``), what one host's DRAM must hold; its
checks and table rows say so.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from memascend.regress.matrix import BenchConfig
from memascend.regress.thresholds import Thresholds
from memascend.units import GIB


@dataclass(frozen=True)
class Check:
    """One verdict.

    Attributes:
        name: what was checked (``losses``, ``peak_rss_ratio``, ``golden.peak_rss_bytes`` ...).
        ok: passed.
        measured: the measured value (ratio, bytes, seconds; ``None`` when it could not be measured).
        limit: the limit it was held against.
        detail: one human line.
    """

    name: str
    ok: bool
    measured: float | None
    limit: float | None
    detail: str


@dataclass(frozen=True)
class RunMetrics:
    """The numbers of one engine's run that the checks use (from its ``report.json``).

    Attributes:
        peak_rss_bytes: sum over ranks of each rank's peak RSS (``per_node``: over the ranks of the
            node whose sum is largest).
        peak_locked_bytes: sum over ranks of each rank's peak VmLck (``per_node``: as RSS).
        median_step_s: median step time, first step excluded.
        tokens_per_s: median tokens per second (all ranks).
        nvme_read_bytes / nvme_write_bytes: bytes through the process's I/O counters during training.
        swap_folder_bytes: the swap folder's largest size (report.json ``nvme.swap_folder_bytes``).
        losses: per-step mean loss over ranks.
        param_numel: model parameters.
        param_dtype: dtype of the parameter partitions DeepSpeed trained (``bfloat16`` ...).
        median_phase_s: median seconds per step in forward, backward and the optimizer step
            (``report["median_phase_s"]``; ``None`` for reports that do not time phases).
        median_phase_cpu_s / median_phase_sys_s: the same in CPU seconds (user + system) and system
            seconds of the process (``report["median_phase_cpu_s"]``; ``None`` before reports had them).
        median_minor_faults: median page faults per step of rank 0's process
            (``report["median_minor_faults"]``; ``None`` for reports without them).
        per_node: the memory peaks are the largest node's (``memory.max_node_peak_*``), not every rank's sum.
        swap_io: rank 0's swap I/O (``report["swap_io"]``: the swap target's bandwidth, the median
            bytes and I/O wait of a step, each phase's median time against its disk floor); ``None``
            for reports without it.
    """

    peak_rss_bytes: int
    peak_locked_bytes: int
    median_step_s: float
    tokens_per_s: float
    nvme_read_bytes: int
    nvme_write_bytes: int
    swap_folder_bytes: int
    losses: tuple[float, ...]
    param_numel: int
    param_dtype: str | None = None
    median_phase_s: dict[str, float] | None = None
    median_phase_cpu_s: dict[str, float] | None = None
    median_phase_sys_s: dict[str, float] | None = None
    median_minor_faults: float | None = None
    per_node: bool = False
    swap_io: dict | None = None

    @property
    def swap_bytes_per_step(self) -> int | None:
        """Median swap bytes (read + written) of a step, ``None`` without :attr:`swap_io`."""
        step = (self.swap_io or {}).get("median_step")
        return int(step["read_bytes"] + step["write_bytes"]) if step else None

    @classmethod
    def from_report(cls, report: dict, per_node: bool = False) -> RunMetrics:
        """The metrics of one ``report.json``; ``per_node``: memory peaks per node (see the class).

        Raises:
            KeyError: a field is missing (``per_node`` needs ``memory.max_node_peak_*``).
        """
        mem = report["memory"]
        if per_node:
            rss, locked = int(mem["max_node_peak_rss_bytes"]), int(mem["max_node_peak_locked_bytes"])
        else:
            rss = int(mem.get("sum_rank_peak_rss_bytes") or mem["peak_rss_bytes"])
            locked = int(mem.get("sum_rank_peak_locked_bytes") or mem["peak_locked_bytes"])
        return cls(
            peak_rss_bytes=rss,
            peak_locked_bytes=locked,
            median_step_s=float(report["median_step_s"]),
            tokens_per_s=float(report.get("median_tokens_per_s") or 0.0),
            nvme_read_bytes=int(report.get("nvme", {}).get("read_bytes") or 0),
            nvme_write_bytes=int(report.get("nvme", {}).get("write_bytes") or 0),
            swap_folder_bytes=int(report.get("nvme", {}).get("swap_folder_bytes") or 0),
            losses=tuple(float(s["loss"]) for s in report["steps"]),
            param_numel=int(report["model"]["param_numel"]),
            param_dtype=report["model"].get("param_dtype"),
            median_phase_s=report.get("median_phase_s"),
            median_phase_cpu_s=report.get("median_phase_cpu_s"),
            median_phase_sys_s=report.get("median_phase_sys_s"),
            median_minor_faults=report.get("median_minor_faults"),
            per_node=per_node,
            swap_io=report.get("swap_io"),
        )


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else (1.0 if num == 0 else math.inf)


def check_losses(base: tuple[float, ...], mine: tuple[float, ...], th: Thresholds) -> Check:
    """Per-step losses equal: bit-for-bit (``==`` on the float64 values) or within ``loss_rtol``."""
    if len(base) != len(mine):
        return Check("losses", False, None, None, f"step counts differ: baseline {len(base)}, memascend {len(mine)}")
    bad = []
    worst = 0.0
    for i, (a, b) in enumerate(zip(base, mine, strict=True), start=1):
        rel = abs(a - b) / max(abs(a), 1e-30)
        worst = max(worst, rel)
        equal = (a == b) if th.bitwise_losses else rel <= th.loss_rtol
        if not equal or math.isnan(a) or math.isnan(b):
            bad.append(f"step {i}: {a!r} vs {b!r}")
    how = "bit-for-bit" if th.bitwise_losses else f"rtol {th.loss_rtol:g}"
    if bad:
        return Check("losses", False, worst, th.loss_rtol, f"losses differ ({how}): " + "; ".join(bad[:3]))
    return Check("losses", True, worst, th.loss_rtol, f"{len(base)} steps equal ({how})")


def memory_scope(cfg: BenchConfig) -> str:
    """How a configuration's memory is compared, for labels: ``""`` (every rank on the one host) or
    ``"per node (largest of N)"`` for ``cfg.nnodes`` = N > 1 simulated nodes."""
    return f"per node (largest of {cfg.nnodes})" if cfg.nnodes > 1 else ""


def compare_pair(cfg: BenchConfig, base: RunMetrics, mine: RunMetrics) -> list[Check]:
    """The same-run checks of one configuration against its thresholds (memory as :func:`memory_scope`)."""
    th = cfg.thresholds
    scope = f" {memory_scope(cfg)}".rstrip()
    out = [check_losses(base.losses, mine.losses, th)]
    if base.param_dtype and mine.param_dtype:
        same = base.param_dtype == mine.param_dtype
        out.append(Check("param_dtype", same, None, None,
                         f"parameters trained in {mine.param_dtype} (baseline {base.param_dtype})"
                         + ("" if same else ": the engines must train in the same precision")))
    rss = _ratio(mine.peak_rss_bytes, base.peak_rss_bytes)
    rss_text = f"peak RSS{scope} {mine.peak_rss_bytes / GIB:.2f} / {base.peak_rss_bytes / GIB:.2f} GiB = {rss:.3f}"
    if th.max_peak_rss_ratio is None:
        out.append(Check("peak_rss_ratio", True, rss, None, rss_text + " (reported)"))
    else:
        out.append(Check("peak_rss_ratio", rss <= th.max_peak_rss_ratio, rss, th.max_peak_rss_ratio,
                         rss_text + f" (limit {th.max_peak_rss_ratio:.2f})"))
    if th.max_peak_locked_ratio is not None:
        lck = _ratio(mine.peak_locked_bytes, base.peak_locked_bytes)
        out.append(Check("peak_locked_ratio", lck <= th.max_peak_locked_ratio, lck, th.max_peak_locked_ratio,
                         f"locked{scope} {mine.peak_locked_bytes / GIB:.2f} / {base.peak_locked_bytes / GIB:.2f} GiB = "
                         f"{lck:.3f} (limit {th.max_peak_locked_ratio:.2f})"))
    st = _ratio(mine.median_step_s, base.median_step_s)
    limit = th.max_step_time_ratio + th.step_time_noise
    out.append(Check("step_time_ratio", st <= limit, st, limit,
                     f"median step {mine.median_step_s:.2f} / {base.median_step_s:.2f} s = {st:.3f} "
                     f"(limit {th.max_step_time_ratio:.2f} + {th.step_time_noise:.2f} noise allowance)"
                     + _faults_detail(base, mine)))
    if th.max_swap_bytes_ratio is not None:
        out.append(_swap_bytes_check(base, mine, th.max_swap_bytes_ratio))
    return out


def _swap_bytes_check(base: RunMetrics, mine: RunMetrics, limit: float) -> Check:
    """``swap_bytes_ratio``: median swap bytes per step, memascend / baseline, at most ``limit``
    (fails where a report has no ``swap_io``)."""
    b, m = base.swap_bytes_per_step, mine.swap_bytes_per_step
    if b is None or m is None:
        return Check("swap_bytes_ratio", False, None, limit, "swap bytes per step: a report has no swap_io")
    ratio = m / b if b else (0.0 if m == 0 else float("inf"))
    return Check("swap_bytes_ratio", ratio <= limit, ratio, limit,
                 f"swap bytes per step {m / 2**20:.0f} / {b / 2**20:.0f} MiB = {ratio:.3f} (limit {limit:.2f})")


def _faults_detail(base: RunMetrics, mine: RunMetrics) -> str:
    """``"; page faults/step A / B"`` when both reports count them (memory handed back and
    touched again shows up here, not in any memory peak)."""
    if base.median_minor_faults is None or mine.median_minor_faults is None:
        return ""
    return f"; page faults/step {mine.median_minor_faults:,.0f} / {base.median_minor_faults:,.0f}"


@dataclass(frozen=True, kw_only=True)
class GoldenTolerances:
    """How much worse than the golden result a run may be on the same hardware profile.

    Attributes:
        memory_rel: relative increase allowed on peak RSS and peak locked bytes.
        ratio_abs: absolute increase allowed on the memascend/baseline memory ratios.
        step_time_rel: relative increase allowed on the step time ratio memascend / stock (both
            measured in the same run; the golden's ratio from its two recorded medians).
        loss_rel: relative difference allowed on each step's loss (same hardware, same seed).
    """

    memory_rel: float = 0.05
    ratio_abs: float = 0.03
    step_time_rel: float = 0.30
    loss_rel: float = 1e-3


def golden_entry(base: RunMetrics | None, mine: RunMetrics, cpu_isa: str | None = None) -> dict:
    """What is recorded for one configuration in a golden file; ``cpu_isa``
    (:func:`memascend.regress.golden.cpu_isa`) is the kernel level the losses were computed with;
    ``memory_per_node`` is recorded (true) only where the peaks are per node (``RunMetrics.per_node``).

    ``base`` is ``None`` where stock did not run in the same run (OOM-killed or skipped under a
    memory cap, or its run was carried over from another one): the entry then holds memascend's
    own numbers only (``baseline`` and the ratios ``None``), and :func:`compare_golden` checks
    memascend's peaks and losses against it, no ratio.
    """
    extra = {"memory_per_node": True} if mine.per_node else {}
    return {
        **extra,
        "cpu_isa": cpu_isa,
        "memascend": {"peak_rss_bytes": mine.peak_rss_bytes, "peak_locked_bytes": mine.peak_locked_bytes,
                      "median_step_s": mine.median_step_s, "losses": list(mine.losses)},
        "baseline": None if base is None else {"peak_rss_bytes": base.peak_rss_bytes,
                                               "peak_locked_bytes": base.peak_locked_bytes,
                                               "median_step_s": base.median_step_s},
        "peak_rss_ratio": None if base is None else _ratio(mine.peak_rss_bytes, base.peak_rss_bytes),
        "peak_locked_ratio": None if base is None else _ratio(mine.peak_locked_bytes, base.peak_locked_bytes),
    }


def compare_golden(entry: dict, base: RunMetrics | None, mine: RunMetrics, tol: GoldenTolerances,
                   cpu_isa: str | None = None) -> list[Check]:
    """This run against the golden ``entry`` of its configuration (see :func:`golden_entry`).

    The losses are compared only where the entry's ``cpu_isa`` is unrecorded or equals ``cpu_isa``
    (this host's): another CPU kernel level rounds bf16 matmuls differently. The ratios to stock
    are compared only where both this run (``base`` not ``None``) and the entry have stock's numbers."""
    g = entry["memascend"]
    out = []
    for key, label in (("peak_rss_bytes", "peak RSS"), ("peak_locked_bytes", "locked")):
        limit = g[key] * (1 + tol.memory_rel)
        val = getattr(mine, key)
        out.append(Check(f"golden.{key}", val <= limit, val, limit,
                         f"memascend {label} {val / GIB:.3f} GiB vs golden {g[key] / GIB:.3f} GiB "
                         f"(+{tol.memory_rel:.0%} allowed)"))
    if base is not None and entry.get("baseline"):
        out += _compare_golden_ratios(entry, base, mine, tol)
    out.append(_compare_golden_losses(entry, mine, tol, cpu_isa))
    return out


def _compare_golden_ratios(entry: dict, base: RunMetrics, mine: RunMetrics, tol: GoldenTolerances) -> list[Check]:
    """The same-run ratios memascend / stock against the golden's (memory and step time)."""
    g = entry["memascend"]
    out = []
    for key in ("peak_rss_ratio", "peak_locked_ratio"):
        val = golden_entry(base, mine)[key]
        limit = entry[key] + tol.ratio_abs
        out.append(Check(f"golden.{key}", val <= limit, val, limit,
                         f"{key} {val:.3f} vs golden {entry[key]:.3f} (+{tol.ratio_abs:.2f} allowed)"))
    # Step time against the golden as the same-run ratio memascend / stock, not as seconds: an
    # absolute step time moves with the host's load (+43 % between two idle runs of the image smoke
    # on the 2-core VM), the ratio only with what memascend does.
    golden_time = _ratio(g["median_step_s"], entry["baseline"]["median_step_s"])
    val = _ratio(mine.median_step_s, base.median_step_s)
    limit = golden_time * (1 + tol.step_time_rel)
    out.append(Check("golden.step_time_ratio", val <= limit, val, limit,
                     f"step time ratio {val:.3f} ({mine.median_step_s:.2f} / {base.median_step_s:.2f} s) vs golden "
                     f"{golden_time:.3f} (+{tol.step_time_rel:.0%} allowed)"))
    return out


def _compare_golden_losses(entry: dict, mine: RunMetrics, tol: GoldenTolerances, cpu_isa: str | None) -> Check:
    """memascend's per-step losses against the golden's, where the CPU kernel level allows."""
    gl = entry["memascend"].get("losses") or []
    golden_isa = entry.get("cpu_isa")
    if golden_isa and cpu_isa and golden_isa != cpu_isa:
        return Check("golden.losses", True, None, None,
                     f"not compared: golden losses computed with {golden_isa} CPU kernels, this host runs {cpu_isa}")
    if len(gl) == len(mine.losses):
        worst = max((abs(a - b) / max(abs(a), 1e-30) for a, b in zip(gl, mine.losses, strict=True)), default=0.0)
        return Check("golden.losses", worst <= tol.loss_rel, worst, tol.loss_rel,
                     f"largest relative loss difference to golden {worst:.2e} (<= {tol.loss_rel:g})")
    return Check("golden.losses", False, None, None,
                 f"golden has {len(gl)} steps, this run {len(mine.losses)}: rerun with --update-golden "
                 "if the matrix changed")


@dataclass
class ConfigResult:
    """Everything known about one configuration after a regress run.

    Attributes:
        config: the configuration.
        baseline / memascend: their metrics (``None`` when the run failed).
        checks: pair and golden checks.
        errors: why a run produced no report (exit status and log tail).
        commands: the exact command of each engine's run.
        runs: per engine, how the run ended (``status``: ok, capped, skipped or error; ``outcome``:
            one line; ``wall_s``; ``cap``: the memory-cap outcome under ``--memory-cap``).
    """

    config: BenchConfig
    baseline: RunMetrics | None = None
    memascend: RunMetrics | None = None
    checks: list[Check] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    commands: dict[str, str] = field(default_factory=dict)
    runs: dict[str, dict] = field(default_factory=dict)
    golden_key: str | None = None
    """The key of its golden entry (:func:`memascend.regress.golden.golden_key`: the config's name,
    suffixed with the raw store's kind where the runs swapped to one)."""

    @property
    def ok(self) -> bool:
        return not self.errors and bool(self.checks) and all(c.ok for c in self.checks)

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def to_dict(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "ok": self.ok,
            "baseline": asdict(self.baseline) if self.baseline else None,
            "memascend": asdict(self.memascend) if self.memascend else None,
            "checks": [asdict(c) for c in self.checks],
            "errors": self.errors,
            "commands": self.commands,
            "runs": self.runs,
            "golden_key": self.golden_key,
        }


def check_memory_cap(stopped: dict[str, tuple[str, str]], completed: set[str]) -> Check:
    """The verdict of a configuration where the memory cap stopped an engine.

    Args:
        stopped: ``{engine: (status, one line)}`` of the engines that did not complete because of the
            cap: ``capped`` (OOM-killed under it, or not enforced and over it) or ``skipped`` (a capped
            search stopped the engine at a smaller model).
        completed: the engines that completed within the cap.

    Memascend stopped by the cap where stock completed under the same cap is a regression; stock
    stopped (memascend completing or not) is what the cap is for, not a failure.
    """
    lines = "; ".join(f"{e}: {line}" for e, (_, line) in sorted(stopped.items()))
    mine = stopped.get("memascend")
    if mine is not None and mine[0] == "capped" and "baseline" in completed:
        return Check("memory_cap", False, None, None, f"memascend did not fit under the cap where stock did ({lines})")
    return Check("memory_cap", True, None, None, f"stopped by the memory cap, not compared ({lines})")


def evaluate(cfg: BenchConfig, base_report: dict | None, mine_report: dict | None, golden: dict | None,
             tol: GoldenTolerances, errors: list[str] | None = None,
             stopped: dict[str, tuple[str, str]] | None = None, cpu_isa: str | None = None) -> ConfigResult:
    """Build the :class:`ConfigResult` of one configuration from its two reports.

    Args:
        base_report / mine_report: parsed ``report.json`` of each engine, ``None`` if the run failed.
        golden: this configuration's golden entry, or ``None`` (no golden check).
        tol: golden tolerances.
        cpu_isa: this host's CPU kernel level (:func:`memascend.regress.golden.cpu_isa`).
        errors: run failures already known (they make the result fail).
        stopped: engines the memory cap stopped (see :func:`check_memory_cap`): the pair is not
            compared, and the result is one ``memory_cap`` check.
    """
    res = ConfigResult(cfg, errors=list(errors or []))
    per_node = cfg.nnodes > 1
    res.baseline = RunMetrics.from_report(base_report, per_node) if base_report is not None else None
    res.memascend = RunMetrics.from_report(mine_report, per_node) if mine_report is not None else None
    if stopped:
        completed = {e for e, rep in (("baseline", base_report), ("memascend", mine_report)) if rep is not None}
        res.checks.append(check_memory_cap(stopped, completed))
        if golden is not None and res.memascend is not None:
            # Stock stopped by the cap: memascend's own peaks and losses still meet its golden.
            res.checks += compare_golden(golden, None, res.memascend, tol, cpu_isa)
        return res
    if base_report is None or mine_report is None:
        if not res.errors:
            res.errors.append("a run produced no report")
        return res
    res.checks = compare_pair(cfg, res.baseline, res.memascend)
    if golden is not None:
        res.checks += compare_golden(golden, res.baseline, res.memascend, tol, cpu_isa)
    return res


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = slope * x + intercept``.

    Used for peak host memory (bytes) against parameter count: ``slope`` is bytes per parameter,
    ``intercept`` the model-independent bytes.

    Raises:
        ValueError: fewer than two points or all ``xs`` equal.
    """
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError("need at least two (x, y) points")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all x values are equal")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, my - slope * mx
