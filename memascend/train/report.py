"""``report.json`` of a run: resolved config, versions, per-step numbers, memory peaks, NVMe bytes.

One builder: :func:`build_report` assembles the whole final report from :class:`ReportInputs`
(what the run measured and decided), one section function per part; :func:`report_header` is what
a partial report (:mod:`memascend.train.run_log`) carries before the first step. All sizes are in
bytes, all times in seconds.
"""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import psutil

from memascend.config import RunConfig
from memascend.memory import torch_thp

REPORT_VERSION = 1


def versions() -> dict[str, str | None]:
    """Versions of Python and of the packages a run depends on (``None``: not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("memascend", "torch", "deepspeed", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


PHASES = ("forward_s", "backward_s", "optimizer_step_s")
"""The phases of a training step timed per step (``steps[i]["phase_s"]``), in order."""


def median_phase_s(per_step: list[dict], key: str = "phase_s") -> dict[str, float] | None:
    """Median seconds of each phase (:data:`PHASES`) over the steady steps (the first excluded, as
    for ``median_step_s``) of the steps' ``key`` (``phase_s`` wall, ``phase_cpu_s`` CPU,
    ``phase_sys_s`` system seconds); ``None`` when the steps carry none (reports before they did)."""
    rows = [s[key] for s in (per_step[1:] or per_step) if s.get(key)]
    if not rows:
        return None
    return {name: statistics.median(float(r[name]) for r in rows) for name in PHASES}


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One optimizer step, as ``steps.jsonl`` and ``report.json``'s ``steps[i]`` record it.

    Attributes:
        step: the step's number, 1-based (after a resume, counting on from the checkpoint's).
        loss: mean training loss of the step's micro-batches over all ranks.
        rank_losses: this rank's loss of each micro-batch.
        time_s: this rank's wall time of the step, seconds.
        phase_s: this rank's wall seconds in each phase (:data:`PHASES`), summed over the
            micro-batches (``engine.step()`` is the ZeRO-3 optimizer step, swap-in and swap-out of
            the optimizer state included).
        tokens: tokens of the step, all ranks (global batch x sequence length).
        tokens_per_s: ``tokens / time_s``.
        rss_bytes: this rank's resident set size at the end of the step.
        minor_faults: pages this rank's process faulted in during the step (all threads): memory
            handed back to the OS and touched again costs one fault per page (4 KiB, or 2 MiB with
            THP).
        skipped: DeepSpeed skipped the optimizer step (``engine.skipped_steps`` grew).
        lr: the learning rate the step ran with (the optimizer's first parameter group).
        locked_bytes: this rank's locked memory (VmLck) at the end of the step.
        nvme_read_bytes, nvme_write_bytes: bytes this rank's process read from and wrote to
            storage during the step (``/proc/self/io``: the swap traffic, as ``report.json``'s
            ``nvme`` section counts it over the training loop).
        eval_loss: the held-out loss measured after this step (``--eval-every``), else ``None``.
        swap_read_bytes, swap_write_bytes: bytes this rank's swap handles read from and wrote to the
            swap target during the step (:mod:`memascend.integrations.deepspeed.io_meter`: the
            buffers handed to DeepSpeed's aio handle or the raw store, either engine).
        io_wait_s: seconds of the step this rank was blocked waiting for swap transfers.
        phase_io: per phase (:data:`PHASES`) ``read_bytes``, ``write_bytes``, ``read_ops``,
            ``write_ops`` and ``io_wait_s`` of the swap target, summed over the micro-batches.
        phase_floor_s: per phase, its disk floor in seconds (its swap bytes over the swap target's
            bandwidth measured at the start of the run: ``report.json``'s ``swap_io.bandwidth``);
            ``None`` where no bandwidth was measured (no swap folder).
        phase_cpu_s: per phase, CPU seconds this rank's process used (user + system, every thread:
            ``os.times``), summed over the micro-batches. On a loaded host the wall time of a
            compute-bound phase stretches with the load while its CPU time does not.
        phase_sys_s: per phase, the system (kernel) part of ``phase_cpu_s``: page faults, zeroing,
            huge-page compaction, I/O submission.
        step_worker_s: with the optimizer step beside the next forward (step overlap), the seconds
            its worker thread spent on the optimizer step that finished during this step (the
            previous step's, run beside this step's forward: the same step whose worker I/O this
            step's ``optimizer_step_s`` phase counts); ``None`` without the overlap.
    """

    step: int
    loss: float
    rank_losses: tuple[float, ...]
    time_s: float
    phase_s: Mapping[str, float]
    tokens: int
    tokens_per_s: float
    rss_bytes: int
    minor_faults: int
    skipped: bool
    lr: float
    locked_bytes: int
    nvme_read_bytes: int
    nvme_write_bytes: int
    eval_loss: float | None = None
    swap_read_bytes: int = 0
    swap_write_bytes: int = 0
    io_wait_s: float = 0.0
    phase_io: Mapping[str, Mapping[str, float]] | None = None
    phase_floor_s: Mapping[str, float] | None = None
    phase_cpu_s: Mapping[str, float] | None = None
    phase_sys_s: Mapping[str, float] | None = None
    step_worker_s: float | None = None

    def to_dict(self) -> dict:
        """The JSON record (keys in this order; lists and dicts are fresh copies)."""
        return {
            "step": self.step,
            "loss": self.loss,
            "rank_losses": list(self.rank_losses),
            "time_s": self.time_s,
            "phase_s": dict(self.phase_s),
            "tokens": self.tokens,
            "tokens_per_s": self.tokens_per_s,
            "rss_bytes": self.rss_bytes,
            "minor_faults": self.minor_faults,
            "skipped": self.skipped,
            "lr": self.lr,
            "locked_bytes": self.locked_bytes,
            "nvme_read_bytes": self.nvme_read_bytes,
            "nvme_write_bytes": self.nvme_write_bytes,
            "eval_loss": self.eval_loss,
            "swap_read_bytes": self.swap_read_bytes,
            "swap_write_bytes": self.swap_write_bytes,
            "io_wait_s": self.io_wait_s,
            "phase_io": {k: dict(v) for k, v in self.phase_io.items()} if self.phase_io is not None else None,
            "phase_floor_s": dict(self.phase_floor_s) if self.phase_floor_s is not None else None,
            "phase_cpu_s": dict(self.phase_cpu_s) if self.phase_cpu_s is not None else None,
            "phase_sys_s": dict(self.phase_sys_s) if self.phase_sys_s is not None else None,
            "step_worker_s": self.step_worker_s,
        }


