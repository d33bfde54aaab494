"""The activation swap's terms of the memory plan (``enable_activation_swap``,
:mod:`memascend.io.activation_swap`): what one micro-batch's forward/backward still keeps in host
memory when the swapper sends the saved tensors to NVMe, beside :mod:`memascend.plan.model`.

Three parts, per rank, at the start of backward:

* the eligible saved tensors left in DRAM (served by memascend's host block cache): the swapper's
  read-ahead, the tensor in use, and the DRAM allowance's window (``activation_dram_bytes``: the
  latest tensors of the pass), at most every eligible tensor;
* the saved tensors under the swapper's ``min_bytes`` (1 MiB): never swapped, they stay in host memory
  with the small temporaries of the same ops (the key and value projections of a grouped-query block,
  the flash kernel's log-sum-exp, the LoRA adapters' rank-wide outputs): in glibc's heap under the host
  block cache's threshold (64 KiB), whose touched pages stay resident until the malloc policy trims
  after the step, in the cache above it. One calibrated rate covers both
  (:data:`~memascend.plan.calibration.HEAP_BYTES_PER_SMALL_SAVED_BYTE`);
* the cache's region slack: it maps :data:`~memascend.plan.calibration.HOST_BLOCK_CACHE_REGION_BYTES`
  regions and packs the blocks under a region into them (a larger block gets a region of its own
  size), so the blocks alive at once take whole regions (:func:`cache_regions_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from memascend.config import RunConfig
from memascend.plan.calibration import (
    HEAP_BYTES_PER_SMALL_SAVED_BYTE,
    HOST_BLOCK_CACHE_REGION_BYTES,
    LOGITS_FP32_TENSORS,
)
from memascend.plan.shapes import Activations, ModelDims
from memascend.units import FP32_BYTES as _FP32


@dataclass(frozen=True)
class SwapTerms:
    """What one micro-batch keeps in host memory at the start of backward with the activation swap
    (bytes, per rank).

    Attributes:
        saved_in_dram_bytes: eligible saved tensors not on NVMe (read-ahead, the tensor in use, the
            DRAM allowance's window), in the host block cache.
        small_saved_bytes: saved tensors under the swapper's ``min_bytes`` (never swapped).
        heap_bytes: glibc heap pages the forward/backward's small tensors keep resident.
        cache_slack_bytes: regions the host block cache maps beyond the blocks alive at once.
    """

    saved_in_dram_bytes: int
    small_saved_bytes: int
    heap_bytes: int
    cache_slack_bytes: int


def layer_saved_tensor_bytes(dims: ModelDims, e: int, seq_len: int, checkpointing: bool,
                             lora_rank: int | None = None) -> list[int]:
    """Bytes per token of each tensor autograd keeps for one decoder layer (the tensors
    :func:`memascend.plan.shapes.activation_parts` counts, one entry each, in the same families'
    terms), plus the LoRA adapters' rank-wide outputs (``lora_rank``: one ``e * rank`` per adapter of
    the layer, from ``dims.trainable_numels``: an adapter is two trainable matrices).

    With ``checkpointing`` a layer keeps its input only (``e * h``).
    """
    h, a = dims.hidden_size, dims.num_heads
    kv = dims.kv_size or h
    i = dims.intermediate_size or 4 * h
    if checkpointing:
        return [e * h]
    items: list[int] = []
    if dims.layer_norm:  # the block's input, and per norm its output, mean and rstd
        items += [e * h] + [e * h, e, e] * dims.norms_per_layer
    else:  # per RMSNorm its fp32 input, the normalised and the weighted outputs
        items += [4 * h, e * h, e * h] * dims.norms_per_layer
    if dims.attention_dropout > 0:  # SDPA's math path: fp32 q, k, v and three s x s fp32 tensors per head
        items += [4 * h] * 3 + [_FP32 * a * seq_len] * 3 + [e * h]
    else:  # q, k, v, the output, the flash kernel's fp32 log-sum-exp per head
        items += [e * h, e * kv, e * kv, e * h, 4 * a] + ([e * h] if dims.layer_norm else [])
    items += [e * i] * dims.mlp_saved_tensors
    if dims.hidden_dropout > 0:
        items += [e * h] * 2
    if lora_rank and dims.trainable_numels is not None and dims.num_layers:
        adapters_per_layer = len(dims.trainable_numels) // 2 // dims.num_layers
        items += [e * lora_rank] * adapters_per_layer
    return items


def small_saved_bytes(dims: ModelDims, micro_batch: int, seq_len: int, e: int, checkpointing: bool,
                      min_bytes: int, lora_rank: int | None = None) -> int:
    """Bytes of one micro-batch's saved layer tensors under ``min_bytes`` each (all layers)."""
    tokens = micro_batch * seq_len
    per_layer = sum(tokens * b for b in layer_saved_tensor_bytes(dims, e, seq_len, checkpointing, lora_rank)
                    if tokens * b < min_bytes)
    return dims.num_layers * per_layer


