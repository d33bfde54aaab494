"""One resolver: a :class:`RunConfig`, the model's shape and the rank count -> everything a run derives.

:func:`resolve` is the one place that renders a run's DeepSpeed JSON: the stock config of the run
(:func:`render_ds_config`: the user's JSON as the base, memascend's run settings, and the stock
settings that would crash on this model, each recorded as :class:`Derived`), then for
``--engine memascend`` the memascend settings that live in DeepSpeed's own config, sized from the
model by :func:`memascend.config.sizing.prepare_ds_config` (the seam's public API
for scripts that drive DeepSpeed themselves; the same code). It also makes the run's two estimates
that are checked before DeepSpeed starts: NVMe space (:func:`nvme_space_bytes`) and up-front locked
memory (:func:`upfront_locked_bytes`). ``memascend finetune``, ``memascend plan``, the preflight
checks and ``memascend doctor`` all use these.

The baseline keeps DeepSpeed 0.19.8's own defaults (:mod:`memascend.config.ds_defaults`) except where a
default would crash on the model at hand. Two stock failures are avoided:

- "More elements N than buffer size" (DeepSpeed #3506): every parameter swap buffer must hold the
  largest parameter partition (``offload_param.buffer_size``, in elements, default 1e8).
- "Not enough buffers 0 for swapping K" (DeepSpeed #3062): ``offload_param.buffer_count`` (default
  5) must cover the parameters a module fetches at once plus the prefetched ones; with frozen parameters
  (LoRA) stock's NVMe prefetch and its reuse distance keep buffers they never release, so the baseline
  runs with both off, memascend without the reuse distance (:func:`_derive_frozen_params`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from memascend.config import ds_defaults
from memascend.config.schema import RunConfig
from memascend.config.settings import MemAscendSettings
from memascend.config.sizing import prepare_ds_config
from memascend.config.user_ds import check_train_batch_size
from memascend.errors import UserError
from memascend.units import DTYPE_BYTES, FP32_BYTES

__all__ = [
    "Derived",
    "ModelShape",
    "ResolvedRun",
    "applied_settings",
    "derived_as_dicts",
    "model_shape",
    "nvme_space_bytes",
    "nvme_swap_bytes",
    "per_rank_param_numel",
    "render_ds_config",
    "resolve",
    "upfront_locked_bytes",
]

AIO_ALIGN_NUMEL = 1024  # swap buffers are rounded to whole 4 KiB+ I/O units; keep headroom


@dataclass(frozen=True)
class ModelShape:
    """Parameter layout of a model, known before it is built (from a meta-device instance).

    Attributes:
        total_numel: all parameters (tied weights once).
        param_numels: element count of every parameter, in module registration order.
        module_param_counts: per module, its direct (non-recursive) parameters that ZeRO-3
            fetches together.
        trainable_numels: element count of every parameter the optimizer holds, in registration
            order (``None``: every parameter; with LoRA, the adapters only).
    """

    total_numel: int
    param_numels: tuple[int, ...]
    module_param_counts: tuple[int, ...]
    trainable_numels: tuple[int, ...] | None = None

    @property
    def optimizer_numels(self) -> tuple[int, ...]:
        """Element counts of the parameters the optimizer holds (every parameter but frozen ones)."""
        return self.param_numels if self.trainable_numels is None else self.trainable_numels

    @property
    def trainable_numel(self) -> int:
        """Elements the optimizer holds (fp32 master, Adam moments, gradients): all but frozen ones."""
        return self.total_numel if self.trainable_numels is None else sum(self.trainable_numels)

    @property
    def largest_numel(self) -> int:
        return max(self.param_numels) if self.param_numels else 0


@dataclass(frozen=True)
class Derived:
    """A DeepSpeed setting memascend changed from the stock default, and why."""

    key: str
    value: Any
    stock_value: Any
    reason: str


def model_shape(model) -> ModelShape:
    """Shape summary of an (ideally meta-device) ``torch.nn.Module``: parameters in registration
    order, tied weights once; per module its direct parameters (frozen ones too: ZeRO-3 fetches them
    alike); the trainable ones apart when some are frozen (LoRA)."""
    seen: set[int] = set()
    numels, trainable = [], []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            numels.append(p.numel())
            if p.requires_grad:
                trainable.append(p.numel())
    counts = []
    for mod in model.modules():
        direct = list(mod.parameters(recurse=False))
        if direct:
            counts.append(len(direct))
    return ModelShape(total_numel=sum(numels), param_numels=tuple(numels), module_param_counts=tuple(counts),
                      trainable_numels=None if len(trainable) == len(numels) else tuple(trainable))




def _setdefault_path(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
    if d.get(keys[-1], "auto") == "auto":
        d[keys[-1]] = value


def _get_path(d: dict, dotted: str, default: Any = None) -> Any:
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def render_ds_config(cfg: RunConfig, shape: ModelShape, world_size: int, swap_dir: str | None = None,
                     user: dict | None = None) -> tuple[dict, list[Derived]]:
    """The stock DeepSpeed config dict of this run and the list of derived (non-stock) settings.

    The user's JSON (``user``, default ``cfg.user_ds_config``) is the base: its explicit values win,
    memascend fills in the rest (values ``"auto"`` count as unset). ``swap_dir`` is this run's
    private folder for swap files (``None``: not known yet). The memascend settings that live in
    DeepSpeed's config are not applied here (:func:`resolve` does that).

    Raises:
        UserError: settings that contradict each other (e.g. fp16 and bf16 both enabled).
    """
    t, off = cfg.train, cfg.offload
    user = cfg.user_ds_config if user is None else user
    ds: dict = copy.deepcopy(user) if user else {}
    ds.pop("memascend", None)  # our own section is read by the integration seam, not by DeepSpeed
    _setdefault_path(ds, "train_micro_batch_size_per_gpu", t.micro_batch)
    _setdefault_path(ds, "gradient_accumulation_steps", t.grad_accum)
    ds.pop("train_batch_size", None) if ds.get("train_batch_size") == "auto" else None
    check_train_batch_size(ds, cfg.deepspeed_config or "(the DeepSpeed config)", ds["train_micro_batch_size_per_gpu"],
                           ds["gradient_accumulation_steps"], world_size)
    _setdefault_path(ds, "gradient_clipping", t.gradient_clipping)
    _setdefault_path(ds, "steps_per_print", 1 << 30)
    _setdefault_path(ds, "wall_clock_breakdown", False)
    _setdefault_path(ds, "bf16.enabled", t.dtype == "bf16")
    _setdefault_path(ds, "fp16.enabled", t.dtype == "fp16")
    if t.dtype == "fp16":
        _setdefault_path(ds, "fp16.loss_scale", 0)  # 0 = dynamic loss scaling
    if _get_path(ds, "bf16.enabled") and _get_path(ds, "fp16.enabled"):
        raise UserError("DeepSpeed config enables both bf16 and fp16")
    if "optimizer" not in ds:
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": t.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": t.weight_decay},
        }
    else:
        for k, v in (("lr", t.lr), ("weight_decay", t.weight_decay)):
            _setdefault_path(ds, f"optimizer.params.{k}", v)
    # No "scheduler" section from memascend: --warmup-steps / --lr-scheduler are Hugging Face's
    # schedules, given to deepspeed.initialize as a LambdaLR (memascend.train.schedule); a user's
    # "scheduler" stays, and is refused together with a schedule from the flags.
    z = ds.setdefault("zero_optimization", {})
    if z.get("stage", 3) != 3:
        raise UserError(f"memascend runs ZeRO stage 3; the DeepSpeed config sets stage {z['stage']}")
    z["stage"] = 3
    for part, target in (("offload_param", off.param), ("offload_optimizer", off.optimizer)):
        sect = z.setdefault(part, {})
        _setdefault_path(sect, "device", target)
        if sect["device"] == "nvme":
            sect["nvme_path"] = swap_dir
        if sect["device"] != "none":
            _setdefault_path(sect, "pin_memory", True)

    derived: list[Derived] = []
    if _get_path(z, "offload_param.device") == "nvme":
        derived += _derive_param_buffers(z, shape, world_size)
        derived += _derive_frozen_params(z, shape, stock=cfg.engine == "baseline")
        if cfg.engine == "baseline":
            derived += _derive_stock_max_in_cpu(z, shape, world_size)
    return ds, derived


def _derive_frozen_params(z: dict, shape: ModelShape, *, stock: bool) -> list[Derived]:
    """With frozen parameters (LoRA): ``stage3_max_reuse_distance`` 0 for both engines and, for stock,
    ``stage3_prefetch_bucket_size`` 0, where the user left them out.

    With frozen base weights stock 0.19.8 runs out of parameter swap buffers in its second or third
    step ("Not enough buffers 0 for swapping 1", ``partitioned_param_swapper.swap_in``): once its
    module trace is complete, (1) a parameter used again within ``stage3_max_reuse_distance``
    elements (default 1e9: all of a small model) is not released after its module's forward
    (``__params_to_release``): the frozen layers whose weights the backward pass uses again, and a
    tied embedding, stay gathered, each partition holding a swap buffer; (2) the NVMe prefetch
    (``PartitionedParameterCoordinator.__prefetch_nvme_param_partitions``) swaps in partitions ahead
    along the trace that the step then does not gather in that order. Measured on the CPU: either
    setting alone still fails, both together run. memascend's pool does not fail but grows by the same
    partitions (SmolLM2, rank 16 on every linear layer: 216 MB locked instead of 61 MB), so both
    engines release after use; memascend keeps its prefetch (its pool releases what it reads ahead).
    Neither setting changes the math (they decide when partitions are read and released).
    """
    if shape.trainable_numels is None:
        return []
    settings = [("stage3_max_reuse_distance", ds_defaults.MAX_REUSE_DISTANCE_NUMEL,
                 "partitions reused within the distance stay gathered, holding their swap buffers")]
    if stock:
        settings.append(("stage3_prefetch_bucket_size", ds_defaults.PREFETCH_BUCKET_NUMEL,
                         "its NVMe prefetch swaps in partitions the step then does not gather"))
    out = []
    for key, default, why in settings:
        if key not in z:
            z[key] = 0
            out.append(Derived(f"zero_optimization.{key}", 0, default,
                               f"frozen parameters (LoRA): {why} (stock fails in step 2 or 3: 'Not enough "
                               "buffers 0 for swapping 1')"))
    return out


def per_rank_param_numel(param_numels: Iterable[int], world_size: int) -> int:
    """Parameter elements one rank holds: every parameter partitioned over ``world_size`` ranks
    (``ceil(numel / world_size)`` each, as ZeRO-3's ``partition_numel``)."""
    return sum(math.ceil(int(n) / world_size) for n in param_numels)


def _derive_stock_max_in_cpu(z: dict, shape: ModelShape, world_size: int) -> list[Derived]:
    """Stock only: ``offload_param.max_in_cpu`` covering the model when the user left it out.

    Stock 0.19.8 crashes in step 2 once some parameters lie past ``max_in_cpu`` (see
    :func:`memascend.train.preflight.check_stock_param_dram`); the default 1e9 is below every model of
    more than 1e9 parameters per rank. memascend's engine is left as is: its pool never runs out,
    and its ``param_dram_numel="auto"`` decides the DRAM copy
    (:func:`memascend.config.sizing.auto_param_dram_numel`).
    """
    op = z["offload_param"]
    per_rank_numel = per_rank_param_numel(shape.param_numels, world_size)
    if "max_in_cpu" in op or per_rank_numel <= ds_defaults.MAX_IN_CPU_NUMEL:
        return []
    op["max_in_cpu"] = per_rank_numel
    return [Derived("zero_optimization.offload_param.max_in_cpu", per_rank_numel, ds_defaults.MAX_IN_CPU_NUMEL,
                    f"{per_rank_numel} parameter elements per rank > max_in_cpu {ds_defaults.MAX_IN_CPU_NUMEL} "
                    "(stock would fail in step 2: 'Not enough swap in buffers')")]


def _derive_param_buffers(z: dict, shape: ModelShape, world_size: int) -> list[Derived]:
    """Fix the two stock param-swapper settings that would crash on this model (module docstring)."""
    out: list[Derived] = []
    op = z["offload_param"]
    largest_partition = math.ceil(shape.largest_numel / world_size)
    size = op.get("buffer_size", ds_defaults.PARAM_BUFFER_SIZE_NUMEL)
    if largest_partition > size:
        new = math.ceil(largest_partition / AIO_ALIGN_NUMEL) * AIO_ALIGN_NUMEL
        op["buffer_size"] = new
        out.append(
            Derived(
                "zero_optimization.offload_param.buffer_size",
                new,
                size,
                f"largest parameter partition has {largest_partition} elements > buffer size {size} "
                "(stock would fail: 'More elements than buffer size', DeepSpeed #3506)",
            )
        )
    # A module's direct parameters are swapped in together; the prefetcher may have as many again
    # in flight; one more slot covers the parameter being released while the next is fetched.
    most_per_module = max(shape.module_param_counts, default=1)
    need = 2 * most_per_module + 1
    count = op.get("buffer_count", ds_defaults.PARAM_BUFFER_COUNT)
    if count < need:
        op["buffer_count"] = need
        out.append(
            Derived(
                "zero_optimization.offload_param.buffer_count",
                need,
                count,
                f"a module fetches up to {most_per_module} parameters at once, plus as many prefetched "
                f"(stock {count} would fail: 'Not enough buffers', DeepSpeed #3062)",
            )
        )
    return out


def derived_as_dicts(derived: Iterable[Derived]) -> list[dict]:
    """Derived settings as ``report.json`` records them (``key``, ``value``, ``stock_value``, ``reason``)."""
    return [asdict(d) for d in derived]


# ---- estimates checked before DeepSpeed starts ----------------------------------------------------

OPTIMIZER_NVME_BYTES_PER_PARAM = 4 * FP32_BYTES
"""Bytes per parameter the optimizer swapper writes with Adam: the fp32 master copy, two moments and
the fp32 gradient."""
NVME_SPACE_MARGIN = 1.10
"""Factor on :func:`nvme_swap_bytes` for the space a run requires before it starts."""


def nvme_swap_bytes(total_numel: int, param_bytes: int, param_on_nvme: bool, optimizer_on_nvme: bool,
                    trainable_numel: int | None = None) -> int:
    """Bytes a run writes to its swap target, all ranks together (the prediction, no margin).

    Args:
        total_numel: model parameters (tied weights once).
        param_bytes: bytes per element of the training dtype (2 for bf16/fp16, 4 for fp32).
        param_on_nvme: whether ``offload_param`` goes to NVMe (the 16-bit parameters).
        optimizer_on_nvme: whether ``offload_optimizer`` goes to NVMe
            (:data:`OPTIMIZER_NVME_BYTES_PER_PARAM` per parameter the optimizer holds).
        trainable_numel: parameters the optimizer holds (``None``: all; with LoRA, the adapters).
    """
    opt_numel = total_numel if trainable_numel is None else trainable_numel
    return total_numel * (param_bytes if param_on_nvme else 0) + \
        opt_numel * (OPTIMIZER_NVME_BYTES_PER_PARAM if optimizer_on_nvme else 0)


def nvme_space_bytes(total_numel: int, param_bytes: int, param_on_nvme: bool, optimizer_on_nvme: bool,
                     trainable_numel: int | None = None) -> int:
    """NVMe space a run requires, all ranks together: :func:`nvme_swap_bytes` times
    :data:`NVME_SPACE_MARGIN` (an upper estimate; same arguments)."""
    return int(nvme_swap_bytes(total_numel, param_bytes, param_on_nvme, optimizer_on_nvme, trainable_numel)
               * NVME_SPACE_MARGIN)


def upfront_locked_bytes(ds_cfg: dict, dtype: str, largest_param_numel: int, world_size: int, engine: str) -> int:
    """Bytes one rank's swappers lock before the first step completes (a lower bound of its locking).

    Stock ``AsyncPartitionedParameterSwapper`` pins ``buffer_count x buffer_size`` elements at
    construction (zero when parameters are not offloaded to NVMe). memascend's pool holds at least
    one slot of the largest partition, and with the optimizer state on NVMe its on-demand manager
    locks Adam's ``states + 1`` = 4 fp32 buffers of the largest partition in the first step (the
    ``"auto"`` sub-group size).

    Args:
        ds_cfg: the DeepSpeed config the engine runs with.
        dtype: ``bf16``, ``fp16`` or ``fp32``.
        largest_param_numel: elements of the model's largest parameter.
        world_size: ranks partitioning each parameter.
        engine: ``baseline`` or ``memascend``.
    """
    zero = ds_cfg.get("zero_optimization", {})
    op = zero.get("offload_param", {})
    elt = DTYPE_BYTES[dtype]
    partition_numel = math.ceil(largest_param_numel / world_size)
    if engine == "memascend":
        params = partition_numel * elt if op.get("device") == "nvme" else 0
        optimizer = 4 * partition_numel * 4 if zero.get("offload_optimizer", {}).get("device") == "nvme" else 0
        return params + optimizer
    if op.get("device") != "nvme":
        return 0
    count = int(op.get("buffer_count", ds_defaults.PARAM_BUFFER_COUNT))
    size = int(op.get("buffer_size", ds_defaults.PARAM_BUFFER_SIZE_NUMEL))
    return count * size * elt


# ---- the resolver ---------------------------------------------------------------------------------


def applied_settings(requested: MemAscendSettings) -> MemAscendSettings:
    """What ``--engine baseline`` applies: stock ZeRO-Infinity (every optimization off, DeepSpeed's
    config as given) plus the correctness fixes (``fix_*``) as ``requested`` has them (``false``
    in a ``"memascend"`` section reproduces stock DeepSpeed exactly)."""
    fixes = {f.name: getattr(requested, f.name) for f in dataclasses.fields(requested) if f.name.startswith("fix_")}
    return dataclasses.replace(MemAscendSettings.baseline(), **fixes)


@dataclass(frozen=True)
class ResolvedRun:
    """What one run derives from its configuration, model shape and rank count (:func:`resolve`).

    Attributes:
        ds_config: the DeepSpeed config dict for ``deepspeed.initialize`` (``offload_*.nvme_path``
            is the swap folder, ``None`` until :meth:`with_swap_dir`).
        derived: the DeepSpeed settings memascend changed from the stock defaults, and why.
        settings: what :func:`memascend.integrations.deepspeed.apply` gets: for memascend the
            requested settings with ``"auto"`` resolved; for the baseline :func:`applied_settings`.
        user_ds_config: the user's ``--deepspeed-config`` as read (``None`` without one).
        micro_batch: sequences per micro-batch per rank (``train_micro_batch_size_per_gpu``).
        grad_accum: micro-batches per optimizer step (``gradient_accumulation_steps``).
        nvme_bytes_per_rank: NVMe space one rank's swap target requires, bytes
            (:func:`nvme_space_bytes` of the offload targets, divided over the ranks; 0 without NVMe).
        upfront_locked_bytes: bytes one rank locks before its first step completes
            (:func:`upfront_locked_bytes` of :attr:`ds_config`).
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
        """This run with ``swap_dir`` as the ``nvme_path`` of every section offloaded to NVMe
        (the swap folder exists only after :attr:`nvme_bytes_per_rank` was checked)."""
        ds = copy.deepcopy(self.ds_config)
        for part in ("offload_param", "offload_optimizer"):
            sect = ds.get("zero_optimization", {}).get(part)
            if isinstance(sect, dict) and sect.get("device") == "nvme":
                sect["nvme_path"] = swap_dir
        return dataclasses.replace(self, ds_config=ds)

    def derived_dicts(self) -> list[dict]:
        """:attr:`derived` as ``report.json`` records it."""
        return derived_as_dicts(self.derived)


def resolve(cfg: RunConfig, shape: ModelShape, world_size: int, swap_dir: str | None = None) -> ResolvedRun:
    """Resolve one run: its DeepSpeed JSON, derived settings, seam settings and estimates.

    Args:
        cfg: the run's configuration (its ``user_ds_config`` and ``memascend`` settings included).
        shape: the model's parameter layout (:func:`model_shape` of a meta-device instance).
        world_size: ranks of the run.
        swap_dir: the run's private swap folder, or ``None`` (fill it in with
            :meth:`ResolvedRun.with_swap_dir` once it exists).

    Raises:
        UserError: settings that contradict each other (ZeRO stage other than 3, fp16 and bf16).
    """
    ds_cfg, derived = render_ds_config(cfg, shape, world_size, swap_dir)
    if cfg.engine == "memascend":
        ds_cfg, settings = prepare_ds_config(ds_cfg, cfg.memascend, param_numels=shape.param_numels,
                                             optimizer_numels=shape.optimizer_numels, world_size=world_size)
    else:
        settings = applied_settings(cfg.memascend)
    off = cfg.offload
    nvme = nvme_space_bytes(shape.total_numel, DTYPE_BYTES[cfg.train.dtype], off.param == "nvme",
                            off.optimizer == "nvme", shape.trainable_numel)
    return ResolvedRun(
        ds_config=ds_cfg,
        derived=tuple(derived),
        settings=settings,
        user_ds_config=cfg.user_ds_config,
        micro_batch=int(ds_cfg["train_micro_batch_size_per_gpu"]),
        grad_accum=int(ds_cfg["gradient_accumulation_steps"]),
        nvme_bytes_per_rank=nvme // world_size,
        upfront_locked_bytes=upfront_locked_bytes(ds_cfg, cfg.train.dtype, shape.largest_numel, world_size,
                                                  cfg.engine),
    )