def phase_floor_s(phase_io: Mapping[str, Mapping[str, float]], bandwidth: Mapping[str, float] | None
                  ) -> dict[str, float] | None:
    """Each phase's disk floor in seconds: ``read_bytes / read_bytes_per_s + write_bytes /
    write_bytes_per_s`` (reads and writes share the target); ``None`` without a ``bandwidth``
    (``io_meter.Bandwidth.to_dict()``)."""
    if bandwidth is None:
        return None
    return {name: io["read_bytes"] / bandwidth["read_bytes_per_s"] + io["write_bytes"] / bandwidth["write_bytes_per_s"]
            for name, io in phase_io.items()}


def swap_io_fields(phase_s: Mapping[str, float], phase_io: Mapping[str, Mapping[str, float]],
                   bandwidth: Mapping[str, float] | None) -> dict[str, Any]:
    """The swap I/O fields of a :class:`StepRecord` from its per-phase I/O (``phase_s`` names the
    phases; ``phase_io`` as :attr:`StepRecord.phase_io`)."""
    return {
        "swap_read_bytes": int(sum(io["read_bytes"] for io in phase_io.values())),
        "swap_write_bytes": int(sum(io["write_bytes"] for io in phase_io.values())),
        "io_wait_s": float(sum(io["io_wait_s"] for io in phase_io.values())),
        "phase_io": {name: dict(phase_io[name]) for name in phase_s},
        "phase_floor_s": phase_floor_s(phase_io, bandwidth),
    }


