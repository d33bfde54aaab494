"""The run's private swap folder on the NVMe path: checked before the run, removed at exit.

Removal happens in ``finally`` blocks (normal exit, exceptions, Ctrl-C) and on SIGTERM/SIGHUP,
which are turned into :class:`KeyboardInterrupt` so the same unwinding runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

from memascend.errors import UserError
from memascend.host.storage import o_direct_works

# Bytes per parameter on the NVMe path under ZeRO-Infinity with Adam: the 16-bit parameter
# (params offloaded) plus the fp32 master copy, two Adam moments and the fp32 gradient swapped by
# the optimizer swapper (4 x 4 bytes).
OPTIMIZER_NVME_BYTES_PER_PARAM = 16
SPACE_MARGIN = 1.10


def estimate_nvme_bytes(total_numel: int, param_bytes: int, offload_param_nvme: bool, offload_opt_nvme: bool) -> int:
    """Bytes this run will write to the swap folder (upper estimate, with a 10 % margin).

    Args:
        total_numel: model parameters.
        param_bytes: bytes per element of the training dtype (2 for bf16/fp16, 4 for fp32).
    """
    per = (param_bytes if offload_param_nvme else 0) + (OPTIMIZER_NVME_BYTES_PER_PARAM if offload_opt_nvme else 0)
    return int(total_numel * per * SPACE_MARGIN)


def prepare_swap_dir(nvme_path: str, need_bytes: int, run_id: str) -> Path:
    """Create ``<nvme_path>/memascend-<run_id>`` after checking the folder is writable and large enough.

    Raises:
        UserError: the path is not a folder, not writable, refuses O_DIRECT, or lacks ``need_bytes``
            of free space.
    """
    base = Path(nvme_path).expanduser()
    if base.exists() and not base.is_dir():
        raise UserError(f"--nvme-path is not a folder: {nvme_path}")
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --nvme-path {nvme_path}: {exc.strerror}") from None
    if not os.access(base, os.W_OK | os.X_OK):
        raise UserError(f"--nvme-path is not writable: {nvme_path}")
    # DeepSpeed's aio opens every swap file with O_DIRECT; where that is refused its swapper fails
    # deep inside zero.Init with a bare assertion. Probe one block now and say what to do instead.
    refused = o_direct_works(base)
    if refused is not None:
        raise UserError(
            f"--nvme-path {nvme_path} does not take O_DIRECT I/O: {refused}; use a folder on a local "
            "disk filesystem such as ext4 or xfs (in a container: a bind mount or volume, "
            "docker run -v HOST_DIR:/swap ... --nvme-path /swap) or a raw store (a block device or FILE.store)"
        )
    free = shutil.disk_usage(base).free
    if free < need_bytes:
        raise UserError(
            f"--nvme-path {nvme_path} has {free / 2**30:.2f} GiB free; this run needs about "
            f"{need_bytes / 2**30:.2f} GiB for swapped parameters and optimizer state"
        )
    run_dir = base / f"memascend-{run_id}"
    run_dir.mkdir(exist_ok=True)
    return run_dir


def folder_bytes(path: Path) -> int:
    """Allocated bytes of the files under ``path`` (0 if it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def remove_swap_dir(path: Path | None) -> None:
    """Remove the run's swap folder (idempotent; never raises)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def make_run_id() -> str:
    """Unique across launches; rank 0 makes it and broadcasts it to the other ranks."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


class TerminationAsInterrupt:
    """Context manager: SIGTERM/SIGHUP raise KeyboardInterrupt so ``finally`` cleanup runs."""

    def __enter__(self):
        self._old = {}
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                pass
        return self

    @staticmethod
    def _handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        return False
