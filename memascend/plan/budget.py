"""A host-memory budget (``--host-memory-budget``): the placement and sizing settings that run fastest in it.

Users know their DRAM, not DeepSpeed's knobs. :func:`choose_for_budget` fills the budget in two
stages, each planned with :func:`memascend.plan.model.plan_engine` (memascend's engine):

1. DRAM as a cache (:func:`dram_fill_order`): starting from everything on NVMe (no DRAM copy of the
   16-bit parameters, every optimizer sub-group swapped), whole optimizer sub-groups' worth of state
   move to DRAM one at a time, the 16-bit parameters of the next sub-group (``param_dram_numel``) or
   the fp32 optimizer state of the next one (``optimizer_dram_numel``), whichever removes more planned
   NVMe bytes per step (:class:`memascend.plan.placement.Placement`) per byte of DRAM it adds;
2. the lean knobs of :data:`KNOBS` (parameter pool, prefetch depth, optimizer chunk) at the placements
   that fit;
3. with the activation swap on (``enable_activation_swap``) and no ``activation_dram_bytes`` given,
   what the budget leaves after the chosen placement keeps the latest saved tensors of each forward
   pass in DRAM (:func:`activation_allowance`): less than the next point of the fill order needs, so
   it takes nothing from the placement, and it removes their NVMe writes and reads.

A choice fits when its planned peak host RSS (locked memory included) is at most the budget less
:data:`BUDGET_HEADROOM_FRACTION` (the planner's stated accuracy). Of the fitting ones the one with the
smallest expected step cost wins (:func:`step_cost_s`: planned NVMe bytes per step over the swap
target's bandwidth plus a fixed cost per swap operation). The search stays linear in the number of
sub-groups: the furthest fitting point of the fill order is found by bisection with the leanest
knobs, then the knobs are planned at that point and below it only while a point could still be
faster. Nothing fits: a :class:`memascend.errors.UserError` naming the smallest workable budget.

Every knob changes only where bytes live (DRAM, pool, NVMe) and when they are read, never what the
model computes, so the choice does not change the losses.

A new lean knob is one more :class:`Knob` in :data:`KNOBS`: a :class:`MemAscendSettings` field name
and its candidate values for a model (fastest first); a field this version of the settings does not
have is skipped.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from memascend.config import RunConfig
from memascend.config.ds_defaults import ds_value
from memascend.config.render import ModelShape, resolve
from memascend.config.settings import MemAscendSettings
from memascend.config.sizing import auto_param_pool_bytes
from memascend.errors import UserError
from memascend.plan.model import EnginePlan, plan_engine
from memascend.plan.placement import Placement, plan_placement
from memascend.plan.shapes import ModelDims, model_dims
from memascend.units import DTYPE_BYTES, GIB, MIB

BUDGET_HEADROOM_FRACTION = 0.10
"""Part of the budget left free: a choice is kept only if its planned peak RSS is at most
``(1 - BUDGET_HEADROOM_FRACTION) x budget`` (the planner's target accuracy is 15 % of the measured
peak, and most of its errors on recorded runs are well inside 10 %)."""
NOMINAL_NVME_BYTES_PER_S = 2 * GIB
"""Read and write bandwidth the step-cost estimate assumes for the swap target where none is given
(:class:`Bandwidth`; a relative scale: only the order of the choices matters)."""
NVME_OP_OVERHEAD_S = 0.002
"""Fixed cost the estimate charges per swap operation (a parameter partition read, an optimizer
sub-group or chunk)."""
UNOVERLAPPED_READ_FACTOR = 2.0
"""Weight of parameter reads that the prefetcher cannot hide behind compute (a pool with no room to
read the next layer ahead of the one computing)."""


@dataclasses.dataclass(frozen=True)
class Bandwidth:
    """Sequential bandwidth of the swap target the step cost is computed with (bytes per second), e.g.
    ``report.json`` ``swap_io.bandwidth`` of an earlier run on the same target."""

    read_bytes_per_s: float = NOMINAL_NVME_BYTES_PER_S
    write_bytes_per_s: float = NOMINAL_NVME_BYTES_PER_S

    def __post_init__(self) -> None:
        if not (self.read_bytes_per_s > 0 and self.write_bytes_per_s > 0):
            raise UserError(f"swap bandwidth must be positive, got {self.read_bytes_per_s} / {self.write_bytes_per_s}")

    @classmethod
    def from_report(cls, report: dict) -> Bandwidth | None:
        """The bandwidth probe of a recorded run (``report.json`` ``swap_io.bandwidth``), ``None``
        where it has none."""
        probe = (report.get("swap_io") or {}).get("bandwidth")
        if not probe:
            return None
        return cls(float(probe["read_bytes_per_s"]), float(probe["write_bytes_per_s"]))


@dataclasses.dataclass(frozen=True)
class Knob:
    """One sizing setting the budget may choose.

    Attributes:
        name: a :class:`memascend.config.settings.MemAscendSettings` field.
        candidates: ``candidates(dims, cfg, world_size)``: the values to try, fastest first.
    """

    name: str
    candidates: Callable[[ModelDims, RunConfig, int], Sequence[Any]]


def _pool_candidates(dims: ModelDims, cfg: RunConfig, w: int) -> Sequence[Any]:
    e = DTYPE_BYTES[cfg.train.dtype]
    return (None, *(auto_param_pool_bytes(dims.param_numels, e, w, prefetch_layers=k) for k in (4, 2, 1, 0)))


def _chunk_candidates(dims: ModelDims, cfg: RunConfig, w: int) -> Sequence[Any]:
    return (None, "auto", 1 << 21)


KNOBS: tuple[Knob, ...] = (
    Knob("param_pool_bytes", _pool_candidates),
    Knob("param_prefetch_slots", lambda dims, cfg, w: (None, 2)),
    Knob("optimizer_chunk_numel", _chunk_candidates),
)
"""The lean knobs :func:`choose_for_budget` combines at each placement (sub-group size and reduce
bucket stay ``"auto"``: they are already the smallest DeepSpeed 0.19.8 allows without chunked
sub-groups; the placement knobs ``param_dram_numel`` and ``optimizer_dram_numel`` come from
:func:`dram_fill_order`)."""
PLACEMENT_KNOBS = ("param_dram_numel", "optimizer_dram_numel")
"""The settings :func:`dram_fill_order` sets (elements per rank, whole sub-groups)."""


@dataclasses.dataclass(frozen=True)
class BudgetChoice:
    """The settings chosen for a budget.

    Attributes:
        values: knob name -> value (the placement knobs and the lean knobs of :data:`KNOBS` this
            version has).
        settings: the requested settings with ``values`` applied.
        plan: memascend's plan with them (its ``placement``: what stays in DRAM, the NVMe bytes per step).
        step_cost_s: :func:`step_cost_s` (seconds on the given or nominal swap bandwidth).
        budget_bytes: the budget.
    """

    values: dict[str, Any]
    settings: MemAscendSettings
    plan: EnginePlan
    step_cost_s: float
    budget_bytes: int

    def describe(self) -> str:
        """One line: the values, the placement and the planned peaks."""
        knobs = ", ".join(f"{k}={_show(v)}" for k, v in self.values.items())
        where = f"; {describe_placement(self.plan.placement)}" if self.plan.placement is not None else ""
        return (f"host memory budget {self.budget_bytes / GIB:.2f} GiB: {knobs} (planned peak RSS "
                f"{self.plan.peak_rss_bytes / GIB:.2f} GiB, locked {self.plan.peak_locked_bytes / GIB:.2f} GiB{where})")


def describe_placement(p: Placement) -> str:
    """``DRAM: ... ; NVMe: ...`` of one rank's :class:`~memascend.plan.placement.Placement`, in GiB."""
    return (f"DRAM per rank: 16-bit params {p.param_dram_bytes / GIB:.2f} GiB, optimizer "
            f"{p.optimizer_kept_groups}/{p.optimizer_groups} sub-groups {p.optimizer_kept_bytes / GIB:.2f} GiB; "
            f"NVMe per step: read {p.read_bytes / GIB:.2f} GiB, write {p.write_bytes / GIB:.2f} GiB")