def swap_io_summary(per_step: list[dict], bandwidth: Mapping[str, float] | None) -> dict:
    """``report.json``'s ``swap_io``: the bandwidth probe and, over the steady steps (the first
    excluded, as for ``median_step_s``), the median swap bytes and I/O wait of a step and of each
    phase, each phase's disk floor and its time over that floor.

    Returns:
        ``{"bandwidth", "median_step": {read_bytes, write_bytes, io_wait_s}, "median_phase": {phase:
        {read_bytes, write_bytes, io_wait_s, time_s, floor_s, time_over_floor}}}``; the medians are
        ``None`` when the steps carry no swap I/O (reports written before it was recorded). With the
        optimizer step beside the next forward (steps carry ``step_worker_s``), ``optimizer_step_s``
        adds ``worker_s`` (the worker's median seconds per step: the step's own time, the phase's
        ``time_s`` being only the training thread's part) and ``worker_over_floor``.
    """
    steady = [s for s in (per_step[1:] or per_step) if s.get("phase_io")]
    out: dict[str, Any] = {"bandwidth": dict(bandwidth) if bandwidth is not None else None,
                           "median_step": None, "median_phase": None}
    if not steady:
        return out
    out["median_step"] = {key: statistics.median(s[field] for s in steady) for key, field in
                          (("read_bytes", "swap_read_bytes"), ("write_bytes", "swap_write_bytes"),
                           ("io_wait_s", "io_wait_s"))}
    phases = {}
    for name in PHASES:
        io = {key: statistics.median(s["phase_io"][name][key] for s in steady)
              for key in ("read_bytes", "write_bytes", "io_wait_s")}
        time_s = statistics.median(s["phase_s"][name] for s in steady)
        floors = [s["phase_floor_s"][name] for s in steady if s.get("phase_floor_s")]
        floor = statistics.median(floors) if floors else None
        phases[name] = {**io, "time_s": time_s, "floor_s": floor,
                        "time_over_floor": time_s / floor if floor else None}
    worker = [s["step_worker_s"] for s in steady if s.get("step_worker_s")]
    if worker:
        step = phases["optimizer_step_s"]
        step["worker_s"] = statistics.median(worker)
        step["worker_over_floor"] = step["worker_s"] / step["floor_s"] if step["floor_s"] else None
    out["median_phase"] = phases
    return out


