"""Runs every host check for one configured run: the library behind ``memascend doctor``.

The same facts the Ansible roles establish (``ansible/roles/*``) are verified here, so a host
provisioned with ``just provision HOST`` passes and an unprovisioned one fails with the fix.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from memascend.config import OffloadConfig, RunConfig, SwapTarget, is_block_device
from memascend.config.render import ModelShape, ResolvedRun, resolve
from memascend.host.aio_syscalls import check_aio_syscalls
from memascend.host.devices import check_device
from memascend.host.extensions import check_build_locks, check_extension, op_names
from memascend.host.gpu import check_cuda, check_gds
from memascend.host.hugepages import check_hugepages
from memascend.host.libraries import check_library
from memascend.host.memlock import check_memlock
from memascend.host.result import CheckResult, HostPaths, Status
from memascend.host.storage import check_nvme_path

BUILTIN_MODEL_NUMEL = 134_515_008
"""Parameters of SmolLM2-135M, the built-in run's model (tied embedding once)."""
BUILTIN_LARGEST_PARAM_NUMEL = 49_152 * 576
"""Elements of its largest parameter, the embedding."""


def builtin_run() -> ResolvedRun:
    """The resolver's view of the built-in run (``memascend finetune`` with every default, one rank),
    without building its model: its NVMe and up-front locked estimates depend only on the parameter
    count and the largest parameter, so a summary shape of the two gives the same numbers as the
    model's own layout."""
    shape = ModelShape(BUILTIN_MODEL_NUMEL, (BUILTIN_LARGEST_PARAM_NUMEL,), (1,))
    return resolve(RunConfig(), shape, world_size=1)


def builtin_lock_bytes() -> int:
    """Bytes the built-in run locks up front: what ``memascend finetune``'s preflight checks
    (``ResolvedRun.upfront_locked_bytes``)."""
    return builtin_run().upfront_locked_bytes


def builtin_nvme_bytes() -> int:
    """NVMe space the built-in run requires (``ResolvedRun.nvme_bytes_per_rank`` of its one rank)."""
    return builtin_run().nvme_bytes_per_rank


def run_needs(cfg: RunConfig, world_size: int = 1) -> ResolvedRun:
    """The resolver's view of the run ``cfg`` describes (its NVMe and up-front locked estimates are
    what ``memascend finetune``'s preflight checks), from the model's meta-device layout.

    Raises:
        UserError: the model cannot be resolved (as ``memascend finetune``).
    """
    from memascend.plan.shapes import model_dims

    dims = model_dims(cfg)
    return resolve(cfg, ModelShape(dims.total_numel, dims.param_numels, dims.module_param_counts), world_size)


@dataclass(frozen=True)
class SwapChecks:
    """What doctor checks of a run's swap target.

    Attributes:
        nvme_path: the swap folder to check (``None``: the run swaps to no folder, or to the
            built-in run's default folder, which finetune creates).
        devices: raw partitions to check: the ``--device`` ones plus the run's block-device target.
        aio_required: whether the run swaps to a folder through DeepSpeed's aio, whose syscalls a
            seccomp profile may refuse (a raw store does not use it).
    """

    nvme_path: Path | None
    devices: tuple[Path, ...]
    aio_required: bool


def swap_target_checks(offload: OffloadConfig | None, devices: Sequence[Path] = (),
                       nvme_path: str | None = None) -> SwapChecks:
    """The swap-target checks of a run, classified as ``memascend finetune`` does
    (:meth:`memascend.config.SwapTarget.of`).

    Args:
        offload: the run's offload section (its ``nvme_path`` already defaults to
            ``$MEMASCEND_NVME_PATH``); ``None`` for the built-in run.
        devices: the ``--device`` partitions given.
        nvme_path: the built-in run's ``--nvme-path``, else ``$MEMASCEND_NVME_PATH`` is taken, as the
            run would (ignored with ``offload``).

    Returns:
        The folder to check and whether the aio syscalls are required when the target is a folder;
        the block devices among the targets added to ``devices``. The built-in run with neither
        path nor ``--device`` swaps to its default folder: aio required, no folder check.
    """
    devices = tuple(devices)
    if offload is not None:
        if not offload.uses_nvme:
            return SwapChecks(None, devices, False)
        target = offload.swap_target
    else:
        given = nvme_path or os.environ.get("MEMASCEND_NVME_PATH")
        if not given:
            return SwapChecks(None, devices, not devices)
        target = SwapTarget.of(given)
    if target.kind == "folder":
        return SwapChecks(Path(target.path), devices, True)
    for part in target.path.split(","):
        if is_block_device(part.strip()) and Path(part.strip()) not in devices:
            devices += (Path(part.strip()),)
    return SwapChecks(None, devices, False)


