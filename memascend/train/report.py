"""``report.json`` of a run: resolved config, versions, per-step numbers, memory peaks, NVMe bytes."""

from __future__ import annotations

import platform
import statistics
from importlib import metadata

import psutil

from memascend.config import RunConfig
from memascend.memory import torch_thp

REPORT_VERSION = 1


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("memascend", "torch", "deepspeed", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


PHASES = ("forward_s", "backward_s", "optimizer_step_s")
"""The phases of a training step timed per step (``steps[i]["phase_s"]``), in order."""


def median_phase_s(per_step: list[dict]) -> dict[str, float] | None:
    """Median seconds of each phase (:data:`PHASES`) over the steady steps (the first excluded, as
    for ``median_step_s``); ``None`` when the steps carry no phase times (reports before they did)."""
    rows = [s["phase_s"] for s in (per_step[1:] or per_step) if s.get("phase_s")]
    if not rows:
        return None
    return {name: statistics.median(float(r[name]) for r in rows) for name in PHASES}


def build_report(
    *,
    cfg: RunConfig,
    ds_cfg: dict,
    derived: list[dict],
    engine_settings,
    info,
    split,
    shape,
    per_step: list[dict],
    loss_before: float | None,
    loss_after: float | None,
    summary: dict,
    rank_peaks: list[dict],
    io_read_bytes: int,
    io_write_bytes: int,
    swap_folder_bytes: int,
    train_s: float,
    wall_s: float,
    skipped_steps: int,
    model_dir: str | None,
    param_dtype: str,
) -> dict:
    """Assemble the report dict (all sizes in bytes, times in seconds)."""
    # The first step pays one-off costs (swap file creation, allocator warm-up): the median of the
    # later steps is the steady-state number.
    steady_steps = per_step[1:] or per_step
    return {
        "report_version": REPORT_VERSION,
        # a report.json written while the run goes says "complete": false (memascend.train.run_log)
        "complete": True,
        "status": "completed",
        "engine": cfg.engine,
        "config": cfg.to_dict(),
        "deepspeed_config": ds_cfg,
        "derived_deepspeed_settings": derived,
        "memascend_settings": engine_settings,
        "versions": versions(),
        "host": {
            "platform": platform.platform(),
            "cpu_count": psutil.cpu_count(),
            "memory_total_bytes": psutil.virtual_memory().total,
            "device_type": info.device_type,
            "world_size": info.world_size,
            # Whether torch's host tensors of >= 2 MiB were advised MADV_HUGEPAGE (enable_torch_thp).
            "torch_thp": torch_thp.status(),
        },
        "model": {
            "source": cfg.model.name_or_path,
            "from_scratch": cfg.model.from_scratch is not None,
            "param_numel": shape.total_numel,
            "largest_param_numel": shape.largest_numel,
            "param_dtype": param_dtype,
        },
        "data": {
            "source": cfg.data.source,
            "documents": split.num_documents,
            "tokens": split.num_tokens,
            "train_blocks": len(split.train),
            "eval_blocks": len(split.eval),
            "seq_len": cfg.data.seq_len,
        },
        "eval": {"loss_before": loss_before, "loss_after": loss_after},
        "steps": per_step,
        "num_steps": len(per_step),
        "skipped_steps": skipped_steps,
        "median_step_s": statistics.median(s["time_s"] for s in steady_steps) if steady_steps else None,
        "median_phase_s": median_phase_s(per_step),
        "median_minor_faults": statistics.median(s["minor_faults"] for s in steady_steps)
        if steady_steps and all("minor_faults" in s for s in steady_steps)
        else None,
        "median_tokens_per_s": statistics.median(s["tokens_per_s"] for s in steady_steps) if steady_steps else None,
        "train_s": train_s,
        "wall_s": wall_s,
        "memory": {
            **summary,
            "ranks": rank_peaks,
            # Ranks on one host add up; the sum of per-rank peaks bounds the host's peak.
            "sum_rank_peak_rss_bytes": sum(r["peak_rss_bytes"] for r in rank_peaks),
            "sum_rank_peak_locked_bytes": sum(r["peak_locked_bytes"] for r in rank_peaks),
        },
        "nvme": {
            "read_bytes": io_read_bytes,
            "write_bytes": io_write_bytes,
            "swap_folder_bytes": swap_folder_bytes,
            "path": cfg.offload.nvme_path if cfg.offload.uses_nvme else None,
        },
        "model_dir": model_dir,
    }