def _show(value: Any) -> str:
    return "null" if value is None else (f'"{value}"' if isinstance(value, str) else str(value))


def knobs_available() -> tuple[Knob, ...]:
    """:data:`KNOBS` whose field this version of :class:`MemAscendSettings` has."""
    fields = {f.name for f in dataclasses.fields(MemAscendSettings)}
    return tuple(k for k in KNOBS if k.name in fields)


def step_cost_s(plan: EnginePlan, settings: MemAscendSettings, dims: ModelDims, cfg: RunConfig, plan_cfg: dict,
                world_size: int, bandwidth: Bandwidth | None = None) -> float:
    """Expected swap time of one training step (seconds): the plan's NVMe bytes per step
    (:attr:`EnginePlan.placement`, one rank) over ``bandwidth`` (read and write apart), parameter reads
    weighted by :data:`UNOVERLAPPED_READ_FACTOR` where the pool leaves no room to read ahead, plus
    :data:`NVME_OP_OVERHEAD_S` per swap operation (each parameter partition read, each optimizer
    sub-group or chunk read and written).

    Args:
        plan: memascend's plan of the choice.
        settings: the resolved settings.
        plan_cfg: the resolved DeepSpeed config the run would use.
        bandwidth: the swap target's (``None``: :data:`NOMINAL_NVME_BYTES_PER_S` both ways).
    """
    bw = bandwidth or Bandwidth()
    p = plan.placement
    if p is None:
        return 0.0
    param_reads = p.param_read_bytes
    pool = settings.param_pool_bytes
    e = DTYPE_BYTES[cfg.train.dtype]
    if p.param_nvme_numel and isinstance(pool, int) and pool < auto_param_pool_bytes(dims.param_numels, e,
                                                                                     world_size, 1):
        param_reads *= UNOVERLAPPED_READ_FACTOR
    sub = ds_value(plan_cfg, "zero_optimization.sub_group_size")
    chunk = _chunk_numel(getattr(settings, "optimizer_chunk_numel", None))
    step_numel = min(sub, chunk) if chunk is not None else sub
    ops = p.param_reads + 2 * math.ceil(p.optimizer_nvme_numel / max(1, step_numel))
    return ((param_reads + p.optimizer_read_bytes) / bw.read_bytes_per_s + p.write_bytes / bw.write_bytes_per_s
            + ops * NVME_OP_OVERHEAD_S)