@dataclass(frozen=True, kw_only=True)
class ReportInputs:
    """What a finished run hands to :func:`build_report` (rank 0's view; sizes in bytes, times in
    seconds).

    Attributes:
        cfg: the run's configuration.
        ds_config: the DeepSpeed config the engine ran with.
        derived: the derived DeepSpeed settings (``ResolvedRun.derived_dicts()``).
        engine_settings: the applied memascend settings (``dataclasses.asdict``).
        user_ds_config: the user's ``--deepspeed-config`` as read (``None`` without one).
        device_type, world_size: the accelerator (``cpu``/``cuda``) and the rank count.
        split: the data split (``num_documents``, ``num_tokens``, ``train``, ``eval``).
        shape: the model's parameter layout (``total_numel``, ``largest_numel``).
        param_dtype: the parameters' torch dtype name (``bfloat16``, ...).
        per_step: one record per optimizer step (``StepRecord.to_dict()``).
        loss_before, loss_after: held-out loss before and after training (``None``: no eval blocks).
        skipped_steps: optimizer steps DeepSpeed skipped (``engine.skipped_steps``).
        train_s, wall_s: the training loop's time and the run's wall time.
        summary: the memory sampler's summary (peaks, phase peaks).
        rank_peaks: every rank's :func:`rank_record` (the node it ran on and its swap folder or
            raw-store target).
        memory_breakdown: :func:`memascend.integrations.deepspeed.accounting.memory_breakdown`.
        io_read_bytes, io_write_bytes: this process's block I/O during the training loop.
        swap_folder_bytes: the swap folder's largest allocated size, sampled after every step and after
            the last optimizer step finished (0 without one).
        nvme_backend: ``raw_store``, ``folder`` or ``None`` (no NVMe).
        store_report, store_ranks: the raw store's report, and every rank's (``None``: no store).
        seeding: what seeded the RNGs (:func:`memascend.train.determinism.seed_training`).
        model_dir: where the fine-tuned model was written (``None``: not saved).
        resumed_from: the checkpoint resumed from (``None``: step 0).
        start_step: the first step this run trained.
        periodic_saved: tags of the periodic checkpoints saved.
        checkpoint_saves: every save's ``{"path", "save_s", "manifest_s", "bytes"}``.
        saved_to, saved_tag: ``--save-checkpoint`` and the tag saved there (``None``: none).
        swap_bandwidth: the swap target's measured bandwidth (``io_meter.Bandwidth.to_dict()``;
            ``None``: not measured).
        step_overlap: the optimizer step run beside the next forward
            (:func:`memascend.integrations.deepspeed.step_overlap.stats`; ``None``: not run so).
    """

    cfg: RunConfig
    ds_config: dict
    derived: list[dict]
    engine_settings: dict
    user_ds_config: dict | None
    device_type: str
    world_size: int
    split: object
    shape: object
    param_dtype: str
    per_step: list[dict]
    loss_before: float | None
    loss_after: float | None
    skipped_steps: int
    train_s: float
    wall_s: float
    summary: dict
    rank_peaks: list[dict]
    memory_breakdown: dict
    io_read_bytes: int
    io_write_bytes: int
    swap_folder_bytes: int
    nvme_backend: str | None
    store_report: dict | None
    store_ranks: list[dict] | None
    seeding: dict
    model_dir: str | None
    resumed_from: str | None
    start_step: int
    periodic_saved: list[str]
    checkpoint_saves: list[dict]
    saved_to: str | None
    saved_tag: str | None
    swap_bandwidth: dict | None = None
    step_overlap: dict | None = None


def build_report(inp: ReportInputs) -> dict:
    """The final ``report.json`` dict of a completed run (keys in the order the file has them)."""
    cfg = inp.cfg
    return {
        "report_version": REPORT_VERSION,
        # a report.json written while the run goes says "complete": false (memascend.train.run_log)
        "complete": True,
        "status": "completed",
        "engine": cfg.engine,
        "config": cfg.to_dict(),
        "deepspeed_config": inp.ds_config,
        "derived_deepspeed_settings": inp.derived,
        "memascend_settings": inp.engine_settings,
        "versions": versions(),
        "host": _host_section(inp.device_type, inp.world_size),
        "model": {**_model_section(cfg, inp.shape), "param_dtype": inp.param_dtype},
        "data": _data_section(cfg, inp.split),
        "eval": {"loss_before": inp.loss_before, "loss_after": inp.loss_after},
        **_steps_section(inp.per_step, inp.skipped_steps),
        "train_s": inp.train_s,
        "wall_s": inp.wall_s,
        "memory": _memory_section(inp.summary, inp.rank_peaks),
        "nvme": _nvme_section(inp),
        "model_dir": inp.model_dir,
        "memory_breakdown": inp.memory_breakdown,
        # The user's --deepspeed-config as read (its path may be gone when the report is read
        # again, e.g. by the planner's check against recorded runs).
        "user_deepspeed_config": inp.user_ds_config,
        "seeding": inp.seeding,
        "checkpoint": _checkpoint_section(inp),
        "swap_io": swap_io_summary(inp.per_step, inp.swap_bandwidth),
        "median_phase_cpu_s": median_phase_s(inp.per_step, "phase_cpu_s"),
        "median_phase_sys_s": median_phase_s(inp.per_step, "phase_sys_s"),
        "step_overlap": inp.step_overlap,
    }


