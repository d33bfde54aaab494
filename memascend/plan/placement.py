"""Where a rank's swappable state lives (DRAM or NVMe) and the NVMe bytes one training step moves.

ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on NVMe keeps two kinds of state per rank that
may live in host memory instead of on the swap target, both by whole optimizer sub-groups (DeepSpeed
0.19.8's ``_create_fp16_sub_groups``, :func:`~memascend.plan.optimizer_terms._sub_groups`) from the
first:

* the 16-bit parameter partitions of the sub-groups that fit in ``offload_param.max_in_cpu``
  (``param_dram_numel``; stage 3's ``_create_param_groups_fp16_flat_cpu_memory`` fills its flat DRAM
  buffer sub-group by sub-group, and a sub-group that does not fit, and every one after it, lives
  on NVMe only);
* the fp32 optimizer state (master weights, two Adam moments and the fp32 gradient, 16 bytes per
  element) of the sub-groups that fit in ``optimizer_dram_numel``.

:func:`plan_placement` says which, and counts the bytes a step reads from and writes to the swap
target per rank (:class:`Placement`):

* optimizer: every swapped sub-group (not kept, at least ``MIN_SWAPPABLE_BYTES`` of fp32) is read
  (master, moments, gradient: 16 bytes per element) and written (the same 16: the gradient in
  backward, the others after Adam) once per step; with gradient streaming and gradient accumulation,
  each later micro step reads its fp32 gradient back and writes the sum (4 + 4 bytes per element);
  with one micro step per step in bf16/fp16 the streamed gradient is stored in that dtype
  (``enable_16bit_gradient_swap``: 2 bytes per element instead of 4, each way);
* parameters: a partition on NVMe only is read at its use in forward and in backward (activation
  checkpointing's recompute runs right before the backward of its layer, which finds it still
  gathered), except where stage 3 keeps it gathered until its next use (the reuse window at the turn
  from forward to backward, :func:`~memascend.plan.shapes.live_window_partitions`), every micro step;
  the optimizer step writes the updated 16-bit partitions of trainable parameters once
  (:func:`_param_reads`).

Both engines are counted the same way; checked against the swap I/O meter's per-step bytes of
recorded runs (``report.json`` ``swap_io.median_step``) by :func:`measured_step_bytes` and the tests.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

from memascend.config import RunConfig, ds_defaults
from memascend.plan.optimizer_terms import _sub_groups
from memascend.plan.shapes import ModelDims, live_window_partitions
from memascend.units import DTYPE_BYTES, FP32_BYTES

OPTIMIZER_DRAM_BYTES_PER_NUMEL = 4 * FP32_BYTES
"""Host bytes per element of a kept optimizer sub-group: fp32 master weights, two Adam moments and
the fp32 gradient (unlocked, resident for the whole run)."""
OPTIMIZER_NVME_BYTES_PER_NUMEL = 4 * FP32_BYTES
"""Bytes per element a swapped sub-group reads, and again writes, in one step (the same four fp32
tensors)."""


@dataclass(frozen=True)
class Placement:
    """One rank's placement of its swappable state and the NVMe bytes of one training step.

    Attributes:
        param_elem_bytes: bytes per 16-bit parameter element (2 in bf16/fp16, 4 in fp32).
        param_dram_numel: parameter partition elements in the DRAM flat copy (whole sub-groups).
        param_nvme_numel: parameter partition elements on NVMe only (swappable partitions past the copy).
        optimizer_groups: optimizer sub-groups of the rank.
        optimizer_kept_groups / optimizer_kept_numel: sub-groups (elements) kept in DRAM.
        optimizer_nvme_numel: elements of the sub-groups swapped to NVMe.
        param_read_bytes / param_write_bytes: 16-bit parameter bytes read / written per step.
        optimizer_read_bytes / optimizer_write_bytes: fp32 optimizer bytes read / written per step.
        param_reads: partition reads per step (swap operations, for the per-operation cost).
    """

    param_elem_bytes: int
    param_dram_numel: int = 0
    param_nvme_numel: int = 0
    optimizer_groups: int = 0
    optimizer_kept_groups: int = 0
    optimizer_kept_numel: int = 0
    optimizer_nvme_numel: int = 0
    param_read_bytes: int = 0
    param_write_bytes: int = 0
    optimizer_read_bytes: int = 0
    optimizer_write_bytes: int = 0
    param_reads: int = 0

    @property
    def read_bytes(self) -> int:
        """Bytes read from the swap target per step (parameters and optimizer)."""
        return self.param_read_bytes + self.optimizer_read_bytes

    @property
    def write_bytes(self) -> int:
        """Bytes written to the swap target per step (parameters and optimizer)."""
        return self.param_write_bytes + self.optimizer_write_bytes

    @property
    def nvme_step_bytes(self) -> int:
        """Bytes read plus written per step."""
        return self.read_bytes + self.write_bytes

    @property
    def param_dram_bytes(self) -> int:
        return self.param_dram_numel * self.param_elem_bytes

    @property
    def optimizer_kept_bytes(self) -> int:
        return self.optimizer_kept_numel * OPTIMIZER_DRAM_BYTES_PER_NUMEL

    def to_dict(self) -> dict:
        return {**asdict(self), "read_bytes": self.read_bytes, "write_bytes": self.write_bytes,
                "param_dram_bytes": self.param_dram_bytes, "optimizer_kept_bytes": self.optimizer_kept_bytes}


def prefix_groups(group_numels: list[int], limit_numel: int) -> int:
    """Sub-groups kept from the first while their running total stays within ``limit_numel``."""
    kept = 0
    for total in itertools.accumulate(group_numels):
        if total > limit_numel:
            break
        kept += 1
    return kept


def _swappable(numel: int, elem_bytes: int) -> bool:
    return numel * elem_bytes >= ds_defaults.MIN_SWAPPABLE_BYTES


def _param_traffic(cfg: RunConfig, dims: ModelDims, z: dict, group_numels: list[int], w: int, e: int,
                   settings) -> dict[str, int]:
    """The parameter side of :func:`plan_placement` (elements and bytes per rank)."""
    op = z.get("offload_param", {})
    parts = [math.ceil(n / w) for n in dims.param_numels]
    if op.get("device") != "nvme":
        return {"param_dram_numel": sum(parts) if op.get("device") == "cpu" else 0}
    max_in_cpu = int(op.get("max_in_cpu", ds_defaults.MAX_IN_CPU_NUMEL))
    dram = sum(group_numels[:prefix_groups(group_numels, max_in_cpu)])
    lora = dims.trainable_numels is not None
    offsets = [0, *itertools.accumulate(parts)]
    # The flat copy holds trainable partitions only: with LoRA the frozen base weights live on NVMe.
    nvme = [p for i, p in enumerate(parts) if _swappable(p, e) and (lora or offsets[i] >= dram)]
    pool = getattr(settings, "param_pool_bytes", None) if getattr(settings, "enable_param_pool", False) else None
    reads_numel, reads = _param_reads(cfg, dims, z, parts, nvme, 0 if lora else dram, e, w,
                                      pool if isinstance(pool, int) else None)
    micro = max(1, cfg.train.grad_accum)
    written = 0 if lora else sum(nvme)  # the optimizer step writes the updated trainable partitions
    return {"param_dram_numel": min(dram, sum(parts)), "param_nvme_numel": sum(nvme),
            "param_read_bytes": reads_numel * micro * e, "param_write_bytes": written * e,
            "param_reads": reads * micro}


def _param_reads(cfg: RunConfig, dims: ModelDims, z: dict, parts: list[int], nvme: list[int], dram: int,
                 e: int, w: int, pool_bytes: int | None) -> tuple[int, int]:
    """Elements and partitions one micro step reads of the parameters on NVMe only (``nvme``).

    Stage 3 releases a gathered parameter unless the trace uses it again within
    ``stage3_max_reuse_distance`` elements (``__params_to_release``); memascend's pool reads a
    released partition again at its next use. So each partition is read in forward and again in
    backward, except the last layers the reuse window keeps across the turn
    (:func:`~memascend.plan.shapes.live_window_partitions`; with activation checkpointing a layer's
    recompute runs right before its backward, which finds it still gathered). The vocabulary
    projection has four uses where tied (embedding and ``lm_head`` in forward, ``lm_head`` and
    embedding in backward; two where untied, ``lm_head``'s): it stays between the embedding's and
    ``lm_head``'s use where the decoder layers' elements are under the reuse distance, and from
    ``lm_head``'s forward to its backward only where the pool's byte budget holds every partition
    on NVMe (else the backward's read-ahead takes its room). Measured (swap I/O meter, bf16, the auto
    pool): SmolLM2 4 x 256 with ``max_in_cpu`` 0 reads its layers twice and the tied embedding four
    times, with the first 92 M elements in DRAM its NVMe layers twice; llama-tiny its embedding once.
    """
    reuse = int(z.get("stage3_max_reuse_distance", ds_defaults.MAX_REUSE_DISTANCE_NUMEL))
    window = live_window_partitions(dims, w, cfg.train.activation_checkpointing, reuse, dram, e)
    projection = dims.projection_index if dims.projection_index is not None else (
        0 if dims.tied_embeddings else len(parts) - 1)
    proj = parts[projection]
    offsets = [0, *itertools.accumulate(parts)]
    proj_nvme = _swappable(proj, e) and (dims.trainable_numels is not None or offsets[projection] >= dram)
    layers = window[1:] if proj_nvme and window else window  # the window lists the projection first
    vocab = dims.vocab_size * dims.hidden_size
    layers_numel = dims.total_numel - vocab * (1 if dims.tied_embeddings else 2)
    others = sum(nvme) - (proj if proj_nvme else 0)
    numel = 2 * others - sum(layers)
    count = 2 * (len(nvme) - proj_nvme) - len(layers)
    if proj_nvme:
        pool_holds_all = pool_bytes is not None and sum(nvme) * e <= pool_bytes
        uses, kept = (4, 2 * (layers_numel < reuse)) if dims.tied_embeddings else (2, 0)
        proj_reads = uses - kept - pool_holds_all
        numel += proj_reads * proj
        count += proj_reads
    return max(0, numel), max(0, count)


def plan_placement(cfg: RunConfig, dims: ModelDims, ds_config: dict, settings, world_size: int) -> Placement:
    """The placement of one rank's state and the NVMe bytes of one step (see the module docstring).

    Args:
        cfg: the run (dtype, micro-batch shape, gradient accumulation, activation checkpointing).
        dims: the model's layout.
        ds_config: the resolved DeepSpeed config (``sub_group_size``, ``max_in_cpu``, reuse distance).
        settings: the resolved :class:`~memascend.config.settings.MemAscendSettings` (``None``: stock).
        world_size: ranks the partitions are split over.

    Returns:
        The :class:`Placement` (bytes per rank, one optimizer step of ``grad_accum`` micro steps).
    """
    e = DTYPE_BYTES[cfg.train.dtype]
    w = max(1, world_size)
    z = ds_config.get("zero_optimization", {})
    group_numels = [sum(g) for g in _sub_groups(ds_config, dims.optimizer_numels, w)]
    out = {"param_elem_bytes": e, "optimizer_groups": len(group_numels),
           **_param_traffic(cfg, dims, z, group_numels, w, e, settings)}
    if z.get("offload_optimizer", {}).get("device") == "nvme":
        kept = prefix_groups(group_numels, int(getattr(settings, "optimizer_dram_numel", None) or 0))
        swapped = [n for n in group_numels[kept:] if _swappable(n, FP32_BYTES)]
        streaming = settings is not None and getattr(settings, "enable_grad_streaming", False)
        # each later micro step reads its fp32 gradient region back and writes the sum
        per_numel = OPTIMIZER_NVME_BYTES_PER_NUMEL + (FP32_BYTES * (cfg.train.grad_accum - 1) if streaming else 0)
        if streaming and _gradients_stored_16bit(cfg, settings):  # the gradient file in the 16-bit dtype
            per_numel -= FP32_BYTES - e
        out.update(optimizer_kept_groups=kept, optimizer_kept_numel=sum(group_numels[:kept]),
                   optimizer_nvme_numel=sum(swapped), optimizer_read_bytes=sum(swapped) * per_numel,
                   optimizer_write_bytes=sum(swapped) * per_numel)
    elif z.get("offload_optimizer", {}).get("device") == "cpu":
        out.update(optimizer_kept_groups=len(group_numels), optimizer_kept_numel=sum(group_numels))
    return Placement(**out)


def _gradients_stored_16bit(cfg: RunConfig, settings: object) -> bool:
    """Whether the streamed gradient files are 16-bit (``grad_store.decide``'s conditions the plan
    can see: the setting with the chunk window and the aligned fragment reads, one micro step per
    step, a 16-bit training dtype)."""
    return bool(getattr(settings, "enable_16bit_gradient_swap", False)
                and getattr(settings, "fix_unaligned_gradient_io", False)
                and getattr(settings, "optimizer_chunk_numel", None) is not None
                and getattr(settings, "enable_optimizer_pool", False)
                and cfg.train.grad_accum == 1 and cfg.train.dtype in ("bf16", "fp16"))


def measured_step_bytes(report: dict) -> tuple[int, int] | None:
    """``(read_bytes, write_bytes)`` of a recorded run's median step on its swap target (rank 0's swap
    I/O meter, ``report.json`` ``swap_io.median_step``), ``None`` where the run recorded none."""
    step = (report.get("swap_io") or {}).get("median_step")
    if not step:
        return None
    return int(step["read_bytes"]), int(step["write_bytes"])
