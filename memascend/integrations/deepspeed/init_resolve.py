"""The drop-in's ``"auto"`` sizes, resolved when DeepSpeed builds the engine.

A script that drives DeepSpeed itself (HF Trainer, accelerate, its own loop) calls
:func:`memascend.integrations.deepspeed.apply_from_config` before its model exists, so the settings
that live in DeepSpeed's own config and depend on the model (``optimizer_sub_group_numel``,
``reduce_bucket_numel``, ``param_dram_numel``: ``zero_optimization.sub_group_size``,
``.reduce_bucket_size``, ``.offload_param.max_in_cpu``) cannot be sized then. DeepSpeed 0.19.8
reads those three only in ``deepspeed.initialize`` (the stage-3 optimizer), where the model is at
hand: :func:`make_initialize` wraps ``deepspeed.initialize`` so that, when memascend is applied and
the config holds a ``"memascend"`` section (or the applied settings still say ``"auto"``), the config
is rewritten by :func:`memascend.config.sizing.prepare_ds_config` -- the function
``memascend finetune`` uses -- from the model's real parameter sizes (``ds_numel`` of a ZeRO-3
partitioned parameter) before DeepSpeed reads it.

HF Trainer hands its config to accelerate, which calls ``deepspeed.initialize(model=...,
config_params=<dict>)`` (looked up on the ``deepspeed`` module at call time, so the wrapper is seen);
``config=``, ``config_params=`` and ``args.deepspeed_config`` (a dict or a JSON file path) are all
taken. A config the wrapper cannot read (DeepSpeed's base64 form), or a model without parameters,
is passed on unchanged with one ``memascend: warning: ...`` line on stderr: it never runs with
``"auto"`` silently.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from memascend.config.settings import DS_CONFIG_SECTION, MemAscendSettings
from memascend.config.sizing import MODEL_SIZED_SETTINGS, prepare_ds_config
from memascend.config.user_ds import read_ds_config
from memascend.errors import UserError

__all__ = ["has_auto", "make_initialize", "model_param_numels", "warn"]


def warn(message: str) -> None:
    """Print ``memascend: warning: MESSAGE`` as one line on stderr."""
    print(f"memascend: warning: {message}", file=sys.stderr, flush=True)


def has_auto(settings: MemAscendSettings) -> bool:
    """Whether any of :data:`~memascend.config.sizing.MODEL_SIZED_SETTINGS` is ``"auto"`` in ``settings``."""
    return any(getattr(settings, key) == "auto" for key in MODEL_SIZED_SETTINGS)


def model_param_numels(model: Any, *, trainable_only: bool = False) -> list[int]:
    """Elements of every parameter of ``model`` (a ``torch.nn.Module``), in registration order, tied
    weights once; a ZeRO-3 partitioned parameter counts its full size (``ds_numel``), as
    :func:`memascend.config.render.model_shape` counts a meta-device instance. ``trainable_only``:
    those with ``requires_grad`` (what the optimizer holds; with LoRA, the adapters)."""
    seen: set[int] = set()
    numels = []
    for p in model.parameters():
        if id(p) not in seen and (p.requires_grad or not trainable_only):
            seen.add(id(p))
            numels.append(int(getattr(p, "ds_numel", p.numel())))
    return numels


def _world_size(mpu: Any) -> int:
    """Ranks that partition each parameter: the data-parallel group of ``mpu`` if given, else the
    initialized process group, else ``WORLD_SIZE`` (set by torchrun and the deepspeed launcher)."""
    if mpu is not None and hasattr(mpu, "get_data_parallel_world_size"):
        return int(mpu.get_data_parallel_world_size())
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _given_config(arguments: dict[str, Any]) -> tuple[str | None, Any]:
    """(where the config came from: ``config``, ``config_params`` or ``args``; the config)."""
    for key in ("config", "config_params"):
        if arguments.get(key) is not None:
            return key, arguments[key]
    args = arguments.get("args")
    if getattr(args, "deepspeed_config", None) is not None:
        return "args", args.deepspeed_config
    return None, None


def _read(config: Any) -> dict | None:
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)) and Path(config).is_file():
        return read_ds_config(config)
    return None


def _section_settings(section: Any) -> MemAscendSettings | str | None:
    """The settings a config's ``"memascend"`` section asks for (``None``: no section; ``"bad"``: one
    that does not parse)."""
    if section is None:
        return None
    try:
        return MemAscendSettings.from_mapping(section)
    except UserError:
        return "bad"


def _resolved_arguments(arguments: dict[str, Any], settings: MemAscendSettings,
                        on_resolved: Callable[[MemAscendSettings], None]) -> dict[str, Any]:
    """``arguments`` of ``deepspeed.initialize`` with the config rewritten (unchanged where there is
    nothing to resolve or it cannot be)."""
    source, given = _given_config(arguments)
    if source is None:
        return arguments
    config = _read(given)
    if config is None:
        if has_auto(settings):
            warn(f"cannot read the DeepSpeed config given to deepspeed.initialize ({type(given).__name__}); "
                 "optimizer_sub_group_numel, reduce_bucket_numel and param_dram_numel stay DeepSpeed's defaults "
                 "(pass the config as a dict or a JSON file path)")
        return arguments
    if DS_CONFIG_SECTION not in config and not has_auto(settings):
        return arguments  # memascend finetune's config: already resolved, passed on as it is
    numels = model_param_numels(arguments["model"]) if arguments.get("model") is not None else []
    if not numels:
        warn("deepspeed.initialize got a model without parameters; optimizer_sub_group_numel, "
             "reduce_bucket_numel and param_dram_numel stay DeepSpeed's defaults")
        return arguments
    if _section_settings(config.get(DS_CONFIG_SECTION)) not in (None, settings):
        warn(f'the "{DS_CONFIG_SECTION}" section of the DeepSpeed config differs from the settings applied '
             "(apply_from_config / apply); the applied settings are used")
    if settings.host_memory_budget is not None:
        warn("host_memory_budget is chosen by memascend finetune and memascend plan, which know the sequence "
             "length and activation checkpointing; here it is not applied: run 'memascend plan --deepspeed-config "
             "FILE --host-memory-budget SIZE' (with your run's flags) and put the settings it prints in the section")
    trainable = model_param_numels(arguments["model"], trainable_only=True)
    rewritten, resolved = prepare_ds_config(config, settings, param_numels=numels,
                                            optimizer_numels=trainable or None,
                                            world_size=_world_size(arguments.get("mpu")))
    on_resolved(resolved)
    out = {**arguments, "config": rewritten, "config_params": None}
    if source == "args":
        out["args"] = copy.copy(arguments["args"])
        out["args"].deepspeed_config = None  # DeepSpeed refuses a config given twice
    return out


def make_initialize(original: Callable[..., Any], applied: Callable[[], MemAscendSettings | None],
                    on_resolved: Callable[[MemAscendSettings], None]) -> Callable[..., Any]:
    """A ``deepspeed.initialize`` that resolves the memascend sizes in its config first.

    Args:
        original: DeepSpeed 0.19.8's ``deepspeed.initialize``.
        applied: returns the settings in force (``None``: memascend is not applied; pass through).
        on_resolved: called with the resolved settings before ``original`` runs (the seam patches
            the gradient-norm grouping there when the sub-group size changed).

    Returns:
        The wrapper; its signature and return value are ``original``'s.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        settings = applied()
        if settings is None:
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        return original(**_resolved_arguments(dict(bound.arguments), settings, on_resolved))

    return initialize
