"""One resolver: a :class:`RunConfig`, the model's shape and the rank count -> everything a run derives.

:func:`resolve` renders the DeepSpeed JSON of the run, applies the memascend settings that live in
DeepSpeed's own config (model-dependent ``"auto"`` sizes), and computes the run's NVMe space and
up-front locked-memory estimates. The recipe, the planner and the preflight checks all call it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from memascend.config import RunConfig
from memascend.integrations.deepspeed.settings import DS_CONFIG_SECTION, MemAscendSettings
from memascend.integrations.deepspeed.sizing import prepare_ds_config
from memascend.train.ds_config import (
    Derived,
    ModelShape,
    derived_as_dicts,
    load_user_ds_config,
    render_ds_config,
)
from memascend.train.preflight import upfront_locked_bytes
from memascend.train.swapdir import estimate_nvme_bytes
from memascend.units import DTYPE_BYTES


@dataclass(frozen=True)
class ResolvedRun:
    """What one run derives from its configuration, model shape and rank count.

    Attributes:
        ds_config: the DeepSpeed config dict for ``deepspeed.initialize`` (``offload_*.nvme_path``
            is the swap folder, or ``None`` until :meth:`with_swap_dir`).
        derived: the DeepSpeed settings memascend changed from the stock defaults, and why.
        settings: what :func:`memascend.integrations.deepspeed.apply` gets (``--engine baseline``:
            every optimization off, the correctness fixes as the ``"memascend"`` section says).
        user_ds_config: the user's ``--deepspeed-config`` as read (``None`` without one).
        micro_batch: sequences per micro-batch per rank (``train_micro_batch_size_per_gpu``).
        grad_accum: micro-batches per optimizer step (``gradient_accumulation_steps``).
        nvme_bytes_per_rank: NVMe space one rank's swap target needs, bytes (with a margin).
        upfront_locked_bytes: bytes the swappers lock before the first step completes, per rank.
    """

    ds_config: dict
    derived: tuple[Derived, ...]
    settings: MemAscendSettings
    user_ds_config: dict | None
    micro_batch: int
    grad_accum: int
    nvme_bytes_per_rank: int
    upfront_locked_bytes: int

    def with_swap_dir(self, swap_dir: str | None) -> ResolvedRun:
        """This run with ``swap_dir`` as the ``nvme_path`` of every section offloaded to NVMe."""
        ds = copy.deepcopy(self.ds_config)
        zero = ds.get("zero_optimization", {})
        for part in ("offload_param", "offload_optimizer"):
            sect = zero.get(part)
            if isinstance(sect, dict) and sect.get("device") == "nvme":
                sect["nvme_path"] = swap_dir
        return dataclasses.replace(self, ds_config=ds)

    def derived_dicts(self) -> list[dict]:
        """:attr:`derived` as ``report.json`` records it."""
        return derived_as_dicts(list(self.derived))


def resolve(cfg: RunConfig, shape: ModelShape, world_size: int, swap_dir: str | None = None) -> ResolvedRun:
    """Resolve one run: its DeepSpeed JSON, derived settings, seam settings and estimates.

    Args:
        cfg: the run's configuration.
        shape: the model's parameter layout (:func:`memascend.train.ds_config.model_shape`).
        world_size: ranks of the run.
        swap_dir: the run's private swap folder, or ``None`` (fill it in with
            :meth:`ResolvedRun.with_swap_dir` once it exists).

    Raises:
        UserError: an unreadable ``--deepspeed-config``, a bad ``"memascend"`` section or settings
            that contradict each other.
    """
    user = load_user_ds_config(cfg.deepspeed_config) if cfg.deepspeed_config else None
    ds_cfg, derived = render_ds_config(cfg, shape, world_size, swap_dir, user)
    settings = MemAscendSettings.from_mapping((user or {}).get(DS_CONFIG_SECTION, {}))
    if cfg.engine == "memascend":
        ds_cfg, settings = prepare_ds_config(ds_cfg, settings, param_numels=shape.param_numels,
                                             world_size=world_size)
    else:
        fixes = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name.startswith("fix_")}
        settings = dataclasses.replace(MemAscendSettings.baseline(), **fixes)
    nvme = estimate_nvme_bytes(shape.total_numel, DTYPE_BYTES[cfg.train.dtype],
                               cfg.offload.param == "nvme", cfg.offload.optimizer == "nvme")
    return ResolvedRun(
        ds_config=ds_cfg,
        derived=tuple(derived),
        settings=settings,
        user_ds_config=user,
        micro_batch=int(ds_cfg["train_micro_batch_size_per_gpu"]),
        grad_accum=int(ds_cfg["gradient_accumulation_steps"]),
        nvme_bytes_per_rank=nvme // world_size,
        upfront_locked_bytes=upfront_locked_bytes(ds_cfg, cfg.train.dtype, shape.largest_numel, world_size,
                                                  cfg.engine),
    )