def report_header(cfg: RunConfig, shape, split, info) -> dict:
    """What a partial ``report.json`` carries before the first step (the final report's keys).

    Args:
        info: the rank's :class:`memascend.train.dist.DistInfo` (``device_type``, ``world_size``).
    """
    return {
        "report_version": REPORT_VERSION,
        "engine": cfg.engine,
        "config": cfg.to_dict(),
        "versions": versions(),
        "host": {"device_type": info.device_type, "world_size": info.world_size},
        "model": _model_section(cfg, shape),
        "data": _data_section(cfg, split),
    }


def _dist_backend() -> str | None:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None


def _host_section(device_type: str, world_size: int) -> dict:
    return {
        "platform": platform.platform(),
        "cpu_count": psutil.cpu_count(),
        "memory_total_bytes": psutil.virtual_memory().total,
        "device_type": device_type,
        "world_size": world_size,
        # Whether torch's host tensors of >= 2 MiB were advised MADV_HUGEPAGE (enable_torch_thp).
        "torch_thp": torch_thp.status(),
        # The collective backend DeepSpeed started (nccl on CUDA, gloo on its CPU accelerator).
        "dist_backend": _dist_backend(),
    }


def _model_section(cfg: RunConfig, shape) -> dict:
    from memascend.models.loading import hub_origin

    origin = hub_origin(cfg.model)
    return {
        "source": cfg.model.name_or_path,
        # a Hugging Face model id only: {"id", "revision", "commit"} of the snapshot the run used
        **({"hub": origin} if origin is not None else {}),
        "from_scratch": cfg.model.from_scratch is not None,
        "param_numel": shape.total_numel,
        "trainable_param_numel": shape.trainable_numel,  # all but frozen ones (a LoRA base)
        "largest_param_numel": shape.largest_numel,
    }


def _data_section(cfg: RunConfig, split) -> dict:
    return {
        "source": cfg.data.source,
        "documents": split.num_documents,
        "tokens": split.num_tokens,
        "train_blocks": len(split.train),
        "eval_blocks": len(split.eval),
        "seq_len": cfg.data.seq_len,
    }


def _steps_section(per_step: list[dict], skipped_steps: int) -> dict:
    # The first step pays one-off costs (swap file creation, allocator warm-up): the median of the
    # later steps is the steady-state number.
    steady_steps = per_step[1:] or per_step
    return {
        "steps": per_step,
        "num_steps": len(per_step),
        "skipped_steps": skipped_steps,
        "median_step_s": statistics.median(s["time_s"] for s in steady_steps) if steady_steps else None,
        "median_phase_s": median_phase_s(per_step),
        "median_minor_faults": statistics.median(s["minor_faults"] for s in steady_steps)
        if steady_steps and all("minor_faults" in s for s in steady_steps)
        else None,
        "median_tokens_per_s": statistics.median(s["tokens_per_s"] for s in steady_steps) if steady_steps else None,
    }


def rank_record(info: Any, summary: dict, raw_store: Any = None, swap_dir: str | os.PathLike | None = None) -> dict:
    """One rank's entry of ``memory.ranks``: where it ran and what it swapped to.

    Args:
        info: the rank's :class:`~memascend.train.dist.DistInfo`.
        summary: its memory sampler's summary (``peak_rss_bytes``, ``peak_locked_bytes``, bytes).
        raw_store: its raw store (``target``: the file or device, ``is_block_device``), or ``None``.
        swap_dir: its private swap folder (no raw store), or ``None`` (nothing on NVMe).

    Returns:
        ``rank``, ``peak_rss_bytes``, ``peak_locked_bytes`` (bytes), ``hostname``, ``node_rank``,
        ``local_rank``, ``swap_target`` (absolute path as that host sees it, ``None`` without one) and
        ``swap_kind`` (``folder``, ``store_file``, ``block_device`` or ``None``).
    """
    if raw_store is not None:
        target, kind = raw_store.target, "block_device" if raw_store.is_block_device else "store_file"
    else:
        target, kind = swap_dir, None if swap_dir is None else "folder"
    return {"rank": info.rank, "peak_rss_bytes": summary["peak_rss_bytes"],
            "peak_locked_bytes": summary["peak_locked_bytes"], **info.node_record(),
            "swap_target": None if target is None else os.path.abspath(target), "swap_kind": kind}