def _chunk_numel(value: Any) -> int | None:
    """Elements per optimizer chunk of a resolved ``optimizer_chunk_numel`` value (``None``: no chunks)."""
    from memascend.config.sizing import resolve_chunk_numel

    return resolve_chunk_numel(value) if value is None or value == "auto" or isinstance(value, int) else None


class _Planner:
    """Plans memascend's engine for one run under knob values, with the model laid out once."""

    def __init__(self, cfg: RunConfig, dims: ModelDims, world_size: int, bandwidth: Bandwidth | None) -> None:
        self.cfg, self.dims, self.w, self.bandwidth = cfg, dims, world_size, bandwidth
        self.shape = ModelShape(dims.total_numel, dims.param_numels, dims.module_param_counts, dims.trainable_numels)
        self.calls = 0

    def __call__(self, values: dict[str, Any]) -> tuple[dict[str, Any], MemAscendSettings, EnginePlan, float]:
        """``(values, requested settings, plan, step cost s)``."""
        self.calls += 1
        requested = dataclasses.replace(self.cfg.memascend, **values)
        run_cfg = dataclasses.replace(self.cfg, engine="memascend", memascend=requested)
        run = resolve(run_cfg, self.shape, self.w)
        plan = plan_engine(run_cfg, self.dims, run, self.w)
        return values, requested, plan, step_cost_s(plan, run.settings, self.dims, run_cfg, run.ds_config, self.w,
                                                    self.bandwidth)

    def resolved(self, values: dict[str, Any]):
        requested = dataclasses.replace(self.cfg.memascend, **values)
        run_cfg = dataclasses.replace(self.cfg, engine="memascend", memascend=requested)
        return run_cfg, resolve(run_cfg, self.shape, self.w)


def _placement_fields() -> tuple[str, ...]:
    fields = {f.name for f in dataclasses.fields(MemAscendSettings)}
    return tuple(k for k in PLACEMENT_KNOBS if k in fields)


