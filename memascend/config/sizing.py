"""The memascend settings that live in DeepSpeed's own config: sized from the model and written into it.

:func:`prepare_ds_config` resolves the model-dependent ``"auto"`` sizes (sub-group size, reduce
bucket, parameter DRAM copy) and writes them with :func:`rewrite_ds_config`. It is the one
implementation: :func:`memascend.config.render.resolve` calls it for ``memascend finetune --engine
memascend`` (and ``memascend plan``) before :func:`memascend.integrations.deepspeed.apply`; code
that drives DeepSpeed itself can call it the same way with its model's parameter sizes::

    cfg, settings = prepare_ds_config(cfg, MemAscendSettings.from_ds_config(cfg),
                                      param_numels=[p.numel() for p in meta_model.parameters()])
    ma_ds.apply(settings)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from memascend.config import ds_defaults
from memascend.config.ds_defaults import ds_value
from memascend.config.settings import MemAscendSettings
from memascend.units import FP32_BYTES

MODEL_SIZED_SETTINGS = ("optimizer_sub_group_numel", "reduce_bucket_numel", "param_dram_numel", "param_pool_bytes")
"""The :class:`MemAscendSettings` that live in DeepSpeed's own config and may be ``"auto"``:
:func:`prepare_ds_config` sizes them from the model's parameters."""

PARAM_DRAM_AUTO_MAX_BYTES = 512 * 1024**2
"""``param_dram_numel="auto"``: largest total of one rank's parameter partitions (bytes) whose DRAM
copy is kept; above it every partition lives on NVMe only (``max_in_cpu`` 0). 512 MiB: the default
job's SmolLM2-135M (257 MiB of bf16) and llama-0.1b (216 MiB) keep their copy, and with it their
speed; from llama-0.5b (862 MiB) up the copy, 2 bytes per parameter, would be the largest term of
the peak (``host_memory_budget`` can buy it back)."""

AUTO_CHUNK_NUMEL = 8 << 20
"""The largest ``optimizer_chunk_numel="auto"`` chunk, and the one taken where the model is not
known (:func:`resolve_chunk_numel`): 8 Mi elements, 32 MiB of fp32 per tensor and request. An NVMe
drive reaches its sequential bandwidth with requests of a few MiB, so larger chunks buy no I/O
speed, while the step's locked memory stays bounded whatever the model (a 49152 x 2048 embedding
alone is 100.7 M elements: 12 chunks)."""

AUTO_CHUNK_MIN_NUMEL = 1 << 20
"""The smallest ``optimizer_chunk_numel="auto"`` chunk: 1 Mi elements, 4 MiB of fp32 per request
(still a request size at which a drive streams)."""

AUTO_CHUNK_MODEL_DIVISOR = 16
"""``optimizer_chunk_numel="auto"`` sized from the model: at most one sixteenth of the rank's
parameter partitions. The chunked step holds up to nine chunks of fp32 at once (two buffer sets of
master weights, two moments and a gradient slab, plus the chunk gradient:
:func:`memascend.integrations.deepspeed.chunk_plan.chunk_buffers_numel`), 36 bytes per chunk
element: at a sixteenth that is at most 2.25 bytes per parameter of the rank, about its 16-bit
weights, so the step's locked memory shrinks with a small model (or a partition split over ranks)
instead of staying at the 8 Mi-element chunk's ~0.28 GiB."""


def resolve_chunk_numel(value: int | str | None) -> int | None:
    """Elements per chunk for a setting value: ``"auto"`` -> :data:`AUTO_CHUNK_NUMEL` (the model
    unknown; :func:`prepare_ds_config` resolves ``"auto"`` from the model with
    :func:`auto_chunk_numel`), an integer as given, ``None`` -> ``None`` (no chunking)."""
    if value == "auto":
        return AUTO_CHUNK_NUMEL
    return None if value is None else int(value)


