"""Checks made before DeepSpeed allocates anything, so a host that cannot run the job gets one clear
line instead of a crash deep inside an op (DeepSpeed's aio op segfaults when ``mlock`` fails): the
training dtype, ``--output``, the model's meta-device shape, the memlock limit, the kernel's AIO
syscalls, stock's pinned parameter elements, DeepSpeed's ops built for another accelerator with no
compiler to rebuild them.

What they check comes from the resolver (:func:`memascend.config.render.resolve`): the rendered DeepSpeed
config and ``ResolvedRun.upfront_locked_bytes`` (:func:`~memascend.config.render.upfront_locked_bytes`)."""

from __future__ import annotations

import os
from pathlib import Path

from memascend.config.ds_defaults import MAX_IN_CPU_NUMEL as DS_DEFAULT_MAX_IN_CPU_NUMEL
from memascend.config.render import model_shape, per_rank_param_numel
from memascend.errors import UserError
from memascend.host.memlock import check_memlock
from memascend.host.result import HostPaths, Status

__all__ = ["check_aio_for_swap_folder", "check_deepspeed_ops_loadable", "check_dtype_supported", "check_memlock_for_run", "check_output_dir",
           "check_stock_param_dram", "meta_shape"]


def check_deepspeed_ops_loadable() -> None:
    """Stops a run whose DeepSpeed ops cannot load: the wheel's ops were prebuilt for another accelerator
    (:func:`~memascend.integrations.deepspeed.op_report.prebuilt_for_other_accelerator`: the CUDA image
    on a host where no GPU is visible) and no C++ compiler (``$CXX``, else ``c++``) is here for
    DeepSpeed's JIT build of them for the accelerator in use. Call before the process group (the CPU
    accelerator's collectives load an op).

    Raises:
        UserError: the ops were built for another accelerator and nothing can rebuild them.
    """
    import shutil

    from memascend.integrations.deepspeed.op_report import prebuilt_for_other_accelerator

    mismatch = prebuilt_for_other_accelerator()
    if mismatch is None or shutil.which(os.environ.get("CXX") or "c++"):
        return
    built_for, running_on = mismatch
    raise UserError(
        f"DeepSpeed's ops here were built for the {built_for} accelerator, but DeepSpeed runs on {running_on} "
        f"(no {built_for.upper()} device visible) and there is no C++ compiler to build them for it; give the "
        f"container the GPUs (docker run --gpus all ...) or use the CPU image (memascend:cpu)")


def check_dtype_supported(dtype: str, device_type: str) -> None:
    """Raise when the accelerator cannot train in ``dtype``.

    Raises:
        UserError: fp16 or bf16 unsupported on this device; names the alternatives.
    """
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if dtype == "fp16" and not acc.is_fp16_supported():
        raise UserError(f"--dtype fp16 is not supported on this device ({device_type}); use bf16 or fp32")
    if dtype == "bf16" and not acc.is_bf16_supported():
        raise UserError(f"--dtype bf16 is not supported on this device ({device_type}); use fp16 or fp32")


def check_output_dir(out_dir: Path) -> None:
    """Fail early if ``--output`` cannot be created or written (without creating anything).

    Raises:
        UserError: ``out_dir`` lies inside a file, or its nearest existing folder is not writable.
    """
    probe = out_dir.resolve()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"--output is inside a file, not a folder: {out_dir}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"--output is not writable: {out_dir}")