def dram_fill_order(cfg: RunConfig, world_size: int = 1, dims: ModelDims | None = None
                    ) -> list[dict[str, int]]:
    """The placements DRAM is filled through, from everything on NVMe to everything in DRAM.

    Each step moves one optimizer sub-group's worth of state (elements per rank) to DRAM: the 16-bit
    parameters of the next sub-group (``param_dram_numel``, read at every use and written once per
    step) or its fp32 optimizer state (``optimizer_dram_numel``, 16 bytes per element, read and
    written once per step), whichever removes more planned NVMe bytes per step
    (:func:`~memascend.plan.placement.plan_placement`) per byte of DRAM it adds; a step that removes
    nothing (a sub-group under the swappable size, parameters not on NVMe) is left out.

    Args:
        cfg: the run (its other settings as given).
        world_size: ranks on this host.
        dims: the model's layout (laid out on the meta device when not given).

    Returns:
        ``[{"param_dram_numel": int, "optimizer_dram_numel": int}, ...]``, starting at ``(0, 0)``;
        a setting this version lacks is left out of every entry.
    """
    dims = dims or model_dims(cfg)
    planner = _Planner(cfg, dims, world_size, None)
    fields = _placement_fields()
    start = {k: 0 for k in fields}
    run_cfg, run = planner.resolved(start)
    from memascend.plan.optimizer_terms import _sub_groups

    groups = [sum(g) for g in _sub_groups(run.ds_config, dims.optimizer_numels, world_size)]
    totals = [0, *itertools.accumulate(groups)]

    def placement(n_param: int, n_opt: int) -> Placement:
        ds = _with_max_in_cpu(run.ds_config, totals[n_param])
        settings = dataclasses.replace(run.settings, **({"optimizer_dram_numel": totals[n_opt]}
                                                       if "optimizer_dram_numel" in fields else {}))
        return plan_placement(run_cfg, dims, ds, settings, world_size)

    def gain(before: Placement, after: Placement) -> float:
        added = (after.param_dram_bytes + after.optimizer_kept_bytes) - (before.param_dram_bytes
                                                                         + before.optimizer_kept_bytes)
        saved = before.nvme_step_bytes - after.nvme_step_bytes
        return saved / added if added > 0 and saved > 0 else 0.0

    order, n_param, n_opt = [dict(start)], 0, 0
    n_opt_max = len(groups) if "optimizer_dram_numel" in fields else 0
    here = placement(0, 0)
    while n_param < len(groups) or n_opt < n_opt_max:
        options = []
        if n_param < len(groups):
            nxt = placement(n_param + 1, n_opt)
            options.append((gain(here, nxt), 1, (n_param + 1, n_opt), nxt))
        if n_opt < n_opt_max:
            nxt = placement(n_param, n_opt + 1)
            options.append((gain(here, nxt), 0, (n_param, n_opt + 1), nxt))
        ratio, _, (n_param, n_opt), nxt = max(options, key=lambda o: (o[0], o[1]))
        if ratio > 0:
            here = nxt
            order.append({"param_dram_numel": totals[n_param], "optimizer_dram_numel": totals[n_opt]})
        else:
            here = nxt  # a sub-group that removes nothing: skipped, the next one may
    return [{k: v for k, v in o.items() if k in fields} for o in order]


def _with_max_in_cpu(ds_config: dict, numel: int) -> dict:
    z = ds_config.get("zero_optimization", {})
    op = z.get("offload_param", {})
    if op.get("device") != "nvme":
        return ds_config
    return {**ds_config, "zero_optimization": {**z, "offload_param": {**op, "max_in_cpu": numel}}}


def plan_candidates(cfg: RunConfig, world_size: int = 1, dims: ModelDims | None = None,
                    placement: dict[str, int] | None = None, bandwidth: Bandwidth | None = None
                    ) -> list[tuple[dict[str, Any], MemAscendSettings, EnginePlan, float]]:
    """Every lean knob combination planned at one placement (default: everything on NVMe):
    ``(values, settings, memascend's plan, step cost s)``, in :data:`KNOBS` order (fastest values first)."""
    dims = dims or model_dims(cfg)
    planner = _Planner(cfg, dims, world_size, bandwidth)
    start = placement if placement is not None else {k: 0 for k in _placement_fields()}
    return [planner({**start, **combo}) for combo in _knob_combos(cfg, dims, world_size)]


def _knob_combos(cfg: RunConfig, dims: ModelDims, world_size: int) -> list[dict[str, Any]]:
    knobs = knobs_available()
    values = [k.candidates(dims, cfg, world_size) for k in knobs]
    return [dict(zip((k.name for k in knobs), combo, strict=True)) for combo in itertools.product(*values)]


def _model_label(cfg: RunConfig) -> str:
    model = cfg.model
    name = model.name_or_path
    scratch = model.from_scratch
    if scratch is not None:
        from memascend.config import FROM_SCRATCH_PRESETS

        name = next((k for k, v in FROM_SCRATCH_PRESETS.items() if v == scratch), "a from-scratch model")
    return name


def usable_bytes(budget_bytes: int) -> int:
    """The part of a budget a plan may fill (:data:`BUDGET_HEADROOM_FRACTION` left free)."""
    return int(budget_bytes * (1 - BUDGET_HEADROOM_FRACTION))


