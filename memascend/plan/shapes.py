"""What the planner knows about the model: its parameter layout (a meta-device instance), the
partitions the parameter pool keeps live, the activations of one micro-batch and the corpus size."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from memascend.config import RunConfig, ds_defaults
from memascend.plan.calibration import BUILTIN_CORPUS_TOKENS, LOGITS_FP32_TENSORS
from memascend.units import FP32_BYTES as _FP32


@dataclass(frozen=True)
class ModelDims:
    """What the planner needs to know about the model.

    Attributes:
        total_numel: parameters (tied weights once).
        param_numels: every parameter's element count, in registration order.
        module_param_counts: per module, its direct trainable parameters.
        hidden_size / num_layers / num_heads / vocab_size: architecture (activation estimate).
        intermediate_size: MLP width (``None``: ``4 * hidden_size``).
        kv_size: width of the key (and of the value) projection, ``num_key_value_heads * head_dim``
            (``None``: ``hidden_size``, no grouped-query attention).
        tied_embeddings: whether the output projection shares the input embedding's weight
            (``False``: ``lm_head`` is its own parameter, registered last).
        layer_start / layer_param_count: index in ``param_numels`` of the first decoder layer's
            first parameter, and the parameters of one layer (``None``: not known, the Llama layout
            is assumed: the embedding, then the layers).
        projection_index: index in ``param_numels`` of the vocabulary projection's weight (the
            embedding where tied; ``None``: not known, the last parameter where untied).
        trainable_numels: the parameters the optimizer holds, in registration order (``None``: every
            parameter; with LoRA the adapters, which ``param_numels`` holds too, among the frozen base
            weights).
        layer_norm: the blocks normalise with LayerNorms (GPT-NeoX, Phi) instead of RMSNorms (Llama).
        norms_per_layer: norms in a block (Phi: one, read by attention and MLP in parallel).
        sequential_norms: a LayerNorm block whose second norm reads the residual after attention
            (GPT-2), so each norm keeps its own input (GPT-NeoX's parallel block and Phi: one shared).
        qkv_views: q, k and v are views of one fused projection's output with no rotary embedding
            to copy them (GPT-2's ``c_attn``): SDPA's flash path keeps one ``e*h`` more.
        mlp_saved_tensors: tensors of the MLP's width autograd keeps per token (SwiGLU 4; a native
            GELU 2; the tanh GELU written in Python, ``gelu_new``, 5).
        attention_dropout / hidden_dropout: dropout probabilities on the attention weights and on the
            residual branches and the embedding (0: none).
        max_positions: the longest sequence the model accepts, in tokens (``None``: not known).
    """

    total_numel: int
    param_numels: tuple[int, ...]
    module_param_counts: tuple[int, ...]
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    intermediate_size: int | None = None
    kv_size: int | None = None
    tied_embeddings: bool = True
    layer_start: int | None = None
    layer_param_count: int | None = None
    projection_index: int | None = None
    extra: dict = field(default_factory=dict)
    trainable_numels: tuple[int, ...] | None = None
    layer_norm: bool = False
    norms_per_layer: int = 2
    sequential_norms: bool = False
    qkv_views: bool = False
    mlp_saved_tensors: int = 4
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    max_positions: int | None = None

    @property
    def optimizer_numels(self) -> tuple[int, ...]:
        """Element counts of the parameters the optimizer holds (frozen ones left out)."""
        return self.param_numels if self.trainable_numels is None else self.trainable_numels


def model_dims(cfg: RunConfig) -> ModelDims:
    """Model layout from a meta-device instance (no weights read, no memory).

    Raises:
        UserError: the model cannot be resolved (as ``memascend finetune``).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memascend.config.render import model_shape
    from memascend.models.loading import from_scratch_config, resolve_model

    if cfg.model.from_scratch:
        hf_cfg = from_scratch_config(cfg.model.from_scratch)
    else:
        hf_cfg = AutoConfig.from_pretrained(resolve_model(cfg.model).hf_dir)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_cfg)
    if cfg.lora.enabled:  # adapters among the base weights, which are frozen
        from memascend.models.lora import apply_lora

        meta = apply_lora(meta, cfg.lora, origin=cfg.model.name_or_path).get_base_model()
    shape = model_shape(meta)
    out, inp = meta.get_output_embeddings(), meta.get_input_embeddings()
    tied = out is None or inp is None or out.weight is inp.weight
    h, heads = hf_cfg.hidden_size, hf_cfg.num_attention_heads
    head_dim = getattr(hf_cfg, "head_dim", None) or h // heads
    kv_heads = getattr(hf_cfg, "num_key_value_heads", None) or heads
    return ModelDims(shape.total_numel, shape.param_numels, shape.module_param_counts, h,
                     hf_cfg.num_hidden_layers, heads, hf_cfg.vocab_size,
                     getattr(hf_cfg, "intermediate_size", None) or getattr(hf_cfg, "n_inner", None),
                     kv_heads * head_dim, tied,
                     **_layer_layout(meta, out), trainable_numels=shape.trainable_numels, **_block_kind(hf_cfg),
                     max_positions=getattr(hf_cfg, "max_position_embeddings", None) or getattr(hf_cfg, "n_positions", None))