def meta_shape(src, cfg):
    """Parameter layout (:class:`memascend.config.render.ModelShape`) of the run's model (``src``: its
    resolved source; ``cfg``: the :class:`~memascend.config.RunConfig`) from a meta-device instance
    (no memory, no weights read).

    Raises:
        UserError: transformers has no causal LM for the model's config; LoRA settings the model refuses
            (:func:`memascend.models.lora.apply_lora`).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memascend.models.loading import from_scratch_config

    try:
        hf_cfg = from_scratch_config(cfg.model.from_scratch) if cfg.model.from_scratch else AutoConfig.from_pretrained(src.hf_dir)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(hf_cfg)
    except (ValueError, KeyError, OSError) as exc:  # an architecture transformers has no causal LM for
        raise UserError(
            f"model {src.origin}: no causal-LM model can be built from its config.json "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from None
    if cfg.lora.enabled:  # the adapters' targets and rank checked here, before anything heavy
        from memascend.models.lora import apply_lora

        meta = apply_lora(meta, cfg.lora, origin=src.origin)
    return model_shape(meta)


def check_memlock_for_run(lock_bytes: int, paths: HostPaths | None = None) -> None:
    """Raise when ``RLIMIT_MEMLOCK`` (without ``CAP_IPC_LOCK``) is below ``lock_bytes``.

    Raises:
        UserError: naming the limit, the need and the fix.
    """
    if lock_bytes <= 0:
        return
    result = check_memlock(paths or HostPaths(), lock_bytes=lock_bytes)
    if result.status == Status.FAIL:
        raise UserError(f"memlock limit too low: {result.detail}; {result.fix}")


def check_aio_for_swap_folder() -> None:
    """Raise when the kernel refuses the AIO syscalls DeepSpeed's aio needs (e.g. a container's
    seccomp profile blocks ``io_pgetevents``): DeepSpeed would otherwise hang in its first swap-out.

    Raises:
        UserError: naming the failed syscall and the fix.
    """
    from memascend.host.aio_syscalls import AIO_BLOCKED_FIX, probe_aio_syscalls

    probe = probe_aio_syscalls()
    if probe.ok is False:
        raise UserError(f"NVMe swapping through DeepSpeed's aio is impossible here: {probe.detail}; {AIO_BLOCKED_FIX}")


def check_stock_param_dram(ds_cfg: dict, param_numels: list[int], world_size: int) -> None:
    """Refuse a stock (``--engine baseline``) run that DeepSpeed 0.19.8 would crash in its second step.

    With the parameters on NVMe, stock keeps the 16-bit copy of the first ``offload_param.max_in_cpu``
    parameter elements per rank in pinned DRAM (``DeepSpeedZeroOptimizer_Stage3
    ._create_param_groups_fp16_flat_cpu_memory``); once some sub-group lies past it, the parameter
    swapper runs out of buffers in the second step's forward pass ("Not enough swap in buffers 0 for
    1 params", whatever ``buffer_count``: measured with 5, 8 and 16 on llama-0.1b,
    tests/integrations/test_nvme_only_sub_group.py). memascend's pool does not.

    ``memascend finetune --engine baseline`` raises ``max_in_cpu`` itself when the config leaves it
    out (``memascend.config.render._derive_stock_max_in_cpu``), so this refuses an explicit value that is too small.

    Args:
        ds_cfg: the rendered DeepSpeed config.
        param_numels: elements of every trainable parameter (tied weights once).
        world_size: ranks partitioning each parameter.

    Raises:
        UserError: the parameter elements per rank exceed ``max_in_cpu``; names both and the fix.
    """
    op = ds_cfg.get("zero_optimization", {}).get("offload_param", {}) or {}
    if op.get("device") != "nvme":
        return
    max_in_cpu = int(op.get("max_in_cpu", DS_DEFAULT_MAX_IN_CPU_NUMEL))
    per_rank_numel = per_rank_param_numel(param_numels, world_size)
    if per_rank_numel > max_in_cpu:
        raise UserError(
            f"stock DeepSpeed 0.19.8 crashes in step 2 on this model ('Not enough swap in buffers'): its "
            f"{per_rank_numel:,} parameter elements per rank exceed zero_optimization.offload_param.max_in_cpu "
            f"({max_in_cpu:,}); set max_in_cpu to at least {per_rank_numel} in --deepspeed-config (that many "
            f"16-bit elements stay pinned in DRAM), or use --engine memascend")