def smallest_workable_budget_bytes(planned: Sequence[tuple[dict, MemAscendSettings, EnginePlan, float]]) -> int:
    """The smallest budget some combination fits (its planned peak plus the headroom)."""
    return math.ceil(min(p.peak_rss_bytes for _, _, p, _ in planned) / (1 - BUDGET_HEADROOM_FRACTION))


def choose_for_budget(cfg: RunConfig, budget_bytes: int, world_size: int = 1,
                      dims: ModelDims | None = None, flag: str = "--host-memory-budget",
                      bandwidth: Bandwidth | None = None) -> BudgetChoice:
    """The placement and knob values that fit ``budget_bytes`` with the smallest expected step cost.

    The furthest point of :func:`dram_fill_order` that fits with the leanest knobs (the combination
    with the smallest planned peak with everything on NVMe) is found by bisection; every knob
    combination is then planned there and at the points below it, down to the first whose NVMe
    bytes alone (optimizer reads and writes, parameter writes) take longer than the best cost found.

    Args:
        cfg: the run (its ``memascend`` settings are the starting point; the knobs replace theirs).
        budget_bytes: host memory (peak RSS, locked included, summed over this host's ranks), bytes.
        world_size: ranks on this host.
        dims: the model's layout (laid out on the meta device when not given).
        flag: how the refusal names the budget (the flag or the JSON key).
        bandwidth: the swap target's, for :func:`step_cost_s` (``None``: nominal).

    Returns:
        The choice; ties go to the faster values (:data:`KNOBS` order) at the furthest placement.

    Raises:
        UserError: nothing fits with everything on NVMe; the one line names the smallest workable budget.
    """
    dims = dims or model_dims(cfg)
    planner = _Planner(cfg, dims, world_size, bandwidth)
    usable = usable_bytes(budget_bytes)
    combos = _knob_combos(cfg, dims, world_size)
    order = dram_fill_order(cfg, world_size, dims)
    base = [planner({**order[0], **c}) for c in combos]
    if not any(c[2].peak_rss_bytes <= usable for c in base):
        raise _refusal(cfg, budget_bytes, world_size, base, flag)
    leanest = combos[min(range(len(base)), key=lambda i: base[i][2].peak_rss_bytes)]
    lo, hi = 0, len(order) - 1  # order[lo] fits with the leanest knobs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if planner({**order[mid], **leanest})[2].peak_rss_bytes <= usable:
            lo = mid
        else:
            hi = mid - 1
    best = None
    bw = bandwidth or Bandwidth()
    for i in range(lo, -1, -1):
        rows = base if i == 0 else [planner({**order[i], **c}) for c in combos]
        fitting = [r for r in rows if r[2].peak_rss_bytes <= usable]
        if fitting:
            here = min(fitting, key=lambda r: r[3])  # min keeps the first of equals
            best = here if best is None or here[3] < best[3] else best
        if i and best is not None:
            p = planner({**order[i - 1], **combos[0]})[2].placement
            if p is not None and (p.optimizer_read_bytes / bw.read_bytes_per_s
                                  + (p.optimizer_write_bytes + p.param_write_bytes) / bw.write_bytes_per_s) >= best[3]:
                break
    values, settings, plan, cost = activation_allowance(planner, best, usable)
    return BudgetChoice(values, settings, plan, cost, budget_bytes)


def activation_allowance(planner: _Planner, chosen: tuple[dict[str, Any], MemAscendSettings, EnginePlan, float],
                         usable: int) -> tuple[dict[str, Any], MemAscendSettings, EnginePlan, float]:
    """``chosen`` with ``activation_dram_bytes`` set to the budget's headroom (``usable`` less the
    planned peak, per rank) where the activation swap is on and the setting was not given; planned
    again, and lowered by what the plan overshoots until it fits (the cache's regions round the kept
    bytes up). Unchanged otherwise, or where less than the swapper's ``min_bytes`` is left."""
    from memascend.io.activation_swap import DEFAULT_MIN_BYTES

    values, settings, plan, _ = chosen
    if not settings.enable_activation_swap or settings.activation_dram_bytes is not None:
        return chosen
    allowance = (usable - plan.peak_rss_bytes) // planner.w
    for _ in range(4):
        allowance -= allowance % MIB  # whole MiB
        if allowance < DEFAULT_MIN_BYTES:
            break
        trial = planner({**values, "activation_dram_bytes": allowance})
        if trial[2].peak_rss_bytes <= usable:
            return trial
        allowance -= math.ceil((trial[2].peak_rss_bytes - usable) / planner.w)
    return chosen


