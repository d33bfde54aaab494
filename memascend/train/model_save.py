"""The run's model outputs: the fine-tuned model as a Hugging Face folder ``OUTPUT/model``; for a LoRA
run the adapter in PEFT's format, and with ``--merge-lora`` the merged model.

All come from one consolidated 16-bit state dict gathered from the ZeRO-3 partitions
(:func:`memascend.integrations.deepspeed.engine_state.consolidated_16bit_state_dict`, collective), so
the base weights are read from NVMe once. ``OUTPUT/adapter`` holds ``adapter_config.json`` and
``adapter_model.safetensors`` (``peft.PeftModel.from_pretrained(base, OUTPUT/adapter)`` loads it);
``OUTPUT/model`` holds the base model with every adapter folded into its weight, ``W + (alpha / rank)
* B @ A`` computed in fp32 and stored in the training dtype, as an ordinary Hugging Face folder.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from memascend.config import LoraConfig
from memascend.train.run_log import output_errors

PEFT_PREFIX = "base_model.model."
"""What PEFT's wrapper puts before every name of the base model's state dict."""


def merged_state_dict(state_dict: dict[str, torch.Tensor], scaling: float,
                      adapter: str = "default") -> dict[str, torch.Tensor]:
    """The base model's state dict with each LoRA adapter merged into its layer's weight.

    Args:
        state_dict: the PEFT model's full state dict (``base_model.model.<layer>.base_layer.weight``,
            ``...<layer>.lora_A.<adapter>.weight`` of shape (rank, in), ``...lora_B.<adapter>.weight``
            of shape (out, rank)).
        scaling: ``alpha / rank``.
        adapter: the adapter's name.

    Returns:
        The base model's names (``model.layers.0.self_attn.q_proj.weight``) -> tensors; merged weights
        are new tensors in their weight's dtype, every other tensor is the input's own (tied weights
        stay one tensor).
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if ".lora_" in name:
            continue
        base = name.removeprefix(PEFT_PREFIX)
        if ".base_layer." in base:
            layer = name[: name.index(".base_layer.")]
            base = base.replace(".base_layer.", ".")
            a = state_dict.get(f"{layer}.lora_A.{adapter}.weight")
            b = state_dict.get(f"{layer}.lora_B.{adapter}.weight")
            if a is not None and b is not None and name.endswith(".base_layer.weight"):
                delta = (b.float() @ a.float()) * scaling
                tensor = (tensor.float() + delta).to(tensor.dtype)
        out[base] = tensor
    return out


def save_lora_outputs(peft_model, state_dict: dict[str, torch.Tensor], out_dir: Path, tokenizer, *,
                      merge: bool) -> tuple[Path, Path | None]:
    """Write ``out_dir/adapter`` (PEFT format) and, with ``merge``, ``out_dir/model`` (rank 0 only).

    Args:
        peft_model: the trained ``peft.PeftModel`` (the engine's module; its weights partitioned).
        state_dict: its consolidated state dict (the gathered weights).
        out_dir: the run's output folder.
        tokenizer: saved beside each (its ``save_pretrained(folder)``: a loaded tokenizer, or the
            files one wrote, :class:`memascend.data.prepare.SavedTokenizer`).
        merge: also write the merged model.

    Returns:
        (adapter folder, merged model folder or ``None``).

    Raises:
        OSError: a write failed.
    """
    adapter_dir = out_dir / "adapter"
    peft_model.save_pretrained(adapter_dir, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(adapter_dir)
    if not merge:
        return adapter_dir, None
    cfg = peft_model.peft_config["default"]
    merged = merged_state_dict(state_dict, float(cfg.lora_alpha) / float(cfg.r))
    model_dir = out_dir / "model"
    base = peft_model.get_base_model()
    base.config.use_cache = True
    base.save_pretrained(model_dir, state_dict=merged, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    return adapter_dir, model_dir


def save_model(engine, out_dir: Path, tokenizer, lora: LoraConfig, *, is_rank0: bool) -> tuple[Path, str] | None:
    """Gather the engine's weights (collective: every rank calls it) and, on rank 0, write the model:
    ``out_dir/model`` (a full fine-tune), or ``out_dir/adapter`` and with ``lora.merge`` the merged
    ``out_dir/model`` (:func:`save_lora_outputs`); ``tokenizer.save_pretrained`` writes the tokenizer's
    files beside the model (a loaded tokenizer, or :class:`memascend.data.prepare.SavedTokenizer`).

    Returns:
        On rank 0 (the folder the report names: the model, else the adapter; a line saying what was
        written), ``None`` on other ranks.

    Raises:
        UserError: the output folder could not be written (:func:`memascend.train.run_log.output_errors`).
    """
    from memascend.integrations.deepspeed.engine_state import consolidated_16bit_state_dict

    state_dict = consolidated_16bit_state_dict(engine)
    if not is_rank0:
        return None
    if lora.enabled:
        with output_errors(out_dir, "the LoRA adapter"):
            adapter_dir, merged_dir = save_lora_outputs(engine.module, state_dict, out_dir, tokenizer,
                                                        merge=lora.merge)
        return merged_dir or adapter_dir, f"LoRA adapter saved: {adapter_dir}" + (
            f", merged model: {merged_dir}" if merged_dir else "")
    model_dir = out_dir / "model"
    with contextlib.suppress(AttributeError):
        engine.module.config.use_cache = True
    with output_errors(out_dir, "the model"):
        engine.module.save_pretrained(model_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(model_dir)
    return model_dir, f"model saved: {model_dir}"
