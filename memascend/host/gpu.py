"""Doctor checks: torch's CUDA, the NVIDIA driver, and GPUDirect Storage.

The driver is found through ``<proc>/driver/nvidia/version`` (present whenever the kernel module
is loaded, also inside a container started with ``--gpus``) or ``nvidia-smi``; GPUDirect Storage
(cuFile) needs the ``nvidia_fs`` kernel module and a ``cufile.json``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from memascend.host.result import CheckResult, HostPaths, Status, read_text

FIX_DRIVER = (
    "install the NVIDIA driver (role gpu_runtime checks it); in a container start it with `--gpus all` "
    "and the NVIDIA container toolkit"
)


def driver_version(paths: HostPaths) -> str | None:
    """The NVIDIA kernel driver version, from procfs or ``nvidia-smi``; ``None`` when there is no driver."""
    text = read_text(paths.proc / "driver" / "nvidia" / "version")
    if text:
        for token in text.split():
            if token[:1].isdigit() and token.count(".") >= 1:
                return token
        return text.splitlines()[0].strip()
    smi = shutil.which("nvidia-smi")
    if smi and paths.proc == Path("/proc"):
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        return out.splitlines()[0] if out else None
    return None


def check_cuda(paths: HostPaths, *, required: bool | None = None) -> CheckResult:
    """Whether torch can use a CUDA device through an NVIDIA driver.

    Args:
        paths: procfs root for the driver version.
        required: whether the run needs a GPU; ``None`` means "when torch is a CUDA build"
            (a CPU-only install trains on the CPU accelerator).

    Returns:
        PASS with the device count; SKIP on a CPU-only torch that is not required to have CUDA;
        FAIL when CUDA is required but torch, the driver or the devices are missing.
    """
    import torch

    cuda_build = torch.version.cuda
    needed = bool(cuda_build) if required is None else required
    driver = driver_version(paths)
    driver_text = f"driver {driver}" if driver else "no NVIDIA driver"
    if not cuda_build:
        return CheckResult(
            name="cuda",
            status=Status.FAIL if needed else Status.SKIP,
            detail=f"torch {torch.__version__} is a CPU-only build; {driver_text}",
            fix="install a CUDA build of torch==2.13.0 (or use the memascend cuda image)" if needed else "",
            required=needed,
        )
    if driver is None:
        return CheckResult(
            name="cuda",
            status=Status.FAIL if needed else Status.WARN,
            detail=f"torch {torch.__version__} (CUDA {cuda_build}); {driver_text}",
            fix=FIX_DRIVER,
            required=needed,
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return CheckResult(
            name="cuda",
            status=Status.FAIL if needed else Status.WARN,
            detail=f"torch {torch.__version__} (CUDA {cuda_build}); {driver_text}; no usable device",
            fix="check `nvidia-smi`; the driver must be at least as new as CUDA " + cuda_build,
            required=needed,
        )
    names = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(count)}))
    return CheckResult(
        name="cuda",
        status=Status.PASS,
        detail=f"torch {torch.__version__} (CUDA {cuda_build}); {driver_text}; {count} x {names}",
        required=needed,
    )


def check_gds(paths: HostPaths) -> CheckResult:
    """Whether GPUDirect Storage is set up: ``nvidia_fs`` loaded and a ``cufile.json`` present (optional).

    Returns:
        PASS when both are there, WARN otherwise (memascend then stages through pinned host memory).
    """
    modules = read_text(paths.proc / "modules") or ""
    loaded = (
        any(line.split()[:1] == ["nvidia_fs"] for line in modules.splitlines())
        or (paths.sys / "module" / "nvidia_fs").is_dir()
    )
    env_json = os.environ.get("CUFILE_ENV_PATH_JSON")
    config = Path(env_json) if env_json else paths.etc / "cufile.json"
    parts = [
        f"nvidia_fs {'loaded' if loaded else 'not loaded'}",
        f"{config} {'present' if config.is_file() else 'missing'}",
    ]
    if loaded and config.is_file():
        return CheckResult(name="gds", status=Status.PASS, detail="; ".join(parts), required=False)
    return CheckResult(
        name="gds",
        status=Status.WARN,
        detail="; ".join(parts) + " (transfers stage through pinned host memory)",
        fix="optional: install nvidia-gds (nvidia_fs module and /etc/cufile.json) for GPUDirect Storage",
        required=False,
    )
