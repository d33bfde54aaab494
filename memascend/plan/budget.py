"""A host-memory budget (``--host-memory-budget``): the sizing settings that fit it, fastest first.

Users know their DRAM, not DeepSpeed's knobs. :func:`choose_for_budget` plans the run
(:func:`memascend.plan.model.plan_engine`, memascend's engine) under every combination of the
sizing knobs in :data:`KNOBS`, keeps those whose planned peak host RSS (locked memory included) stays
under the budget less :data:`BUDGET_HEADROOM_FRACTION` (the planner's stated accuracy), and picks the
one with the smallest expected step cost (:func:`expected_step_cost_s`). Nothing fits: a
:class:`memascend.errors.UserError` naming the smallest workable budget.

Every knob changes only where bytes live (DRAM, pool, NVMe) and when they are read, never what the
model computes, so the choice does not change the losses.

A new knob is one more :class:`Knob` in :data:`KNOBS`: a :class:`MemAscendSettings` field name and
its candidate values for a model (fastest first); a field this version of the settings does not
have is skipped.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

from memascend.config import RunConfig, ds_defaults
from memascend.config.ds_defaults import ds_value
from memascend.config.render import ModelShape, resolve
from memascend.config.settings import MemAscendSettings
from memascend.config.sizing import auto_param_pool_bytes
from memascend.errors import UserError
from memascend.plan.model import EnginePlan, plan_engine
from memascend.plan.shapes import ModelDims, live_window_partitions, model_dims
from memascend.units import DTYPE_BYTES, GIB

BUDGET_HEADROOM_FRACTION = 0.10
"""Part of the budget left free: a choice is kept only if its planned peak RSS is at most
``(1 - BUDGET_HEADROOM_FRACTION) x budget`` (the planner's target accuracy is 15 % of the measured
peak, and most of its errors on recorded runs are well inside 10 %)."""
NOMINAL_NVME_BYTES_PER_S = 2 * GIB
"""Read/write bandwidth the step-cost estimate assumes for the swap target (a relative scale: only
the order of the choices matters)."""
NVME_OP_OVERHEAD_S = 0.002
"""Fixed cost the estimate charges per swap operation (one sub-group or chunk of the optimizer step)."""
UNOVERLAPPED_READ_FACTOR = 2.0
"""Weight of parameter reads that the prefetcher cannot hide behind compute (a pool with no room to
read the next layer ahead of the one computing)."""


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


def _chunk_numel(value: Any) -> int | None:
    """Elements per optimizer chunk of an ``optimizer_chunk_numel`` value (``None``: no chunks)."""
    if value == "auto":
        try:
            from memascend.config.sizing import AUTO_CHUNK_NUMEL
        except ImportError:
            return 8 << 20
        return int(AUTO_CHUNK_NUMEL)
    return value if isinstance(value, int) else None


def _chunk_candidates(dims: ModelDims, cfg: RunConfig, w: int) -> Sequence[Any]:
    return (None, "auto", 1 << 21)


KNOBS: tuple[Knob, ...] = (
    Knob("param_dram_numel", lambda dims, cfg, w: ("auto", 0)),
    Knob("param_pool_bytes", _pool_candidates),
    Knob("param_prefetch_slots", lambda dims, cfg, w: (None, 2)),
    Knob("optimizer_chunk_numel", _chunk_candidates),
)
"""The knobs :func:`choose_for_budget` combines (sub-group size and reduce bucket stay ``"auto"``:
they are already the smallest DeepSpeed 0.19.8 allows without chunked sub-groups)."""


@dataclasses.dataclass(frozen=True)
class BudgetChoice:
    """The settings chosen for a budget.

    Attributes:
        values: knob name -> value (only the knobs of :data:`KNOBS` this version has).
        settings: the requested settings with ``values`` applied.
        plan: memascend's plan with them.
        step_cost_s: :func:`expected_step_cost_s` (seconds on the nominal swap target).
        budget_bytes: the budget.
    """

    values: dict[str, Any]
    settings: MemAscendSettings
    plan: EnginePlan
    step_cost_s: float
    budget_bytes: int

    def describe(self) -> str:
        """One line: the values and the planned peaks."""
        knobs = ", ".join(f"{k}={_show(v)}" for k, v in self.values.items())
        return (f"host memory budget {self.budget_bytes / GIB:.2f} GiB: {knobs} (planned peak RSS "
                f"{self.plan.peak_rss_bytes / GIB:.2f} GiB, locked {self.plan.peak_locked_bytes / GIB:.2f} GiB)")


def _show(value: Any) -> str:
    return "null" if value is None else (f'"{value}"' if isinstance(value, str) else str(value))


def knobs_available() -> tuple[Knob, ...]:
    """:data:`KNOBS` whose field this version of :class:`MemAscendSettings` has."""
    fields = {f.name for f in dataclasses.fields(MemAscendSettings)}
    return tuple(k for k in KNOBS if k.name in fields)


def expected_step_cost_s(cfg: RunConfig, dims: ModelDims, plan_cfg: dict, settings: MemAscendSettings,
                         world_size: int) -> float:
    """Expected swap time of one optimizer step (seconds on :data:`NOMINAL_NVME_BYTES_PER_S`).

    Counts what the knobs change: 16-bit partitions read per step (none with a DRAM copy; else one
    read per forward, recompute and backward use, less what the reuse window keeps; doubled where
    the pool leaves no room to read ahead), and a fixed cost per optimizer swap operation (sub-groups
    or chunks). The fp32 optimizer traffic is the same under every knob and left out.

    Args:
        plan_cfg: the resolved DeepSpeed config the run would use.
        settings: the resolved settings.
    """
    e = DTYPE_BYTES[cfg.train.dtype]
    w = world_size
    z = plan_cfg.get("zero_optimization", {})
    parts = [math.ceil(n / w) for n in dims.param_numels]
    max_in_cpu = ds_value(plan_cfg, "zero_optimization.offload_param.max_in_cpu")
    nvme_numel = max(0, sum(parts) - max_in_cpu) if z.get("offload_param", {}).get("device") == "nvme" else 0
    uses = 3 if cfg.train.activation_checkpointing else 2
    reuse = int(z.get("stage3_max_reuse_distance", ds_defaults.MAX_REUSE_DISTANCE_NUMEL))
    kept = sum(live_window_partitions(dims, w, cfg.train.activation_checkpointing, reuse, max_in_cpu, e))
    read_bytes = max(0, uses * nvme_numel - (uses - 1) * kept) * e
    pool = settings.param_pool_bytes
    if nvme_numel and isinstance(pool, int) and pool < auto_param_pool_bytes(dims.param_numels, e, w, 1):
        read_bytes *= UNOVERLAPPED_READ_FACTOR
    sub = ds_value(plan_cfg, "zero_optimization.sub_group_size")
    chunk = _chunk_numel(getattr(settings, "optimizer_chunk_numel", None))
    step_numel = min(sub, chunk) if chunk is not None else sub
    ops = math.ceil(sum(parts) / max(1, step_numel))
    return read_bytes / NOMINAL_NVME_BYTES_PER_S + ops * NVME_OP_OVERHEAD_S


def _candidates(cfg: RunConfig, dims: ModelDims, world_size: int) -> list[dict[str, Any]]:
    knobs = knobs_available()
    values = [k.candidates(dims, cfg, world_size) for k in knobs]
    return [dict(zip((k.name for k in knobs), combo, strict=True)) for combo in itertools.product(*values)]


def plan_candidates(cfg: RunConfig, world_size: int = 1, dims: ModelDims | None = None
                    ) -> list[tuple[dict[str, Any], MemAscendSettings, EnginePlan, float]]:
    """Every knob combination planned: ``(values, settings, memascend's plan, step cost s)``, in
    :data:`KNOBS` order (fastest values first)."""
    dims = dims or model_dims(cfg)
    shape = ModelShape(dims.total_numel, dims.param_numels, dims.module_param_counts)
    out = []
    for values in _candidates(cfg, dims, world_size):
        requested = dataclasses.replace(cfg.memascend, **values)
        run_cfg = dataclasses.replace(cfg, engine="memascend", memascend=requested)
        run = resolve(run_cfg, shape, world_size)
        plan = plan_engine(run_cfg, dims, run, world_size)
        out.append((values, requested, plan,
                    expected_step_cost_s(run_cfg, dims, run.ds_config, run.settings, world_size)))
    return out


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
                      dims: ModelDims | None = None, flag: str = "--host-memory-budget") -> BudgetChoice:
    """The knob values that fit ``budget_bytes`` with the smallest expected step cost.

    Args:
        cfg: the run (its ``memascend`` settings are the starting point; the knobs replace theirs).
        budget_bytes: host memory (peak RSS, locked included, summed over this host's ranks), bytes.
        world_size: ranks on this host.
        dims: the model's layout (laid out on the meta device when not given).
        flag: how the refusal names the budget (the flag or the JSON key).

    Returns:
        The choice; ties go to the faster values (:data:`KNOBS` order).

    Raises:
        UserError: nothing fits; the one line names the smallest workable budget.
    """
    planned = plan_candidates(cfg, world_size, dims)
    fitting = [c for c in planned if c[2].peak_rss_bytes <= usable_bytes(budget_bytes)]
    if not fitting:
        smallest = smallest_workable_budget_bytes(planned)
        best = min(planned, key=lambda c: c[2].peak_rss_bytes)
        top = best[2].biggest(1)[0]
        raise UserError(
            f"{flag} {_size(budget_bytes)} is below the smallest workable budget {smallest / GIB:.2f} GiB for "
            f"{_model_label(cfg)} ({cfg.train.dtype}, {cfg.train.micro_batch} x {cfg.data.seq_len} tokens, "
            f"{world_size} rank(s); planned peak RSS {best[2].peak_rss_bytes / GIB:.2f} GiB at the smallest "
            f"settings, largest consumer: {top.name} {top.bytes / GIB:.2f} GiB)")
    values, settings, plan, cost = min(fitting, key=lambda c: c[3])  # min keeps the first of equals
    return BudgetChoice(values, settings, plan, cost, budget_bytes)


def _size(n_bytes: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n_bytes >= scale and n_bytes % scale == 0:
            return f"{n_bytes // scale}{unit}"
    return f"{n_bytes / GIB:.2f}GiB" if n_bytes >= GIB else f"{n_bytes}B"


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
            choice = choose_for_budget(cfg, int(cfg.memascend.host_memory_budget), world_size)
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
    """``cfg`` with the knobs :func:`choose_for_budget` picks for ``cfg.memascend.host_memory_budget``
    (unchanged without a budget or with ``--engine baseline``).

    Args:
        announce: called with :meth:`BudgetChoice.describe` (e.g. to print it once).

    Raises:
        UserError: the budget is below the smallest workable one.
    """
    budget = cfg.memascend.host_memory_budget
    if budget is None or cfg.engine != "memascend":
        return cfg
    choice = choose_for_budget(cfg, budget, world_size)
    if announce is not None:
        announce(choice.describe())
    return dataclasses.replace(cfg, memascend=choice.settings)
