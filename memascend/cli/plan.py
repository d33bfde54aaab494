"""``memascend plan``: predict a run's peak host RSS, locked memory and NVMe space, without running it."""

from __future__ import annotations

import json

import click

from memascend.cli import options
from memascend.cli.params import POSITIVE_FLOAT


@click.command("plan", context_settings={"show_default": True})
@options.apply_groups(*options.RUN_SHAPE, options.BUDGET)
@click.option("--nproc", type=int, default=1, help="Ranks on this host (memory is summed over them)")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON instead of a table")
@click.option("--cap-gib", type=POSITIVE_FLOAT, default=None,
              help="Also name the largest from-scratch preset, the longest --seq-len (1K-32K) and the largest "
                   "--micro-batch each engine fits under this host-memory cap (GiB; without it, the last two "
                   "under --host-memory-budget), the run otherwise as configured")
@click.option("--scaling", is_flag=True,
              help="Also plan every from-scratch preset, llama-tiny to the Llama-2-7B/70B shapes (llama-7b, "
                   "llama-70b), with this run's other settings: host peak RSS, locked memory and NVMe space")
def plan(nproc: int, as_json: bool, cap_gib: float | None, scaling: bool, **kw) -> None:
    """Predict peak host RSS, locked memory (VmLck) and NVMe space of a fine-tuning run under stock
    DeepSpeed (baseline) and under memascend, and name the biggest consumers. Nothing is run or loaded
    (the model is laid out on the meta device). Takes the same model/data/offload flags as
    `memascend finetune` (a missing --data path is refused, no data is read; --engine picks the engine
    checked against this host's memory, RAM or a cgroup limit, with a warning when it does not fit). Sizes are GiB; memory is the sum over the host's ranks, except the two
    "needed / rank" rows: the NVMe space and lockable memory finetune requires of each rank before
    it starts.
    """
    from memascend.errors import UserError
    from memascend.plan import largest_preset_under_cap, model_dims, plan_presets, plan_run
    from memascend.units import GIB

    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    if cap_gib is not None and cap_gib <= 0:
        raise UserError(f"--cap-gib must be positive, got {cap_gib}")
    cfg = options.run_config_from_flags(kw)
    options.show_config_notes(cfg)
    _check_data(cfg.data.source, cfg.data.max_bytes)
    from memascend.plan.budget import apply_host_memory_budget

    cfg = apply_host_memory_budget(cfg, nproc, announce=lambda line: click.echo(f"memascend: {line}", err=True))
    dims = model_dims(cfg)
    plans = plan_run(cfg, world_size=nproc, dims=dims)
    rows = plan_presets(cfg, nproc) if scaling or cap_gib else None
    fits = largest_preset_under_cap(cfg, int(cap_gib * GIB), nproc, rows) if cap_gib else None
    cap_bytes = int(cap_gib * GIB) if cap_gib else cfg.memascend.host_memory_budget
    shapes = _shapes_under_cap(cfg, cap_bytes, nproc, dims) if cap_bytes else None
    host = _warn_if_over_host(plans[cfg.engine])
    if as_json:
        doc = {k: p.to_dict() for k, p in plans.items()}
        doc["host"] = {"memory_bytes": host.limit_bytes, "source": host.source, "engine": cfg.engine,
                       "fits": plans[cfg.engine].peak_rss_bytes <= host.limit_bytes}
        if fits is not None:
            doc["largest_preset_under_cap"] = {"cap_gib": cap_gib, **{k: v and v[0] for k, v in fits.items()}}
        if shapes is not None:
            for key, found in shapes.items():
                doc[key] = {"cap_bytes": cap_bytes, **{k: v and v.value for k, v in found.items()}}
        if scaling:
            doc["scaling"] = [{"preset": name, "param_numel": numel,
                               **{k: {key: p.to_dict()[key] for key in _SCALING_KEYS} for k, p in plans_.items()}}
                              for name, numel, plans_ in rows]
        click.echo(json.dumps(doc, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    base, mine = plans["baseline"], plans["memascend"]
    t = Table(title=f"memascend plan: {_model_title(cfg)}, "
                    f"{cfg.train.dtype}, {cfg.train.micro_batch} x {cfg.data.seq_len} tokens, {nproc} rank(s)",
              title_justify="left")
    for h in ("", "baseline GiB", "memascend GiB", "memascend / baseline"):
        t.add_column(h, justify="left" if not h else "right")
    for label, b, m in (("peak host RSS", base.peak_rss_bytes, mine.peak_rss_bytes),
                        ("peak locked (VmLck)", base.peak_locked_bytes, mine.peak_locked_bytes),
                        ("NVMe space", base.nvme_bytes, mine.nvme_bytes),
                        ("NVMe needed / rank", base.preflight_nvme_bytes_per_rank,
                         mine.preflight_nvme_bytes_per_rank),
                        ("lock needed / rank", base.preflight_locked_bytes_per_rank,
                         mine.preflight_locked_bytes_per_rank)):
        t.add_row(label, f"{b / GIB:.2f}", f"{m / GIB:.2f}", f"{m / b:.2f}" if b else "-")
    if base.placement is not None and mine.placement is not None:
        for label, key in (("NVMe read / step / rank", "read_bytes"), ("NVMe written / step / rank", "write_bytes")):
            b, m = getattr(base.placement, key), getattr(mine.placement, key)
            t.add_row(label, f"{b / GIB:.2f}", f"{m / GIB:.2f}", f"{m / b:.2f}" if b else "-")
    console.print(t)
    if mine.placement is not None:
        console.print(_placement_table(base, mine))
    for p in (base, mine):
        c = Table(title=f"{p.engine}: consumers, largest first", title_justify="left")
        for h in ("component", "GiB", "locked", "phase", "allocated by"):
            c.add_column(h, justify="right" if h == "GiB" else "left")
        for comp in p.components:
            c.add_row(comp.name, f"{comp.bytes / GIB:.2f}", "yes" if comp.locked else "", comp.phase, comp.source)
        console.print(c)
    if scaling:
        console.print(_scaling_table(rows, cfg, nproc))
    if fits is not None:
        for engine, fit in fits.items():
            what = f"{fit[0]} (planned peak {fit[1] / GIB:.2f} GiB)" if fit else "no preset"
            console.print(f"largest from-scratch preset under {cap_gib:g} GiB, {engine}: {what}")
    if shapes is not None:
        for line in _shape_lines(shapes, cfg, cap_bytes, dims):
            click.echo(line)


def _shapes_under_cap(cfg, cap_bytes: int, nproc: int, dims) -> dict:
    """``{"longest_seq_len_under_cap": {engine: Fit | None}, "largest_micro_batch_under_cap": ...}``
    (:mod:`memascend.plan.context_fit`)."""
    from memascend.plan.context_fit import largest_micro_batch_under_cap, longest_seq_len_under_cap

    return {"longest_seq_len_under_cap": longest_seq_len_under_cap(cfg, cap_bytes, nproc, dims),
            "largest_micro_batch_under_cap": largest_micro_batch_under_cap(cfg, cap_bytes, nproc, dims)}


def _shape_lines(shapes: dict, cfg, cap_bytes: int, dims) -> list[str]:
    """The two lines of :func:`_shapes_under_cap`'s answer, e.g. ``longest --seq-len under 3 GiB
    (1024-32768 tokens, micro-batch 1): baseline none, memascend 32768 (planned 2.73 GiB)``."""
    from memascend.plan.context_fit import searched_lengths
    from memascend.units import GIB

    def each(found: dict) -> str:
        return ", ".join(f"{engine} " + (f"{fit.value} (planned {fit.peak_rss_bytes / GIB:.2f} GiB)" if fit else "none")
                         for engine, fit in found.items())

    lengths = searched_lengths(dims)
    span = f"{lengths[0]}-{lengths[-1]} tokens" if lengths else "no length the model accepts"
    cap = f"{cap_bytes / GIB:g} GiB"
    return [f"longest --seq-len under {cap} ({span}, micro-batch {cfg.train.micro_batch}): "
            f"{each(shapes['longest_seq_len_under_cap'])}",
            f"largest --micro-batch under {cap} (--seq-len {cfg.data.seq_len}): "
            f"{each(shapes['largest_micro_batch_under_cap'])}"]


_SCALING_KEYS = ("peak_rss_bytes", "peak_locked_bytes", "nvme_bytes")


def _placement_table(base, mine):
    """Where each engine keeps one rank's swappable state (DRAM or NVMe) and the NVMe bytes of a step
    (:class:`memascend.plan.placement.Placement`)."""
    from rich.table import Table

    from memascend.plan.placement import OPTIMIZER_DRAM_BYTES_PER_NUMEL
    from memascend.units import GIB

    t = Table(title="placement per rank: what stays in DRAM, what goes to NVMe, bytes per step", title_justify="left")
    for h in ("", "baseline", "memascend"):
        t.add_column(h, justify="left" if not h else "right")

    def both(fn) -> tuple[str, str]:
        return tuple("-" if p.placement is None else fn(p.placement) for p in (base, mine))

    def size(numel: int, elem_bytes: int) -> str:
        return f"{numel / 1e6:,.1f} M el, {numel * elem_bytes / GIB:.2f} GiB"

    t.add_row("16-bit params in DRAM", *both(lambda p: size(p.param_dram_numel, p.param_elem_bytes)))
    t.add_row("16-bit params on NVMe only", *both(lambda p: size(p.param_nvme_numel, p.param_elem_bytes)))
    t.add_row("optimizer sub-groups kept in DRAM", *both(
        lambda p: f"{p.optimizer_kept_groups}/{p.optimizer_groups}: "
                  f"{size(p.optimizer_kept_numel, OPTIMIZER_DRAM_BYTES_PER_NUMEL)}"))
    t.add_row("optimizer swapped to NVMe", *both(
        lambda p: size(p.optimizer_nvme_numel, OPTIMIZER_DRAM_BYTES_PER_NUMEL)))
    t.add_row("NVMe read / step (params + optimizer)", *both(
        lambda p: f"{p.param_read_bytes / GIB:.2f} + {p.optimizer_read_bytes / GIB:.2f} GiB"))
    t.add_row("NVMe written / step (params + optimizer)", *both(
        lambda p: f"{p.param_write_bytes / GIB:.2f} + {p.optimizer_write_bytes / GIB:.2f} GiB"))
    t.add_row("peak host RSS / locked (all ranks)", *(f"{p.peak_rss_bytes / GIB:.2f} / {p.peak_locked_bytes / GIB:.2f} GiB"
                                                      for p in (base, mine)))
    return t


def _scaling_table(rows, cfg, nproc: int):
    """The ``--scaling`` table: one row per preset (:func:`memascend.plan.plan_presets`), GiB."""
    from rich.table import Table

    from memascend.units import GIB

    t = Table(title=f"scaling: from-scratch presets, {cfg.train.dtype}, {cfg.train.micro_batch} x "
                    f"{cfg.data.seq_len} tokens, {nproc} rank(s) (GiB)", title_justify="left")
    for h in ("preset", "params", "RSS stock", "RSS memascend", "locked stock", "locked memascend", "NVMe"):
        t.add_column(h, justify="left" if h == "preset" else "right", no_wrap=h in ("preset", "params"))
    for name, numel, plans in rows:
        base, mine = plans["baseline"], plans["memascend"]
        t.add_row(name, _count(numel), *(f"{v / GIB:.2f}" for v in (
            base.peak_rss_bytes, mine.peak_rss_bytes, base.peak_locked_bytes, mine.peak_locked_bytes,
            mine.nvme_bytes)))
    return t


def _count(numel: int) -> str:
    """``1.10 B`` or ``3.2 M``."""
    return f"{numel / 1e9:.2f} B" if numel >= 1e9 else f"{numel / 1e6:.1f} M"


def _model_title(cfg) -> str:
    """``llama-1b (from scratch, 1.10 B parameters)``, ``llama-tiny (from scratch, 3.2 M parameters)``,
    or the model's name."""
    fs = cfg.model.from_scratch
    if fs is None:
        return cfg.model.name_or_path
    from memascend.cli.outputs import run_name

    return f"{run_name(cfg)} (from scratch, {_count(fs.param_numel)} parameters)"


def _check_data(source: str, max_bytes: int) -> None:
    """Refuse a ``--data`` path that does not exist, a data file that is not a regular file, and data
    past ``--max-data-bytes``, as ``memascend finetune`` would (sizes are read, no data).

    Raises:
        UserError: a comma-separated part that is neither a built-in corpus, an existing path nor a
            Hugging Face data set id; a device or FIFO; local files holding more than ``max_bytes``.
    """
    from pathlib import Path

    from memascend.data.readers import BUILTIN_CORPORA, check_local_sizes
    from memascend.data.tables import is_hub_id
    from memascend.errors import UserError

    if source in BUILTIN_CORPORA:
        return
    parts = [p.strip() for p in source.split(",") if p.strip()]
    for part in parts:
        if not Path(part).expanduser().exists() and not is_hub_id(part):
            raise UserError(f"data not found: {part} (plan reads no data, but finetune would stop here)")
    check_local_sizes(parts, max_bytes)


def _warn_if_over_host(engine_plan):
    """Warn on stderr when the planned peak RSS of the run's engine exceeds this host's memory (RAM or
    the cgroup limit); returns :class:`memascend.plan.host_fit.HostMemory`."""
    from memascend.plan.host_fit import host_memory
    from memascend.units import GIB

    host = host_memory()
    if engine_plan.peak_rss_bytes > host.limit_bytes:
        click.echo(f"memascend: warning: the {engine_plan.engine} run plans {engine_plan.peak_rss_bytes / GIB:.2f} GiB "
                   f"peak RSS, more than this host's {host.limit_bytes / GIB:.2f} GiB ({host.source}): it would "
                   "be OOM-killed or swap", err=True)
    return host