MLP_SAVED_TENSORS_PYTHON_GELU = 5
"""Tensors of the MLP's width autograd keeps per token behind a GELU computed in Python
(``gelu_new``, ``gelu_fast``: the tanh formula as several elementwise ops): the first matrix's output,
three intermediates of the formula, the second matrix's input (measured with saved-tensor hooks, Phi)."""


def _block_kind(hf_cfg) -> dict:
    """The block's norms, MLP and dropout from a Hugging Face config (``ModelDims`` keywords): the
    families of :data:`memascend.config.families.FAMILIES` by ``model_type``; any other model is
    planned as a Llama block (RMSNorms, SwiGLU) with its own dropout keys where it has them."""
    from memascend.config.families import FAMILIES

    fam = FAMILIES.get(getattr(hf_cfg, "model_type", ""))
    act = getattr(hf_cfg, "hidden_act", None) or getattr(hf_cfg, "activation_function", None) or "silu"
    if fam is None or fam.gated_mlp:
        mlp = 4
    else:
        mlp = MLP_SAVED_TENSORS_PYTHON_GELU if act in ("gelu_new", "gelu_fast", "gelu_python") else 2
    attention_key = fam.attention_dropout_key if fam else "attention_dropout"
    hidden_keys = [k for k in (fam.dropout_keys if fam else ()) if k not in (attention_key, "embd_pdrop")]
    layer_norm = bool(fam and fam.norm_bias)
    return dict(layer_norm=layer_norm, norms_per_layer=fam.norms_per_layer if fam else 2,
                sequential_norms=layer_norm and fam.norms_per_layer == 2
                and not getattr(hf_cfg, "use_parallel_residual", False),
                qkv_views=bool(fam and fam.position_embeddings),
                mlp_saved_tensors=mlp, attention_dropout=float(getattr(hf_cfg, attention_key, 0.0) or 0.0),
                hidden_dropout=max((float(getattr(hf_cfg, k, 0.0) or 0.0) for k in hidden_keys), default=0.0))


def _layer_layout(meta, out) -> dict:
    """Where the decoder layers and the vocabulary projection sit among the parameters of a model
    (tied weights once, registration order): ``layer_start``, ``layer_param_count`` (of the module
    list every family keeps its blocks in, ``*.layers``, GPT-2's ``transformer.h``) and
    ``projection_index``; empty where the model has no such list."""
    import torch

    params = list({id(p): p for p in meta.parameters()}.values())
    index = {id(p): i for i, p in enumerate(params)}
    blocks = next((m for name, m in meta.named_modules()
                   if (name.endswith("layers") or name.endswith(".h")) and isinstance(m, torch.nn.ModuleList) and len(m)),
                  None)
    if blocks is None:
        return {}
    first = list(blocks[0].parameters())
    layout = {"layer_start": index[id(first[0])], "layer_param_count": len(first)}
    if out is not None:
        layout["projection_index"] = index[id(out.weight)]
    return layout


