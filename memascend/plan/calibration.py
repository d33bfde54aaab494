"""The planner's constants: the terms calibrated on this project's CPU host (``baselines/cpu-2c-24g`` reports; see :mod:`memascend.plan.model`)."""

from __future__ import annotations

from memascend.units import GIB

# --- calibrated on this project's CPU host (report.json of real runs; see module docstring) -------
FRAMEWORK_RSS_BYTES = int(0.42 * GIB)
"""RSS of a rank that is not any of the components below: interpreter, torch/DeepSpeed/transformers
code and their allocator caches, loaded ops, tokenizer, gloo, NVMe aio handles (bytes per rank).

Calibrated where nothing else is unknown: memascend's between-step RSS (report.json
``steps[].rss_bytes``; its malloc policy trims after every step) minus its modelled buffers is
0.552 GiB (median, 0.549-0.559) in the 10 Shakespeare one- and two-rank reports of SmolLM2 and
llama-0.1b/0.3b/0.5b in ``baselines/cpu-2c-24g`` and 0.714 GiB in the 3 chitchat ones; that is
0.42 GiB plus :data:`MEMASCEND_CORPUS_BYTES_PER_TOKEN` x corpus tokens. Stock runs the same code,
so the constant is shared; what stock leaves in its heap on top is modelled separately."""
MEMASCEND_FRAMEWORK_RSS_BYTES = FRAMEWORK_RSS_BYTES
"""The same under memascend's malloc policy: equal to stock's (see :data:`FRAMEWORK_RSS_BYTES`)."""
CORPUS_BYTES_PER_TOKEN = 130
"""Per rank, resident bytes per corpus token after reading and tokenizing (documents, Python token
lists, blocks): measured as the load-phase RSS of chitchat (3.80M tokens) over Shakespeare (1.70M).
Stock never hands the freed token lists back, so this stays for the whole run."""
MEMASCEND_CORPUS_BYTES_PER_TOKEN = 82
"""The same once memascend's malloc policy has trimmed the freed token lists: between-step RSS of
the chitchat reports over the Shakespeare ones, (0.714 - 0.552) GiB / 2.10M tokens."""
BUILTIN_CORPUS_TOKENS = {"shakespeare": 1_702_472, "chitchat": 3_802_092}
"""Tokens of the built-in corpora with the SmolLM2 tokenizer (report.json ``data.tokens``)."""
MODEL_BUILD_BYTES_PER_PARAM = 4.0
"""Per rank, building the model (every rank materialises whole fp32 tensors, pretrained weights read
from the checkpoint or random init, before ``zero.Init`` partitions 16-bit copies) leaves about one
fp32 copy of the model in stock's glibc heap: 4 bytes per parameter whose fp32 tensor is below
:data:`GLIBC_MMAP_THRESHOLD_MAX_BYTES` (larger ones are mmapped and unmapped when freed). For the
models of the calibration (up to llama-0.5b) that is 75-100 % of the parameters; for llama-1b, whose
MLP weights are 46 MB each in fp32, 21 % (planned 12.7 GiB for stock with ``sub_group_size`` 1e8
against 11.5 measured, instead of 15.6 when every parameter counted).

Calibrated: stock's between-step RSS (median of ``steps[].rss_bytes``) minus every other resident
component (incl. the activations it keeps in the heap, :data:`GLIBC_MMAP_THRESHOLD_MAX_BYTES`), per
parameter, over the 13 stock reports in ``baselines/cpu-2c-24g``: median 4.15 (from -1.4 to 9.7:
glibc's heap state varies from run to run and is the main uncertainty of stock plans). memascend's
malloc policy returns all of it: its between-step RSS leaves nothing per parameter (see
:data:`FRAMEWORK_RSS_BYTES`), so memascend has no such component."""
GLIBC_MMAP_THRESHOLD_MAX_BYTES = 32 << 20
"""glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit: stock runs with the dynamic mmap threshold, which
rises with every freed mmapped block up to this size. A tensor below it comes from the heap and its
pages stay resident after it is freed (stock never trims), so stock's forward/backward tensors under
it are resident from the first step on; larger ones are mmapped and unmapped on free (transient)."""
STOCK_HEAP_BYTES_PER_LAYER_TOKEN_SQ = 2.0
"""Stock's glibc heap at long sequences, in bytes per decoder layer per squared token of the
micro-batch (``micro_batch * seq_len``): what the forward/backward leaves in the heap as free chunks
it never hands back (fragmentation, not live tensors). The planner counts the larger of it and the
tensors it keeps in the heap (:data:`GLIBC_MMAP_THRESHOLD_MAX_BYTES`).

Found in the recorded reports' breakdowns: stock llama-0.1b (24 layers), 1 x 8192, activation
checkpointing, ``--loss-chunk-tokens 256`` (``baselines/cpu-2c-24g/context``) keeps a 3.60 GiB glibc
heap of which 3.41 GiB are free chunks (``memory_breakdown.malloc``), 3.02 GiB above every other
resident component (between-step RSS 7.21 GiB against 4.20 modelled): 2.01 bytes per layer and
token squared, the calibration. The same run's heap is 0.46 GiB at 1 x 1024 and 1.45 GiB at
1 x 4096 (``cpu-full``, without the chunked loss), 0.28 and 0.83 GiB above the modelled components:
the square's 0.05 and 0.75 (the linear fit through 4K and 8K would be negative at 1K). A plain torch
loop of the same model (no DeepSpeed) leaves a 1.2 GiB heap after the 8K forward and 2.9 GiB after
the 16K forward, 1.5-1.7 GiB after a whole 8K step (stock's allocations in between double it).
glibc's fragmentation is not derived from the allocation sequence: the square is the form that fits
the lengths measured; beyond 8K only stock's OOM kill at 16K under 8 GiB (in the first forward)
bounds it."""
HOST_BLOCK_CACHE_THRESHOLD_BYTES = 64 << 10
"""Smallest host tensor memascend's host block cache serves (``memascend.memory.host_cache.DEFAULT_THRESHOLD_BYTES``,
restated so that planning never loads the cache's C++ op; a test keeps the two equal). With the cache
in force and the malloc policy off, only model-build tensors below it stay in glibc's heap."""
STOCK_STEP_TEMP_BYTES_PER_PARAM = 4
"""Stock's overflow check (``_has_inf_or_nan``: ``x.float()`` of the 16-bit gradient partition) in
bytes per partition element. With the fp32 gradient (4 bytes per sub-group element) it makes the
measured step-phase rise of stock bf16 runs over their between-step RSS, 7.9-8.5 bytes per
partition element (llama-0.1b/0.3b/0.5b, SmolLM2 4 x 256; sub-group = partition there)."""
MEMASCEND_STEP_TEMP_BYTES_PER_SUB_GROUP_NUMEL = 5
"""memascend's step-phase RSS above its between-step level beyond the four swap buffers and the fp32
gradient, per element of the (auto-sized) sub-group: calibrated, 5.0-5.25 in the one-rank bf16
memascend reports (llama-0.1b, SmolLM2, llama-0.3b, llama-0.5b; 7.7-8.2 on two ranks, 4.0 in fp32).
Unlocked memory the step touches per sub-group that the source does not name one buffer for."""
OPTIMIZER_BUFFERS_IN_USE = 4
"""Optimizer swap buffers Adam holds at once under memascend's on-demand manager (param, 2 moments, grad)."""
STAGING_BUFFERS_IN_USE = 2
"""Swap buffers memascend's on-demand manager hands out to stream data through outside the step
(``allocate_all``: at least two): the initial fp32 write-out at construction and the gradient
swap-out during backward. Measured (``phase_peak_locked_bytes``): VmLck in the backward phase is
the param pool plus exactly two sub-group buffers in the memascend reports of SmolLM2 and
llama-0.1b to 1b, in the initialize phase at most that."""

