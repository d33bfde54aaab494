"""The limits a regression matrix holds memascend to: ratios against stock DeepSpeed measured in the same run.

Each :class:`Thresholds` is one set of limits (peak RSS, locked memory, step time with its noise
allowance, losses, swap bytes per step); the named constants are the targets of the matrices in
:mod:`memascend.regress.matrix` (the memory core's, the speed rows', the chunked step's, LoRA's, the
scaling search's), each with the reason for its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Thresholds:
    """Limits of memascend/baseline ratios measured in the same run.

    Attributes:
        max_peak_rss_ratio: memascend peak host RSS / baseline peak host RSS (sum over ranks; with
            ``BenchConfig.nnodes`` > 1 over the ranks of the largest node); ``None``: reported, not
            checked (a ``host_memory_budget`` of ``"auto"``, bounded by what the host gives).
        max_peak_locked_ratio: memascend peak locked (VmLck) / baseline's (summed as RSS);
            ``None``: not checked (e.g. a baseline that locks nothing).
        max_step_time_ratio: memascend median steady step time / baseline's.
        step_time_noise: absolute allowance added to ``max_step_time_ratio`` for a noisy host.
        bitwise_losses: per-step losses must be bit-for-bit equal (else within ``loss_rtol``).
        loss_rtol: relative tolerance of per-step losses when ``bitwise_losses`` is false.
        max_swap_bytes_ratio: memascend's median swap-target bytes per step (read + written, rank 0,
            ``report["swap_io"]``) / baseline's; ``None``: not checked.
    """

    max_peak_rss_ratio: float | None = 0.40
    max_peak_locked_ratio: float | None = 0.25
    max_step_time_ratio: float = 1.05
    step_time_noise: float = 0.15
    bitwise_losses: bool = True
    loss_rtol: float = 0.0
    max_swap_bytes_ratio: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_peak_rss_ratio", "max_step_time_ratio"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.step_time_noise < 0 or self.loss_rtol < 0:
            raise ValueError("step_time_noise and loss_rtol must be >= 0")


SMOLLM2_THRESHOLDS = Thresholds()
"""The memory core's targets for SmolLM2-135M: RSS <= 40 %, locked <= 25 %, step time <= 1.05x (+ noise), bitwise losses."""

LORA_THRESHOLDS = Thresholds(max_step_time_ratio=1.5)
"""LoRA rows: the memory core's targets; step time up to 1.5x, since memascend swaps the activations
(their bytes written and read back every step, where stock keeps them in DRAM)."""

LLAMA_1B_THRESHOLDS = Thresholds(max_peak_rss_ratio=0.45, max_peak_locked_ratio=0.25)
"""The memory core's target for a ~1B from-scratch Llama: RSS <= 45 %, same loss per step."""

LLAMA_1B_TUNED_THRESHOLDS = Thresholds(max_peak_rss_ratio=0.45, max_peak_locked_ratio=1.0)
"""The ~1B target (RSS <= 45 %, same loss per step) against stock tuned to fit the host
(``sub_group_size`` 1e8): stock's optimizer then locks 4 x 1e8 fp32 elements instead of 4 x 1e9, and
memascend's sub-groups are about as large, so locked memory is only held to at most stock's."""

SMOKE_THRESHOLDS = Thresholds(max_peak_rss_ratio=0.50, max_peak_locked_ratio=0.25, max_step_time_ratio=1.30,
                              step_time_noise=0.20)
"""The smoke matrix is a regression gate, not the memory core's targets (which ``cpu-full``'s
``smollm2-shakespeare-bf16-256x4``, the default job's exact configuration, checks with
:data:`SMOLLM2_THRESHOLDS`). Its shapes are cut to 2 x 128 tokens so that eight runs fit in minutes,
which leaves less activation memory to save, and two ranks each pay the framework's fixed RSS.
Step time: memascend hands memory back between phases and touches it again, and on the 2-core
virtual machine of profile cpu-2c-24g a page fault costs about 0.75 s per GiB (measured with a
1 GiB first-touch loop), so the RSS-first defaults run 1.1-1.35x the baseline there."""

SMALL_MODEL_THRESHOLDS = Thresholds(max_peak_rss_ratio=0.80, max_peak_locked_ratio=0.50)
"""Models far below 135M parameters: the framework's fixed RSS dominates, so only a looser bound
holds (no issue gives a number; these points are for the scaling fit, not the promise)."""


SCALING_SEARCH_THRESHOLDS = Thresholds(max_peak_rss_ratio=1.0, max_peak_locked_ratio=1.0, max_step_time_ratio=2.0,
                                       step_time_noise=0.25)
"""The capped scaling search (matrix ``scaling``) asks which model fits, not the memory core's ratios (``cpu-full``
checks those on the same configurations): where both engines fit it gates correctness (bit-for-bit
losses, same parameter dtype) and gross regressions only: memascend must not need more host memory
or locked memory than stock, nor take more than 2x its step time (+0.25 for a noisy host; medians of
two steady steps)."""


CHUNKING_THRESHOLDS = Thresholds(max_peak_rss_ratio=1.05, max_peak_locked_ratio=None, max_step_time_ratio=1.15,
                                 step_time_noise=0.0)
"""The chunked step's step-time target against :data:`UNCHUNKED_SETTINGS`: at most 1.15x (no noise allowance: run
with ``--repeats``, the medians of alternating pairs), bit-identical losses, peak RSS no more than
5 % over. Locked memory is not held to the unchunked step's: on a model whose largest sub-group
is a few chunks (SmolLM2) the read-ahead's second chunk-buffer set locks more than the whole
sub-group buffers it replaces (the memory targets are ``scaling``'s and ``cpu-full``'s)."""


SPEED_THRESHOLDS = Thresholds(max_peak_rss_ratio=0.40, max_peak_locked_ratio=None, max_step_time_ratio=0.80,
                              step_time_noise=0.0)
"""The speed targets at the default host-memory budget: step time at most 0.80x stock's with peak RSS at
most 0.40x, bit-identical losses. No noise allowance: run with ``--repeats`` (medians of alternating
pairs) on a quiet machine. Locked memory is not held to a ratio here (the memory matrices do)."""


BUDGET_SPEED_THRESHOLDS = Thresholds(max_peak_rss_ratio=1.0, max_peak_locked_ratio=None, max_step_time_ratio=0.60,
                                     step_time_noise=0.0, max_swap_bytes_ratio=0.30)
"""The speed targets with a host-memory budget equal to stock's peak RSS: what stock's host memory
buys when memascend spends it as a DRAM cache (``--host-memory-budget``): step time at most 0.60x
stock's, swap bytes per step at most 0.30x, peak RSS within the budget (at most stock's), bit-identical
losses."""

REPORTED_SPEED_THRESHOLDS = Thresholds(max_peak_rss_ratio=1.0, max_peak_locked_ratio=None, max_step_time_ratio=1.05)
"""Rows whose step time is reported against stock without a target of their own (a budget's
placement on a model whose optimizer state does not fit it): RSS at most stock's, the usual step-time
ceiling with its noise allowance, bit-identical losses."""

AUTO_SPEED_THRESHOLDS = Thresholds(max_peak_rss_ratio=None, max_peak_locked_ratio=None, max_step_time_ratio=0.70,
                                   step_time_noise=0.0)
"""``host_memory_budget: "auto"``: what this host (or the run's memory cap) can give, spent as a DRAM
cache: step time at most 0.70x stock's, bit-identical losses; peak RSS reported (bounded by the
budget the run resolves, not by stock's)."""