def live_window_partitions(dims: ModelDims, world_size: int, checkpointing: bool, reuse_numel: int,
                           dram_numel: int, elem_bytes: int) -> list[int]:
    """Partitions (elements per rank) held in the parameter pool at the turn from forward to backward.

    On the parameters' second use ZeRO-3 releases a gathered parameter only if it is not used again
    within ``stage3_max_reuse_distance`` elements of the trace (``__params_to_release`` walks the
    submodule order from the released module itself, counting every module's elements, and keeps a
    parameter it meets again before the count reaches the distance). At the turn that keeps the
    vocabulary projection (used in its forward and its backward) and the last ``k`` layers: from a
    parameter's module in the ``m``-th layer from the end to its next use the trace holds one
    layer's elements (its module and the rest of its layer in forward, the modules before it in
    the recompute or backward), both uses of the projection, and the ``m`` later layers two times
    (forward, backward) or three (with activation checkpointing's recompute); the layer is kept
    where that is under the distance. A partition with a DRAM copy (among the first
    ``dram_numel`` elements, ``offload_param.max_in_cpu``) or under the swappable size is not in
    the pool. With untied embeddings the projection is ``lm_head`` (registered last), and the input
    embedding, used again only at the end of backward, is released. Checked against the pool's
    classes in use (report ``memory_breakdown.locked.param_pool_classes``, ``max_in_cpu`` 0,
    checkpointing, 1 x 256 tokens, distance 1e9): llama-1b the embedding and 6 layers, llama-3b the
    embedding and 2 layers (one partition more in flight).

    Returns:
        The pool-resident partitions' element counts (per rank).
    """
    numels = list(dims.param_numels)
    n_layers = max(1, dims.num_layers)
    outside = 2 if dims.tied_embeddings else 3  # Llama: embedding, layers, final norm (, lm_head untied)
    start = 1 if dims.layer_start is None else dims.layer_start
    per_layer = dims.layer_param_count or (len(numels) - outside) // n_layers
    if per_layer < 1 or start + per_layer * n_layers > len(numels) or (
            dims.layer_param_count is None and outside + per_layer * n_layers != len(numels)):
        return []
    vocab = dims.vocab_size * dims.hidden_size
    layer_numel = sum(numels[start:start + per_layer])
    uses = 3 if checkpointing else 2
    kept = 0
    while kept < n_layers and 2 * vocab + (uses * kept + 1) * layer_numel < reuse_numel:
        kept += 1
    parts = [math.ceil(n / world_size) for n in numels]
    offsets = [0, *itertools.accumulate(parts)]  # where each partition starts in the DRAM-copy order
    projection = dims.projection_index if dims.projection_index is not None else (
        0 if dims.tied_embeddings else len(numels) - 1)
    window = [projection] + list(range(start + (n_layers - kept) * per_layer, start + n_layers * per_layer))
    return [parts[i] for i in window
            if offsets[i] >= dram_numel and parts[i] * elem_bytes >= ds_defaults.MIN_SWAPPABLE_BYTES]


@dataclass(frozen=True)
class Activations:
    """Forward/backward tensors of one micro-batch, per rank (bytes).

    Attributes:
        saved: what autograd keeps for backward in the transformer layers and the final norm, all
            alive at the start of backward.
        logits: the vocabulary projection's fp32 tensors (:data:`LOGITS_FP32_TENSORS`), alive at
            the start of backward.
        recompute: with activation checkpointing, one layer's full set, recomputed during backward
            after the logits are freed (0 without checkpointing).
        largest_saved_tensor / largest_logits_tensor: the largest single tensor of the layers and of
            the logits (whether glibc serves it from the heap or mmap,
            :data:`GLIBC_MMAP_THRESHOLD_MAX_BYTES`).
    """

    saved: int
    logits: int
    recompute: int
    largest_saved_tensor: int
    largest_logits_tensor: int

    @property
    def total(self) -> int:
        """The backward peak: saved tensors plus the larger of the logits and a recomputed layer."""
        return self.saved + max(self.logits, self.recompute)