def cache_regions_bytes(blocks: list[int], region_bytes: int = HOST_BLOCK_CACHE_REGION_BYTES) -> int:
    """Bytes the host block cache maps to hold ``blocks`` (bytes each) alive at once.

    A block of at least a region gets a region of its own size; the smaller ones are packed first
    fit, largest first, into regions of ``region_bytes``, and one region more is counted: the cache
    places blocks as they come (best fit, in allocation order, the forward's blocks before the
    backward's), never as tightly as a packing of the final set (the swap + chunked-loss SmolLM2 run
    maps 5 regions for 214 MiB in use, which packs into 4).
    """
    own = sum(b for b in blocks if b >= region_bytes)
    free: list[int] = []
    for b in sorted((b for b in blocks if 0 < b < region_bytes), reverse=True):
        for k, room in enumerate(free):
            if room >= b:
                free[k] -= b
                break
        else:
            free.append(region_bytes - b)
    return own + (len(free) + 1) * region_bytes if free else own


def swap_terms(act: Activations, dims: ModelDims, micro_batch: int, seq_len: int, e: int, checkpointing: bool,
               *, min_bytes: int, read_ahead_bytes: int, dram_allowance_bytes: int | None,
               lora_rank: int | None = None) -> SwapTerms | None:
    """The activation swap's terms for one micro-batch (``None`` where nothing is eligible: every
    saved tensor is under ``min_bytes``, the swap changes nothing).

    Args:
        act: :func:`memascend.plan.shapes.activation_parts` of the micro-batch.
        min_bytes, read_ahead_bytes: the swapper's (:mod:`memascend.io.activation_swap`).
        dram_allowance_bytes: ``activation_dram_bytes`` (``None``/0: none).
        lora_rank: the adapters' rank on a LoRA run.
    """
    if act.largest_saved_tensor < min_bytes:
        return None
    small = min(act.saved, small_saved_bytes(dims, micro_batch, seq_len, e, checkpointing, min_bytes, lora_rank))
    eligible = act.saved - small
    in_dram = min(eligible, read_ahead_bytes + act.largest_saved_tensor + int(dram_allowance_bytes or 0))
    piece = max(act.largest_saved_tensor, min_bytes)
    blocks = [piece] * math.ceil(in_dram / piece)
    if act.largest_logits_tensor and act.logits >= act.recompute:
        blocks += [act.largest_logits_tensor] * LOGITS_FP32_TENSORS
    in_use = sum(blocks)
    slack = max(0, cache_regions_bytes(blocks) - in_use)
    return SwapTerms(in_dram, small, int(small * HEAP_BYTES_PER_SMALL_SAVED_BYTE), slack)


def add_swap_terms(add: Callable[..., None], act: Activations, dims: ModelDims, cfg: RunConfig, e: int,
                   dram_allowance_bytes: int | None) -> int | None:
    """Add the heap and region-slack terms of :func:`swap_terms` for ``cfg``'s micro-batch (backward
    phase, through the planner's ``add(name, bytes, locked, source, phase)``) and return the eligible
    saved bytes left in DRAM (``None``: the swap changes nothing, nothing was added)."""
    from memascend.io.activation_swap import DEFAULT_MIN_BYTES, DEFAULT_READ_AHEAD_BYTES

    terms = swap_terms(act, dims, cfg.train.micro_batch, cfg.data.seq_len, e, cfg.train.activation_checkpointing,
                       min_bytes=DEFAULT_MIN_BYTES, read_ahead_bytes=DEFAULT_READ_AHEAD_BYTES,
                       dram_allowance_bytes=dram_allowance_bytes, lora_rank=cfg.lora.rank if cfg.lora.enabled else None)
    if terms is None:
        return None
    add("saved tensors under the swap's min_bytes and the heap pages they keep (activation_swap)",
        terms.heap_bytes, False, "glibc heap (HEAP_BYTES_PER_SMALL_SAVED_BYTE)", "backward")
    add("host block cache region slack (blocks under a region packed into 64 MiB regions)",
        terms.cache_slack_bytes, False, "host_cache regions (activation_swap_terms.cache_regions_bytes)", "backward")
    return terms.saved_in_dram_bytes
