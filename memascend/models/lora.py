"""LoRA adapters through PEFT: the run's :class:`~memascend.config.schema.LoraConfig` as PEFT's, its
checks against the model's modules, and the wrapping of a model built under ZeRO-3.

The adapters are added after the base model was built and partitioned by ``deepspeed.zero.Init``: PEFT
reads a partitioned layer's width from ``in_features``/``out_features`` (and ``ds_shape``), creates the
adapters as ordinary full tensors and initialises them (``lora_A`` Kaiming-uniform from torch's RNG,
``lora_B`` zeros), and ``deepspeed.initialize`` then converts every parameter that is not yet a ZeRO
parameter with the ``Init`` context of the model's first one
(``DeepSpeedZeRoOffload._convert_to_zero_parameters``), so the adapters are partitioned, offloaded and
swapped like the base weights. Creating them inside ``zero.Init`` instead would partition them before
PEFT's initialisation, which would then write into empty tensors (``lora_B`` would keep
``nn.Linear``'s random init, and the adapted model would not start as the base model).
"""

from __future__ import annotations

from memascend.config.schema import LoraConfig
from memascend.errors import UserError

ALL_LINEAR = "all-linear"
"""PEFT's target meaning every linear layer but the output head."""

ADAPTER_NAME = "default"
"""The adapter's name in the PEFT model (PEFT's default: the saved folder holds it at its root)."""


def peft_config(cfg: LoraConfig):
    """PEFT's ``LoraConfig`` for causal-LM adapters of ``cfg`` (which must have a rank)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType

    targets = cfg.target_modules
    target_modules = None if not targets else (ALL_LINEAR if targets == (ALL_LINEAR,) else list(targets))
    return PeftLoraConfig(task_type=TaskType.CAUSAL_LM, r=int(cfg.rank), lora_alpha=cfg.lora_alpha,
                          lora_dropout=float(cfg.dropout), target_modules=target_modules, bias="none")


def _targets_text(cfg: LoraConfig) -> str:
    return ",".join(cfg.target_modules) if cfg.target_modules else "PEFT's default for the architecture"


def apply_lora(model, cfg: LoraConfig, *, origin: str, seed: int | None = None):
    """Wrap ``model`` (a causal LM, on the meta device, on the CPU, or partitioned by ZeRO-3) with LoRA
    adapters of ``cfg``: the base weights frozen (``requires_grad`` false), the adapters trainable, in
    the base layers' dtype (PEFT's ``autocast_adapter_dtype=False``: bf16 adapters in a bf16 run, as
    every parameter of a full fine-tune; DeepSpeed keeps the fp32 master copy).

    Args:
        model: the model; modified in place and returned wrapped.
        cfg: the adapters' settings (``cfg.rank`` set).
        origin: the model as the user named it (in error messages).
        seed: seeds torch's RNG just before the adapters are initialised (the same adapters in every
            engine and rank); ``None``: the RNG as it is.

    Returns:
        The ``peft.PeftModel``.

    Raises:
        UserError: a target module that matches no module of the model, an architecture PEFT has no
            default targets for (give ``--lora-target-modules``), a targeted layer PEFT cannot adapt, or
            a rank above the smaller side of a targeted layer.
    """
    import torch
    from peft import get_peft_model

    if seed is not None:
        torch.manual_seed(seed)
    try:
        wrapped = get_peft_model(model, peft_config(cfg), adapter_name=ADAPTER_NAME, autocast_adapter_dtype=False)
    except ValueError as exc:
        text = " ".join(str(exc).split())
        if "not found in the base model" in text or "target_modules" in text or "Target module" in text:
            raise UserError(f"--lora-target-modules {_targets_text(cfg)}: no such module in {origin} "
                            f"({text[:300]}); give names of its linear layers, e.g. q_proj,v_proj, or "
                            "all-linear") from None
        raise UserError(f"--lora-rank: PEFT cannot add LoRA adapters to {origin}: {text[:300]}") from None
    check_rank(wrapped, cfg, origin)
    return wrapped



def adapted_layers(model) -> dict[str, tuple[int, int]]:
    """Every layer that carries a LoRA adapter in the PEFT model ``model``: name -> (input width,
    output width) of its base layer, in module order."""
    from peft.tuners.lora import LoraLayer

    return {name.removeprefix("base_model.model."): (int(mod.in_features), int(mod.out_features))
            for name, mod in model.named_modules() if isinstance(mod, LoraLayer)}


def check_rank(model, cfg: LoraConfig, origin: str) -> None:
    """Refuse a rank above the smaller side of a targeted layer (the adapter would not be low-rank).

    Raises:
        UserError: naming the layer and its widths.
    """
    for name, (width_in, width_out) in adapted_layers(model).items():
        if cfg.rank > min(width_in, width_out):
            raise UserError(f"--lora-rank {cfg.rank} is above the width of {name} in {origin} "
                            f"({width_in} -> {width_out}): give a rank of at most {min(width_in, width_out)}")


def trainable_numels(model) -> tuple[int, ...]:
    """Element counts of the parameters that require a gradient, in registration order (tied once)."""
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            out.append(int(getattr(p, "ds_numel", p.numel())))
    return tuple(out)