def activation_parts(dims: ModelDims, micro_batch: int, seq_len: int, dtype_bytes: int,
                     checkpointing: bool, loss_chunk_tokens: int | None = None) -> Activations:
    """Activation memory of one micro-batch of a Hugging Face decoder (bytes, per rank).

    Counted per token (``T = micro_batch * seq_len``; ``e`` = ``dtype_bytes``; ``h`` hidden, ``kv``
    key/value width, ``i`` MLP width, ``a`` heads, ``V`` vocabulary), as kept by autograd with
    SDPA attention (torch's flash kernel on CPU: no ``s*s`` score matrix, memory linear in ``s``):

    * per layer ``2*(2*e*h + 4*h) + e*(2*h + 2*kv + 4*i) + 4*a``: each of the two RMSNorms keeps
      its fp32 input (the upcast copy in 16-bit) and its normalised and weighted outputs; q, k, v
      and the attention output; the SwiGLU MLP's gate, up, ``silu(gate)`` and product; the flash
      kernel's fp32 log-sum-exp per head;
    * the other families' blocks (:class:`ModelDims` ``layer_norm``, ``norms_per_layer``,
      ``sequential_norms``, ``qkv_views``, ``mlp_saved_tensors``, dropout): a LayerNorm block keeps
      its input once (GPT-2's sequential block: each norm's input) and per norm the output and
      ``2*e`` of statistics, and its attention one more ``e*h`` (the output copied before the
      dense projection; GPT-2's fused q/k/v views one more in the flash path); the MLP ``mlp_saved_tensors * e*i``; dropout on the residual
      branches one ``e*h`` mask each (and the embedding's); dropout on the attention weights makes
      SDPA take its math path, which keeps fp32 q, k, v (``12*h``) and three fp32 ``s x s``
      tensors per head (``12*a*s``: memory quadratic in ``s``) instead of the flash kernel's
      tensors (the attention output ``e*h`` stays);
    * with activation checkpointing instead ``e*h`` per layer (the layer input), and one layer's
      full set while it is recomputed during backward (after the logits are freed);
    * the final norm, ``2*e*h + 4*h`` (LayerNorm ``2*e*h + 2*e``);
    * the logits: :data:`LOGITS_FP32_TENSORS` fp32 ``T x V`` tensors at the start of backward; with
      ``loss_chunk_tokens`` (:mod:`memascend.train.chunked_loss`) the same for one chunk of
      ``min(T, loss_chunk_tokens)`` tokens, recomputed during backward.

    Measured with ``torch.profiler`` (``profile_memory``, peak of live CPU tensor bytes, weight
    gradients dropped as stage 3 does) on transformers 5.23 / torch 2.13: the per-layer term to
    within 8 bytes per token at SmolLM2's shape (h 576, kv 192, i 1536: bf16 24,617 and fp32 44,588
    bytes measured) and at h 1024, kv 512, i 2816; checkpointed layers exactly ``e*h``; the
    vocabulary term 12.0 bytes per entry per token in bf16 and fp32, linear in ``s`` from 1024 to
    4096 tokens. The other families' terms counted with saved-tensor hooks (transformers 5.24,
    2 x 256 tokens, bf16 and fp32): the from-scratch Mistral, Qwen2, GPT-NeoX, Phi and GPT-2 presets, with
    and without dropout, within 0.2 % of the tensors autograd keeps.
    """
    t, h, a = micro_batch * seq_len, dims.hidden_size, dims.num_heads
    e = dtype_bytes
    kv = dims.kv_size or h
    i = dims.intermediate_size or 4 * h
    if dims.attention_dropout > 0:  # SDPA's math path: fp32 q, k, v and three s x s fp32 tensors per head
        attention = _FP32 * (3 * h + 3 * a * seq_len) + e * h
    else:  # the flash kernel: q, k, v, the output and the fp32 log-sum-exp per head
        attention = e * (2 * h + 2 * kv) + 4 * a + (e * h if dims.layer_norm else 0) + (e * h if dims.qkv_views else 0)
    if dims.layer_norm:  # the block's input (shared by parallel norms), each norm's output, its mean and rstd
        inputs = dims.norms_per_layer if dims.sequential_norms else 1
        norms, final_norm = inputs * e * h + dims.norms_per_layer * (e * h + 2 * e), 2 * e * h + 2 * e
    else:  # each RMSNorm's fp32 input and its normalised and weighted outputs
        norms = dims.norms_per_layer * (2 * e * h + 4 * h)
        final_norm = 2 * e * h + 4 * h
    dropout = e * h if dims.hidden_dropout > 0 else 0  # one mask per residual branch and the embedding's
    full_layer = norms + attention + e * dims.mlp_saved_tensors * i + 2 * dropout
    per_layer = e * h if checkpointing else full_layer
    saved = t * (dims.num_layers * per_layer + final_norm + dropout)
    recompute = t * full_layer if checkpointing else 0
    logits_tensor = (min(t, loss_chunk_tokens) if loss_chunk_tokens else t) * dims.vocab_size * _FP32
    largest = max(t * max(e * i, 4 * h), _FP32 * micro_batch * a * seq_len * seq_len if dims.attention_dropout > 0 else 0)
    return Activations(saved, LOGITS_FP32_TENSORS * logits_tensor, recompute, largest, logits_tensor)


def corpus_tokens(source: str) -> int:
    """Tokens of ``--data``: known for the built-in corpora, else file bytes / 4 (a typical BPE rate)."""
    if source in BUILTIN_CORPUS_TOKENS:
        return BUILTIN_CORPUS_TOKENS[source]
    from pathlib import Path

    path = Path(source)
    files = [path] if path.is_file() else (list(path.rglob("*")) if path.is_dir() else [])
    return sum(f.stat().st_size for f in files if f.is_file()) // 4