def node_peaks(rank_peaks: list[dict]) -> list[dict]:
    """Per node (host): its ranks and the sums of their peaks, what that host's DRAM must hold.

    Args:
        rank_peaks: one dict per rank with ``rank``, ``peak_rss_bytes``, ``peak_locked_bytes`` and,
            where recorded, ``node_rank`` and ``hostname`` (a rank without them counts as node 0).

    Returns:
        One dict per node, ordered by node rank: ``node_rank``, ``hostname``, ``ranks`` (global ranks),
        ``swap_targets`` (each of those ranks' ``swap_target``, in the same order; ``None`` where not
        recorded), ``sum_rank_peak_rss_bytes``, ``sum_rank_peak_locked_bytes`` (bytes; an upper bound
        of the host's peak, as the ranks' peaks need not coincide).
    """
    nodes: dict[int, dict] = {}
    for r in rank_peaks:
        node = nodes.setdefault(int(r.get("node_rank") or 0), {
            "node_rank": int(r.get("node_rank") or 0), "hostname": r.get("hostname"), "ranks": [],
            "swap_targets": [], "sum_rank_peak_rss_bytes": 0, "sum_rank_peak_locked_bytes": 0})
        node["ranks"].append(r["rank"])
        node["swap_targets"].append(r.get("swap_target"))
        node["sum_rank_peak_rss_bytes"] += r["peak_rss_bytes"]
        node["sum_rank_peak_locked_bytes"] += r["peak_locked_bytes"]
    return [nodes[k] for k in sorted(nodes)]


def _memory_section(summary: dict, rank_peaks: list[dict]) -> dict:
    nodes = node_peaks(rank_peaks)
    return {
        **summary,
        "ranks": rank_peaks,
        # Every rank of every node: on one host, the sum bounds the host's peak (ranks add up).
        "sum_rank_peak_rss_bytes": sum(r["peak_rss_bytes"] for r in rank_peaks),
        "sum_rank_peak_locked_bytes": sum(r["peak_locked_bytes"] for r in rank_peaks),
        # Several hosts: what each host holds, and the largest of them (the DRAM one host needs).
        "nodes": nodes,
        "max_node_peak_rss_bytes": max((n["sum_rank_peak_rss_bytes"] for n in nodes), default=0),
        "max_node_peak_locked_bytes": max((n["sum_rank_peak_locked_bytes"] for n in nodes), default=0),
    }


def _nvme_section(inp: ReportInputs) -> dict:
    offload = inp.cfg.offload
    out = {
        "read_bytes": inp.io_read_bytes,
        "write_bytes": inp.io_write_bytes,
        "swap_folder_bytes": inp.swap_folder_bytes,
        "path": offload.nvme_path if offload.uses_nvme else None,
        "backend": inp.nvme_backend,
    }
    if inp.nvme_backend == "raw_store":
        out["store"] = inp.store_report
        out["store_ranks"] = inp.store_ranks
    return out


def _checkpoint_section(inp: ReportInputs) -> dict:
    return {
        "resumed_from": inp.resumed_from,
        "periodic_saved": inp.periodic_saved,
        # every save of this run: wall seconds (DeepSpeed's save + hashing/fsync + rename), of which
        # manifest_s hashing and fsyncing the files (rank 0), and the checkpoint's bytes
        "saves": inp.checkpoint_saves,
        "start_step": inp.start_step,
        "saved_to": inp.saved_to,
        "saved_tag": inp.saved_tag,
    }
