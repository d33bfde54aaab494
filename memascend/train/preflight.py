"""Checks made before DeepSpeed allocates anything, so a host that cannot run the job gets one clear
line instead of a crash deep inside an op (DeepSpeed's aio op segfaults when ``mlock`` fails).

What they check comes from the resolver (:func:`memascend.config.render.resolve`): the rendered DeepSpeed
config and ``ResolvedRun.upfront_locked_bytes`` (:func:`~memascend.config.render.upfront_locked_bytes`)."""

from __future__ import annotations

from memascend.config.ds_defaults import MAX_IN_CPU_NUMEL as DS_DEFAULT_MAX_IN_CPU_NUMEL
from memascend.config.render import per_rank_param_numel
from memascend.errors import UserError
from memascend.host.memlock import check_memlock
from memascend.host.result import HostPaths, Status

__all__ = ["check_aio_for_swap_folder", "check_memlock_for_run", "check_stock_param_dram"]


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