# --- activation model (HF Llama, SDPA, measured with torch.profiler; see activation_parts) ----------
LOGITS_FP32_TENSORS = 3
"""fp32 ``b*s*vocab`` tensors alive at the start of backward: the log-softmax output autograd keeps
for ``cross_entropy``, the NLL gradient and the log-softmax gradient (HF's loss upcasts the logits
to fp32). Measured: 12.0 bytes per vocabulary entry per token, bf16 and fp32 alike."""


TRANSIENT_PHASES = ("initialize", "backward", "step")

# --- the activation swap's host memory (memascend.plan.activation_swap_terms) --------------------
HOST_BLOCK_CACHE_REGION_BYTES = 64 << 20
"""Bytes of a host block cache region (``memascend.memory.host_cache.DEFAULT_REGION_BYTES``, restated
so that planning never loads the cache's C++ op; a test keeps the two equal)."""
HEAP_BYTES_PER_SMALL_SAVED_BYTE = 4.75
"""Resident glibc heap a forward/backward adds per byte of the saved tensors under the host block
cache's threshold (:func:`memascend.plan.activation_swap_terms.small_saved_bytes`): those tensors
and the same ops' small temporaries live in the heap, whose touched pages stay resident until the
malloc policy trims after the step. Calibrated on SmolLM2-135M LoRA rank 16 (all linear layers), bf16
4 x 256, ``--loss-chunk-tokens 256`` (30.1 MiB of small saved tensors): peak RSS minus the RSS before
the first forward minus the cache's peak reserved bytes is 143 MiB with the activation swap (4.75;
148 MiB, 4.91, in a second run) and 162 MiB without it (5.38); the smallest is taken. Calibrated while
the host block cache's threshold was 1 MiB (all of those tensors in the heap); with the cache from
64 KiB the same run peaks at 1105 MiB against 1114 MiB planned (1081 MiB once the swap writes each
storage once). Checked on a second shape, a full fine-tune of ``--from-scratch llama-0.1b --seq-len 1024
--micro-batch 1 --loss-chunk-tokens 256 --swap-activations`` (18.8 MiB of small saved tensors, a term
of 89.5 MiB): 1.339 GiB planned against 1.283 GiB measured (+4.4 %), so the rate was kept; the term
is too small a part of either peak to fit the rate from the peaks alone."""