def check_deepspeed_ops() -> list[CheckResult]:
    """DeepSpeed's compiled ops, as ``ds_report`` lists them (one row each).

    Returns:
        For an op a memascend run loads: PASS when prebuilt or JIT-built already, WARN when the first
        run would build it (minutes), FAIL when DeepSpeed says it cannot be built here. Other ops:
        PASS when built, SKIP otherwise (optional).
    """
    from memascend.integrations.deepspeed.op_report import deepspeed_ops

    try:
        ops = deepspeed_ops()
    except ImportError as exc:
        return [CheckResult(name="deepspeed ops", status=Status.FAIL, detail=f"deepspeed is not importable: {exc}",
                            fix="./install.sh")]
    out = []
    for op in ops:
        built = "prebuilt in the wheel" if op.installed else "JIT-built (cached)" if op.cached else ""
        label = f"deepspeed op {op.name}"
        if built:
            out.append(CheckResult(name=label, status=Status.PASS, detail=built, required=op.used_by_run))
        elif not op.used_by_run:
            state = "compatible" if op.compatible else "not compatible here"
            out.append(CheckResult(name=label, status=Status.SKIP, detail=f"not built, {state}; memascend does not "
                                   "load it", required=False))
        elif op.compatible:
            out.append(CheckResult(name=label, status=Status.WARN, detail="not built; the first run builds it",
                                   fix="python3 -m memascend.integrations.deepspeed.ops_build", required=False))
        else:
            out.append(CheckResult(name=label, status=Status.FAIL, detail="DeepSpeed cannot build it here",
                                   fix="install its build dependencies (libaio-dev for async_io) and run "
                                   "python3 -m memascend.integrations.deepspeed.ops_build"))
    return out


@dataclass(frozen=True, kw_only=True)
class DoctorOptions:
    """What the configured run needs from the host.

    Attributes:
        lock_bytes: bytes the run will mlock (default: :func:`builtin_lock_bytes`).
        devices: raw partitions the run will use as its device store.
        device_user: check device access as this user (``None``: the current process).
        nvme_path: offload folder to check (``None``: skip the folder check).
        aio_required: whether the run swaps through DeepSpeed's aio (a swap folder), so that the
            aio syscall check fails it; ``None``: when ``nvme_path`` is given
            (:func:`swap_target_checks` decides for a run).
        nvme_bytes: NVMe space the run requires under ``nvme_path``, or split over ``devices`` (one
            partition per rank; default: :func:`builtin_nvme_bytes`).
        require_hugepages: whether missing huge pages fail the run instead of warning.
        require_gpu: whether a CUDA device is required; ``None`` = when torch is a CUDA build.
        paths: procfs/sysfs/etc roots (tests point them at fakes).
    """

    lock_bytes: int = field(default_factory=builtin_lock_bytes)
    devices: tuple[Path, ...] = ()
    device_user: str | None = None
    nvme_path: Path | None = None
    aio_required: bool | None = None
    nvme_bytes: int = field(default_factory=builtin_nvme_bytes)
    require_hugepages: bool = False
    require_gpu: bool | None = None
    paths: HostPaths = field(default_factory=HostPaths)


def run_checks(options: DoctorOptions) -> list[CheckResult]:
    """Run all checks in table order.

    Returns:
        One result per check: memlock, hugepages, each device, libaio, liburing, aio syscalls
        (required with an NVMe folder: DeepSpeed's aio swaps there), each memascend op, each
        DeepSpeed op (:func:`check_deepspeed_ops`), build locks, cuda,
        gds, and the NVMe folder when given.
    """
    paths = options.paths
    results = [
        check_memlock(paths, lock_bytes=options.lock_bytes),
        check_hugepages(paths, required=options.require_hugepages),
    ]
    # One partition per rank: the run's NVMe bytes are split over the devices.
    per_device_bytes = -(-options.nvme_bytes // len(options.devices)) if options.devices else None
    results += [
        check_device(dev, paths, user=options.device_user, need_bytes=per_device_bytes) for dev in options.devices
    ]
    results.append(check_library("aio", "libaio.h", required=True))
    results.append(check_library("uring", "liburing.h", required=False))
    aio_required = options.nvme_path is not None if options.aio_required is None else options.aio_required
    results.append(check_aio_syscalls(required=aio_required))
    results += [check_extension(name) for name in op_names()]
    results += check_deepspeed_ops()
    results.append(check_build_locks())
    results.append(check_cuda(paths, required=options.require_gpu))
    results.append(check_gds(paths))
    if options.nvme_path is not None:
        results.append(check_nvme_path(options.nvme_path, need_bytes=options.nvme_bytes))
    return results


def exit_code(results: Sequence[CheckResult]) -> int:
    """1 when any check the run needs failed, else 0."""
    return 1 if any(r.blocks_run for r in results) else 0
