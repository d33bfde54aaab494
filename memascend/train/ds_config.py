"""Render the DeepSpeed JSON of a run from its :class:`RunConfig` (single source of truth).

The baseline keeps DeepSpeed 0.19.8's own defaults except where a default would crash on the model
at hand; every such change is recorded as a :class:`Derived` entry (key, value, stock value, why)
that goes into ``report.json``. Two stock failures are avoided:

- "More elements N than buffer size" (DeepSpeed #3506): every parameter swap buffer must hold the
  largest parameter partition (``offload_param.buffer_size``, in elements, default 1e8).
- "Not enough buffers 0 for swapping K" (DeepSpeed #3062): ``offload_param.buffer_count`` (default
  5) must cover the parameters a module fetches at once plus the prefetched ones.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memascend.config import RunConfig
from memascend.errors import UserError

# DeepSpeed 0.19.8 defaults (deepspeed/runtime/zero/offload_config.py, zero/config.py).
DS_DEFAULT_PARAM_BUFFER_COUNT = 5
DS_DEFAULT_PARAM_BUFFER_SIZE_NUMEL = 100_000_000
DS_DEFAULT_PREFETCH_BUCKET_NUMEL = 50_000_000
DS_DEFAULT_PERSISTENCE_THRESHOLD_NUMEL = 100_000
DS_DEFAULT_MAX_IN_CPU_NUMEL = 1_000_000_000
AIO_ALIGN_NUMEL = 1024  # swap buffers are rounded to whole 4 KiB+ I/O units; keep headroom


@dataclass(frozen=True)
class ModelShape:
    """Parameter layout of a model, known before it is built (from a meta-device instance).

    Attributes:
        total_numel: all parameters (tied weights once).
        param_numels: element count of every parameter, in module registration order.
        module_param_counts: per module, its direct (non-recursive) trainable parameters that
            ZeRO-3 fetches together.
    """

    total_numel: int
    param_numels: tuple[int, ...]
    module_param_counts: tuple[int, ...]

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
    """Shape summary of an (ideally meta-device) ``torch.nn.Module``."""
    seen: set[int] = set()
    numels = []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            numels.append(p.numel())
    counts = []
    for mod in model.modules():
        direct = [p for p in mod.parameters(recurse=False) if p.requires_grad]
        if direct:
            counts.append(len(direct))
    return ModelShape(total_numel=sum(numels), param_numels=tuple(numels), module_param_counts=tuple(counts))


def load_user_ds_config(path: str) -> dict:
    """Read ``--deepspeed-config``: a JSON object (DeepSpeed's config dict).

    Raises:
        UserError: missing/unreadable file, invalid JSON or UTF-8, ``NaN``/``Infinity`` anywhere in
            it, or a document that is not an object (``[1, 2, 3]``), or a ``"memascend"`` section
            that is not an object.
    """

    def refuse_constant(name: str):
        raise UserError(f"DeepSpeed config {path} holds {name}: every number must be finite")

    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"), parse_constant=refuse_constant)
    except FileNotFoundError:
        raise UserError(f"DeepSpeed config not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"DeepSpeed config {path} is not valid JSON: line {exc.lineno}: {exc.msg}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"DeepSpeed config {path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"cannot read DeepSpeed config {path}: {exc.strerror}") from None
    if not isinstance(doc, dict):
        raise UserError(f"DeepSpeed config {path} must be a JSON object ({{...}}), got a {type(doc).__name__}")
    if not isinstance(doc.get("memascend", {}), dict):
        raise UserError(f"DeepSpeed config {path}: its \"memascend\" section must be a JSON object")
    return doc


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


def render_ds_config(
    cfg: RunConfig, shape: ModelShape, world_size: int, swap_dir: str | None, user: dict | None = None
) -> tuple[dict, list[Derived]]:
    """The DeepSpeed config dict for this run and the list of derived (non-stock) settings.

    A user's JSON (``user``) is the base: its explicit values win, memascend fills in the rest
    (values ``"auto"`` count as unset). ``swap_dir`` is this run's private folder for swap files.

    Raises:
        UserError: settings that contradict each other (e.g. fp16 and bf16 both enabled).
    """
    t, off = cfg.train, cfg.offload
    ds: dict = copy.deepcopy(user) if user else {}
    ds.pop("memascend", None)  # our own section is read by the integration seam, not by DeepSpeed
    _setdefault_path(ds, "train_micro_batch_size_per_gpu", t.micro_batch)
    _setdefault_path(ds, "gradient_accumulation_steps", t.grad_accum)
    ds.pop("train_batch_size", None) if ds.get("train_batch_size") == "auto" else None
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
    if t.warmup_steps and "scheduler" not in ds:
        ds["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": t.lr, "warmup_num_steps": t.warmup_steps},
        }
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
        if cfg.engine == "baseline":
            derived += _derive_stock_max_in_cpu(z, shape, world_size)
    return ds, derived


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
    (:func:`memascend.integrations.deepspeed.sizing.auto_param_dram_numel`).
    """
    op = z["offload_param"]
    per_rank_numel = per_rank_param_numel(shape.param_numels, world_size)
    if "max_in_cpu" in op or per_rank_numel <= DS_DEFAULT_MAX_IN_CPU_NUMEL:
        return []
    op["max_in_cpu"] = per_rank_numel
    return [Derived("zero_optimization.offload_param.max_in_cpu", per_rank_numel, DS_DEFAULT_MAX_IN_CPU_NUMEL,
                    f"{per_rank_numel} parameter elements per rank > max_in_cpu {DS_DEFAULT_MAX_IN_CPU_NUMEL} "
                    "(stock would fail in step 2: 'Not enough swap in buffers')")]


def _derive_param_buffers(z: dict, shape: ModelShape, world_size: int) -> list[Derived]:
    """Fix the two stock param-swapper settings that would crash on this model (module docstring)."""
    out: list[Derived] = []
    op = z["offload_param"]
    largest_partition = math.ceil(shape.largest_numel / world_size)
    size = op.get("buffer_size", DS_DEFAULT_PARAM_BUFFER_SIZE_NUMEL)
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
    count = op.get("buffer_count", DS_DEFAULT_PARAM_BUFFER_COUNT)
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


def derived_as_dicts(derived: list[Derived]) -> list[dict]:
    return [asdict(d) for d in derived]