def _refusal(cfg: RunConfig, budget_bytes: int, world_size: int, planned, flag: str) -> UserError:
    smallest = smallest_workable_budget_bytes(planned)
    best = min(planned, key=lambda c: c[2].peak_rss_bytes)
    top = best[2].biggest(1)[0]
    return UserError(
        f"{flag} {_size(budget_bytes)} is below the smallest workable budget {smallest / GIB:.2f} GiB for "
        f"{_model_label(cfg)} ({cfg.train.dtype}, {cfg.train.micro_batch} x {cfg.data.seq_len} tokens, "
        f"{world_size} rank(s); planned peak RSS {best[2].peak_rss_bytes / GIB:.2f} GiB at the smallest "
        f"settings, largest consumer: {top.name} {top.bytes / GIB:.2f} GiB)")


def _size(n_bytes: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n_bytes >= scale and n_bytes % scale == 0:
            return f"{n_bytes // scale}{unit}"
    return f"{n_bytes / GIB:.2f}GiB" if n_bytes >= GIB else f"{n_bytes}B"


def resolve_auto_budget(cfg: RunConfig, announce: Callable[[str], None] | None = None) -> RunConfig:
    """``cfg`` with ``host_memory_budget="auto"`` replaced by the bytes this host or its memory cgroup
    can give now (:func:`memascend.plan.host_fit.auto_budget`); any other ``cfg`` as it is. Called by
    the process that plans the run (``memascend plan``, ``memascend finetune``'s supervising process),
    once, so that every rank runs with the same number.

    Args:
        announce: called with one line saying the budget and where it comes from.

    Raises:
        UserError: ``/proc/meminfo`` is unreadable, or nothing is left after the margin.
    """
    if cfg.memascend.host_memory_budget != "auto":
        return cfg
    from memascend.plan.host_fit import auto_budget

    found = auto_budget()
    if announce is not None:
        announce(f"host memory budget auto: {found.limit_bytes / GIB:.2f} GiB ({found.source})")
    return dataclasses.replace(cfg, memascend=dataclasses.replace(cfg.memascend,
                                                                  host_memory_budget=found.limit_bytes))


def choose_values_isolated(cfg: RunConfig, world_size: int = 1) -> tuple[dict[str, Any], str]:
    """:func:`choose_for_budget` of ``cfg.memascend.host_memory_budget`` in a forked child process.

    Laying the model out imports torch and transformers (some 0.4 GiB resident); ``memascend
    finetune``'s first process only supervises the run and stays light, since the run's memory cap
    counts it too.

    Returns:
        ``(BudgetChoice.values, BudgetChoice.describe())``.

    Raises:
        UserError: nothing fits (the child's one line).
        RuntimeError: the child failed otherwise.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def work() -> None:
        try:
            choice = choose_for_budget(cfg, int(cfg.memascend.host_memory_budget), world_size)  # auto: resolved
            send.send(("ok", choice.values, choice.describe()))
        except UserError as exc:
            send.send(("error", str(exc), ""))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
            send.send(("crash", f"{type(exc).__name__}: {exc}", ""))

    proc = ctx.Process(target=work, daemon=True)
    proc.start()
    send.close()
    try:
        kind, first, second = recv.recv()
    except EOFError:
        kind, first, second = "crash", f"the planning process exited with {proc.exitcode}", ""
    proc.join()
    if kind == "error":
        raise UserError(first)
    if kind == "crash":
        raise RuntimeError(f"choosing the settings for the host memory budget failed: {first}")
    return first, second


def apply_host_memory_budget(cfg: RunConfig, world_size: int = 1,
                             announce: Callable[[str], None] | None = None) -> RunConfig:
    """``cfg`` with the placement and knobs :func:`choose_for_budget` picks for
    ``cfg.memascend.host_memory_budget`` (``"auto"`` resolved first, :func:`resolve_auto_budget`;
    unchanged without a budget or with ``--engine baseline``).

    Args:
        announce: called with :meth:`BudgetChoice.describe` (e.g. to print it once), and before it
            with the resolved ``"auto"`` budget.

    Raises:
        UserError: the budget is below the smallest workable one, or ``"auto"`` finds no memory.
    """
    if cfg.memascend.host_memory_budget is None or cfg.engine != "memascend":
        return cfg
    cfg = resolve_auto_budget(cfg, announce)
    choice = choose_for_budget(cfg, cfg.memascend.host_memory_budget, world_size)
    if announce is not None:
        announce(choice.describe())
    return dataclasses.replace(cfg, memascend=choice.settings)