def auto_chunk_numel(param_numels: Iterable[int], world_size: int = 1) -> int:
    """``optimizer_chunk_numel="auto"`` for a model: the largest power of two of elements that is at
    most :data:`AUTO_CHUNK_MODEL_DIVISOR`-th of one rank's parameter partitions
    (``ceil(numel / world_size)`` each), clamped to [:data:`AUTO_CHUNK_MIN_NUMEL`,
    :data:`AUTO_CHUNK_NUMEL`].

    A power of two is a multiple of the chunk alignment (1024 elements) and of every smaller power,
    so the sub-group candidates of :func:`auto_chunked_sub_group_numel` (the chunk halved) stay
    aligned. Any chunk gives bit-identical losses (Adam is elementwise): the size trades locked
    memory against the number of I/O requests only.

    Args:
        param_numels: elements of every parameter (tied weights once).
        world_size: ranks that partition each parameter.

    Returns:
        Elements per chunk, a power of two in [1 Mi, 8 Mi].
    """
    rank_numel = sum(math.ceil(int(n) / max(1, world_size)) for n in param_numels)
    limit = min(AUTO_CHUNK_NUMEL, rank_numel // AUTO_CHUNK_MODEL_DIVISOR)
    chunk = AUTO_CHUNK_MIN_NUMEL
    while chunk * 2 <= limit:
        chunk *= 2
    return chunk


def stock_sub_groups(params: Sequence[Any], sub_group_numel: int | None,
                     numel_of: Callable[[Any], int]) -> list[list[Any]]:
    """Split one parameter group into sub-groups exactly as stock ZeRO-3 does.

    Mirrors the rule of ``DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups`` (0.19.8): one
    group when ``sub_group_numel`` is ``None`` or covers the whole group; otherwise parameters are
    appended in order and a sub-group is closed as soon as it holds ``>= sub_group_numel``
    elements (so a sub-group may exceed the size by up to one parameter), the last one at the end.

    Args:
        params: the parameters of one optimizer parameter group, in order.
        sub_group_numel: ``zero_optimization.sub_group_size`` (elements).
        numel_of: elements of one parameter's partition on this rank.

    Returns:
        The sub-groups, as lists of the given parameter objects.
    """
    params = list(params)
    total = sum(numel_of(p) for p in params)
    if sub_group_numel is None or sub_group_numel >= total:
        return [params]
    groups: list[list[Any]] = []
    current: list[Any] = []
    filled = 0
    for index, param in enumerate(params):
        current.append(param)
        filled += numel_of(param)
        if filled >= sub_group_numel or index == len(params) - 1:
            groups.append(current)
            current, filled = [], 0
    return groups


def auto_sub_group_numel(param_numels: Iterable[int], world_size: int = 1,
                         min_swappable_bytes: int = ds_defaults.MIN_SWAPPABLE_BYTES) -> int:
    """Sub-group size for ``optimizer_sub_group_numel="auto"``: the largest parameter partition,
    grown until no sub-group stays in DRAM.

    ZeRO-3 never splits a parameter across sub-groups, so no sub-group can be smaller than the
    largest partition; at that size the optimizer's ``states + 1`` locked fp32 buffers are as small
    as they can get and every sub-group is still at least one whole parameter (large I/O).

    Stock grouping (:func:`~memascend.config.sizing.stock_sub_groups`) closes a
    sub-group once it reaches the size, so only the last one can be small. One below
    ``min_swappable_bytes`` of fp32 is kept in DRAM by the stock swapper, and DeepSpeed 0.19.8's
    ``load_checkpoint`` with the optimizer on NVMe restores only the swapped sub-groups (it copies
    the swap folder back and skips ``_load_zero_checkpoint``): a resumed run would silently start
    that sub-group from the freshly initialised model. The size is therefore grown by the small remainder until every sub-group is swappable (at worst one
    sub-group, the stock layout).

    Args:
        param_numels: elements of every parameter (tied weights once), in the optimizer's order.
        world_size: ranks that partition each parameter.
        min_swappable_bytes: smallest fp32 sub-group the optimizer swapper puts on NVMe.

    Returns:
        Elements per sub-group, at least 1.
    """
    parts = [math.ceil(int(n) / max(1, world_size)) for n in param_numels]
    if not parts:
        return 1
    return max(1, _grow_until_swappable(parts, max(parts), -(-min_swappable_bytes // FP32_BYTES)))


def auto_chunked_sub_group_numel(param_numels: Iterable[int], chunk_numel: int, world_size: int = 1,
                                 min_swappable_bytes: int = ds_defaults.MIN_SWAPPABLE_BYTES) -> int:
    """Sub-group size for ``optimizer_sub_group_numel="auto"`` when the step is chunked
    (:mod:`.chunked_step`): the one whose largest sub-group is smallest.

    With a chunked step the optimizer's step buffers no longer depend on the sub-groups, but the
    whole-sub-group buffers that remain (the gradient swap-out staging during backward, the initial
    fp32 write-out, the 16-bit write-back buffer) hold the largest one. Stock grouping closes a
    sub-group only once it reaches the size, so at the largest partition ``P`` (the unchunked rule,
    :func:`auto_sub_group_numel`) the layers before an untied ``lm_head`` join it (up to ~2 ``P``).
    A size ``S`` below ``P`` bounds every sub-group by ``P + S - 1`` and usually closes one right
    before a large parameter. Candidates are ``P`` and the chunk halved down to the smallest
    swappable size (each grown, as :func:`auto_sub_group_numel` grows ``P``, until no sub-group stays
    in DRAM); :func:`auto_sub_group_numel`'s size is kept unless a candidate makes the largest
    sub-group strictly smaller (then the largest such candidate: fewer, larger swap files).

    Args:
        param_numels, world_size, min_swappable_bytes: as :func:`auto_sub_group_numel`.
        chunk_numel: elements per chunk of the step.

    Returns:
        Elements per sub-group, at least 1.
    """
    parts = [math.ceil(int(n) / max(1, world_size)) for n in param_numels]
    if not parts:
        return 1
    min_numel = -(-min_swappable_bytes // FP32_BYTES)
    unchunked = auto_sub_group_numel(parts, 1, min_swappable_bytes)
    best = (max(sum(group) for group in stock_sub_groups(parts, unchunked, int)), unchunked)
    candidates, size = set(), min(int(chunk_numel), sum(parts))
    while size >= min_numel:
        candidates.add(size)
        size //= 2
    for candidate in sorted(candidates, reverse=True):
        grown = _grow_until_swappable(parts, candidate, min_numel)
        largest = max(sum(group) for group in stock_sub_groups(parts, grown, int))
        if largest < best[0]:
            best = (largest, grown)
    return max(1, best[1])


def _grow_until_swappable(parts: list[int], size: int, min_numel: int) -> int:
    return _grow_until_swappable_memo(tuple(parts), size, min_numel)


@functools.lru_cache(maxsize=1024)
def _grow_until_swappable_memo(parts: tuple[int, ...], size: int, min_numel: int) -> int:
    # Pure, and slow on a model whose last sub-group is a norm (it grows by that sub-group's few
    # thousand elements per pass): the budget search resolves every knob combination of the same
    # model, 60 for llama-3b, with the same few sizes.
    total = sum(parts)
    while size < total:
        groups = stock_sub_groups(parts, size, int)
        smallest = min(sum(group) for group in groups)
        if len(groups) == 1 or smallest >= min_numel:
            break
        size = min(total, size + smallest)
    return size


def auto_param_dram_numel(ds_config: Mapping[str, Any], param_numels: Iterable[int] | None,
                          world_size: int = 1) -> int | None:
    """``param_dram_numel="auto"``: 0 (no DRAM copy of the parameter partitions) for a large model.

    Stock ZeRO-3 with parameters on NVMe keeps a DRAM copy of the first ``max_in_cpu`` (1e9)
    partition elements (``_create_param_groups_fp16_flat_cpu_memory``), 2 bytes per parameter in
    bf16/fp16 (4 in fp32): the largest host consumer of a large model. Without it the adaptive pool
    reads the partitions from NVMe when used, which costs pool slots and read time that only pay
    off for a large model (:attr:`memascend.config.settings.MemAscendSettings.param_dram_numel`).

    Args:
        ds_config: the DeepSpeed config (``bf16``/``fp16`` sections give the parameter dtype).
        param_numels: elements of every model parameter, or ``None`` if unknown.
        optimizer_numels: elements of every parameter the optimizer holds (the trainable ones, in
            registration order); ``None``: ``param_numels`` (every parameter trained).
        world_size: ranks that partition the parameters.

    Returns:
        0 when parameters go to NVMe, the config sets no ``max_in_cpu`` and the rank's parameter
        partitions exceed :data:`PARAM_DRAM_AUTO_MAX_BYTES`; else ``None`` (keep the config's).
    """
    offload_param = (ds_config.get("zero_optimization") or {}).get("offload_param") or {}
    if param_numels is None or offload_param.get("device") != "nvme" or "max_in_cpu" in offload_param:
        return None
    half = any((ds_config.get(key) or {}).get("enabled") for key in ("bf16", "fp16"))
    rank_numel = sum(math.ceil(int(n) / max(1, world_size)) for n in param_numels)
    return 0 if rank_numel * (2 if half else FP32_BYTES) > PARAM_DRAM_AUTO_MAX_BYTES else None


PARAM_POOL_AUTO_PREFETCH_LAYERS = 1
"""``param_pool_bytes="auto"``: layers the prefetcher may read ahead of the one computing."""
_MAX_LAYER_PERIOD = 64


def layer_param_count(param_numels: Iterable[int]) -> int:
    """Parameters per repeated layer of a model: the period ``p`` (1 to 64) at which the sequence of
    parameter sizes repeats most often (``numels[i] == numels[i + p]``; the smallest such ``p`` on a
    tie), 1 for a model of fewer than two parameters.

    A transformer registers its layers one after another with the same shapes (a Hugging Face Llama:
    embedding, ``L`` x 9 layer parameters, final norm, lm_head), so ``p`` is the parameters of one
    layer.
    """
    numels = [int(n) for n in param_numels]
    best, best_matches = 1, -1
    for period in range(1, min(_MAX_LAYER_PERIOD, len(numels) // 2) + 1):
        matches = sum(1 for i in range(len(numels) - period) if numels[i] == numels[i + period])
        if matches > best_matches:
            best, best_matches = period, matches
    return best


def largest_layer_numel(param_numels: Iterable[int], world_size: int = 1) -> int:
    """Elements per rank of the model's largest layer: the largest sum of :func:`layer_param_count`
    consecutive parameter partitions (``ceil(numel / world_size)`` each) that all repeat one period
    before or after (so the embedding or lm_head is not counted as part of a layer); the largest
    partition where nothing repeats."""
    parts = [math.ceil(int(n) / max(1, world_size)) for n in param_numels]
    if not parts:
        return 0
    period = layer_param_count(parts)
    repeats = [(i >= period and parts[i - period] == n) or (i + period < len(parts) and parts[i + period] == n)
               for i, n in enumerate(parts)]
    windows = [sum(parts[i:i + period]) for i in range(len(parts) - period + 1) if all(repeats[i:i + period])]
    return max(windows, default=max(parts))


def largest_layer_param_numel(param_numels: Iterable[int]) -> int:
    """Elements of the largest parameter of the model's repeated layers: the largest of the
    parameters that :func:`largest_layer_numel` counts as part of a layer (its size repeats one
    :func:`layer_param_count` period before or after, so neither the embedding nor an lm_head), the
    largest parameter where nothing repeats, 0 for no parameters."""
    numels = [int(n) for n in param_numels]
    period = layer_param_count(numels)
    repeated = [n for i, n in enumerate(numels)
                if (i >= period and numels[i - period] == n) or (i + period < len(numels) and numels[i + period] == n)]
    return max(repeated or numels or [0])


def bucketless_reduce_applies(ds_config: Mapping[str, Any]) -> bool:
    """Whether ``enable_bucketless_reduce`` runs stage 3 without its reduce (IPG) bucket buffer for
    this DeepSpeed config: ``zero_optimization.reduce_scatter`` on (DeepSpeed's default) and
    ``contiguous_gradients`` either left out (or ``"auto"``), which :func:`rewrite_ds_config` then
    sets false, or false already. A ``contiguous_gradients: true`` the config sets itself stands."""
    zero = ds_config.get("zero_optimization") or {}
    if not isinstance(zero, Mapping) or not zero.get("reduce_scatter", ds_defaults.REDUCE_SCATTER):
        return False
    return zero.get("contiguous_gradients", "auto") in ("auto", False)


BUCKETLESS_MIN_REDUCE_BUCKET_NUMEL = 16 * 1024 * 1024
"""Smallest ``"auto"`` reduce bucket without the bucket buffer (elements: 32 MiB of bf16 gradients
waiting for their reduce at most), so that a small model is not reduced one parameter at a time."""


def auto_reduce_bucket_numel(param_numels: Iterable[int], config_numel: int, bucketless: bool) -> int:
    """``reduce_bucket_numel="auto"``: elements of one reduce bucket.

    With stage 3's bucket buffer (``contiguous_gradients``), the largest parameter: a gradient that
    fits is copied into the buffer, so it holds one whole gradient. Without it
    (``bucketless``: :func:`bucketless_reduce_applies`), the bucket size only bounds the gradient
    elements that wait, alive, for their reduce (``reduce_independent_p_g_buckets_and_remove_grads``
    reduces the waiting ones before a gradient that would overflow it, and a gradient larger than
    the bucket is reduced in a bucket of its own), so it is :func:`largest_layer_param_numel`:
    whole layers' gradients never wait in one bucket, and the tied embedding's gradient, made at
    the end of backward, is not joined by a bucket of the largest parameter's size of layer
    gradients; but at least :data:`BUCKETLESS_MIN_REDUCE_BUCKET_NUMEL` (or the largest parameter,
    where smaller): each reduced bucket costs a ``partition_grads`` call (a ``malloc_trim`` under the
    malloc policy) and its own gradient writes, and a small model's largest layer parameter would
    make one of those per parameter. Each at most ``config_numel`` (the config's
    ``reduce_bucket_size``), at least 1.

    The floor, measured on SmolLM2-135M (``--seq-len 128 --micro-batch 2``, 5 steps, both on NVMe):
    at its largest layer parameter (884,736 elements) the backward took 1.51-1.74 s a step with
    0.33-0.41 s of system time, at the largest parameter 1.29-1.44 s with 0.07-0.22 s.

    Measured on llama-1b (bf16, 256 tokens, activation checkpointing, parameters and optimizer on
    NVMe, 3 steps; its peak is at the end of the first backward): peak RSS 1,526 MiB with the buffer
    and the largest parameter (100.7 M elements), 1,526 MiB without the buffer at that bucket size
    (the layer gradients waiting beside the embedding's take the buffer's place), 1,334 MiB without
    it at the largest layer parameter (11.5 M) and 1,334 MiB at 4 Mi elements; losses identical.

    Args:
        param_numels: elements of every parameter (tied weights once), in registration order.
        config_numel: the config's ``reduce_bucket_size`` (elements).
        bucketless: whether stage 3 runs without the bucket buffer.

    Returns:
        Elements per bucket.
    """
    numels = [int(n) for n in param_numels] or [1]
    if bucketless:
        wanted = min(max(largest_layer_param_numel(numels), BUCKETLESS_MIN_REDUCE_BUCKET_NUMEL), max(numels))
    else:
        wanted = max(numels)
    return max(1, min(wanted, int(config_numel)))


def auto_param_pool_bytes(param_numels: Iterable[int], elem_bytes: int, world_size: int = 1,
                          prefetch_layers: int = PARAM_POOL_AUTO_PREFETCH_LAYERS) -> int:
    """``param_pool_bytes="auto"``: what the forward and backward hold in the pool at once.

    The largest partition (the vocabulary projection, kept from its forward to its backward use) plus
    the largest layer's partitions x (``prefetch_layers`` + 1): the layer computing and the ones read
    ahead. With activation checkpointing a layer's recompute and backward follow each other, so its
    partitions are reused within that window.

    Args:
        param_numels: elements of every parameter (tied weights once), in registration order.
        elem_bytes: bytes per element of the 16-bit (or fp32) parameters.
        world_size: ranks that partition each parameter.
        prefetch_layers: layers read ahead.

    Returns:
        Bytes, at least one byte.
    """
    numels = [int(n) for n in param_numels]
    if not numels:
        return 1
    largest = math.ceil(max(numels) / max(1, world_size))
    layer = largest_layer_numel(numels, world_size)
    return max(1, (largest + (prefetch_layers + 1) * layer) * elem_bytes)


def _param_elem_bytes(ds_config: Mapping[str, Any]) -> int:
    return 2 if any((ds_config.get(key) or {}).get("enabled") for key in ("bf16", "fp16")) else FP32_BYTES


def _resolve_param_pool_bytes(ds_config: Mapping[str, Any], settings: MemAscendSettings, dram: int | None,
                              param_numels: Iterable[int] | None, world_size: int) -> int | None:
    """``param_pool_bytes`` resolved (:attr:`MemAscendSettings.param_pool_bytes`): ``"auto"`` is an
    integer only where some partitions live on NVMe only (``max_in_cpu`` below the rank's partitions)."""
    pool = settings.param_pool_bytes
    if pool != "auto":
        return pool
    offload_param = (ds_config.get("zero_optimization") or {}).get("offload_param") or {}
    if param_numels is None or offload_param.get("device") != "nvme":
        return None
    numels = [int(n) for n in param_numels]
    max_in_cpu = dram if isinstance(dram, int) else ds_value(ds_config, "zero_optimization.offload_param.max_in_cpu")
    if sum(math.ceil(n / max(1, world_size)) for n in numels) <= max_in_cpu:
        return None  # every partition has its DRAM copy: the pool is not used
    return auto_param_pool_bytes(numels, _param_elem_bytes(ds_config), world_size)


def prepare_ds_config(ds_config: Mapping[str, Any], settings: MemAscendSettings, *,
                      param_numels: Iterable[int] | None = None,
                      optimizer_numels: Iterable[int] | None = None,
                      world_size: int = 1) -> tuple[dict[str, Any], MemAscendSettings]:
    """Resolve ``settings`` against the model and return (DeepSpeed config, settings to apply).

    * ``optimizer_chunk_numel="auto"`` becomes :func:`auto_chunk_numel` of the optimizer's
      parameters when the optimizer state is swapped to NVMe and ``param_numels`` are given (else it
      stays ``"auto"``: :data:`AUTO_CHUNK_NUMEL`);
    * ``optimizer_sub_group_numel="auto"`` becomes :func:`auto_sub_group_numel` (with a chunked
      step, ``optimizer_chunk_numel`` set: :func:`auto_chunked_sub_group_numel`) of the optimizer's
      parameters when the optimizer state is swapped to NVMe and ``param_numels`` are given (else
      the config's size is kept). The optimizer holds only the trainable parameters: with a frozen
      base (LoRA) its sub-groups and the chunked step's buffers are sized from the adapters, not
      from the whole model (8 M adapter elements of a 452 M-parameter model: a 1 Mi-element chunk,
      36 MiB of step buffers instead of the 8 Mi-element chunk's 288 MiB);
    * when the sub-group size changes, ``grad_norm_sub_group_numel`` is set to the config's
      original size (so clipping sees the stock norm, :mod:`.grad_norm`), unless already set;
    * ``enable_bucketless_reduce`` becomes whether it applies to the config
      (:func:`bucketless_reduce_applies`);
    * ``reduce_bucket_numel="auto"`` becomes :func:`auto_reduce_bucket_numel` (the largest
      parameter; without the bucket buffer, the largest parameter of the repeated layers, at least
      :data:`BUCKETLESS_MIN_REDUCE_BUCKET_NUMEL`; at most
      the config's size) when ``param_numels`` are given;
    * ``param_dram_numel="auto"`` becomes :func:`auto_param_dram_numel` (``None``: the config's
      ``max_in_cpu`` or DeepSpeed's default);
    * ``param_pool_bytes="auto"`` becomes :func:`auto_param_pool_bytes` where some partitions live
      on NVMe only (else ``None``);
    * :func:`rewrite_ds_config` writes the DeepSpeed-side values.

    Args:
        ds_config: the DeepSpeed config (not modified).
        settings: the requested settings.
        param_numels: elements of every model parameter, or ``None`` if unknown.
        optimizer_numels: elements of every parameter the optimizer holds (the trainable ones, in
            registration order); ``None``: ``param_numels`` (every parameter trained).
        world_size: ranks that partition the parameters.

    Returns:
        The rewritten config and the resolved settings (pass those to ``apply``).
    """
    zero = ds_config.get("zero_optimization", {}) or {}
    stock_sub_group = int(zero.get("sub_group_size", ds_defaults.SUB_GROUP_NUMEL))
    optimizer_on_nvme = (zero.get("offload_optimizer") or {}).get("device") == "nvme"
    param_numels = None if param_numels is None else [int(n) for n in param_numels]
    opt_numels = param_numels if optimizer_numels is None or param_numels is None else [int(n) for n in optimizer_numels]
    chunk_setting = settings.optimizer_chunk_numel
    if chunk_setting == "auto" and optimizer_on_nvme and opt_numels:
        chunk_setting = auto_chunk_numel(opt_numels, world_size)
    sub_group = settings.optimizer_sub_group_numel
    if sub_group == "auto":
        chunk = resolve_chunk_numel(chunk_setting)
        if not optimizer_on_nvme or not opt_numels:
            sub_group = None
        elif chunk is not None:
            sub_group = auto_chunked_sub_group_numel(opt_numels, chunk, world_size)
        else:
            sub_group = auto_sub_group_numel(opt_numels, world_size)
    bucketless = settings.enable_bucketless_reduce and bucketless_reduce_applies(ds_config)
    bucket = settings.reduce_bucket_numel
    if bucket == "auto":
        bucket = (auto_reduce_bucket_numel(param_numels, zero.get("reduce_bucket_size", ds_defaults.REDUCE_BUCKET_NUMEL),
                                           bucketless) if param_numels is not None else None)
    dram = settings.param_dram_numel
    if dram == "auto":
        dram = auto_param_dram_numel(ds_config, param_numels, world_size)
    norm_sub_group = settings.grad_norm_sub_group_numel
    if norm_sub_group is None and sub_group is not None and sub_group != stock_sub_group:
        norm_sub_group = stock_sub_group
    pool = _resolve_param_pool_bytes(ds_config, settings, dram, param_numels, world_size)
    resolved = dataclasses.replace(settings, optimizer_chunk_numel=chunk_setting, optimizer_sub_group_numel=sub_group,
                                   grad_norm_sub_group_numel=norm_sub_group, reduce_bucket_numel=bucket,
                                   enable_bucketless_reduce=bucketless, param_dram_numel=dram, param_pool_bytes=pool)
    return rewrite_ds_config(ds_config, resolved), resolved


def rewrite_ds_config(ds_config: Mapping[str, Any], settings: MemAscendSettings) -> dict[str, Any]:
    """Return a copy of ``ds_config`` with the settings that live in DeepSpeed's own config applied.

    ``optimizer_sub_group_numel`` (an integer; ``"auto"`` needs the model's shapes and is resolved
    by :func:`prepare_ds_config`) -> ``zero_optimization.sub_group_size``; ``param_dram_numel``
    (an integer) -> ``zero_optimization.offload_param.max_in_cpu`` where parameters are offloaded to NVMe;
    ``reduce_bucket_numel`` (an integer) -> ``zero_optimization.reduce_bucket_size``;
    ``enable_bucketless_reduce`` -> ``zero_optimization.contiguous_gradients`` false where
    :func:`bucketless_reduce_applies` (the config's own ``contiguous_gradients`` stands);
    ``param_pool_bytes`` (an integer, with the parameter pool on and parameters on NVMe) ->
    ``zero_optimization.stage3_max_reuse_distance`` at most its elements. The
    ``"memascend"`` section itself is kept (DeepSpeed ignores it).

    Args:
        ds_config: the DeepSpeed config dict (not modified).
        settings: the memascend settings.

    Returns:
        A new dict (nested ``zero_optimization`` copied, other values shared).
    """
    out = dict(ds_config)
    zero = dict(out.get("zero_optimization", {}))
    if isinstance(settings.optimizer_sub_group_numel, int):
        zero["sub_group_size"] = settings.optimizer_sub_group_numel
    if isinstance(settings.reduce_bucket_numel, int):
        zero["reduce_bucket_size"] = settings.reduce_bucket_numel
    if settings.enable_bucketless_reduce and bucketless_reduce_applies(ds_config):
        zero["contiguous_gradients"] = False
    offload_param = zero.get("offload_param")
    if isinstance(settings.param_dram_numel, int) and isinstance(offload_param, Mapping) \
            and offload_param.get("device") == "nvme":
        zero["offload_param"] = {**offload_param, "max_in_cpu": settings.param_dram_numel}
    if isinstance(settings.param_pool_bytes, int) and isinstance(offload_param, Mapping) \
            and offload_param.get("device") == "nvme" and settings.enable_param_pool:
        window = max(1, settings.param_pool_bytes // _param_elem_bytes(ds_config))
        zero["stage3_max_reuse_distance"] = min(window, int(zero.get("stage3_max_reuse_distance",
                                                                     ds_defaults.MAX_REUSE_DISTANCE_NUMEL)))
    if zero or "zero_optimization" in out:
        out["zero_optimization"] = zero
    return out
