"""Are the Linux AIO syscalls DeepSpeed's aio engine needs allowed here (e.g. by a container's seccomp)?

DeepSpeed 0.19.8's ``async_io`` op waits for completions with libaio's ``io_getevents``, which
libaio >= 0.3.111 implements with the ``io_pgetevents`` syscall. A seccomp profile that does not
allow it (found with buildah's default profile here) makes every call fail with ``EPERM``, and
DeepSpeed's completion loop retries forever while its memory grows: ``zero.Init`` hangs in the
parameter swapper's ``synchronize_writes`` (measured in the CPU image: llama-tiny OOM-killed at a
6 GiB cap after ~4 min, versus done in 32 s with seccomp unconfined). :func:`probe_aio_syscalls`
asks the kernel directly (``io_setup``, a zero-timeout ``io_pgetevents``, ``io_destroy``) so a run
can stop with a one-line error instead.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from dataclasses import dataclass

# Syscall numbers: (io_setup, io_destroy, io_pgetevents) per architecture (asm/unistd*.h).
_SYSCALLS = {
    "x86_64": (206, 207, 333),
    "aarch64": (0, 1, 292),
}


@dataclass(frozen=True)
class AioProbe:
    """Outcome of the probe.

    Attributes:
        ok: every probed syscall is allowed (``None``: unknown architecture, not probed).
        detail: what failed (syscall and errno name) or what was checked.
    """

    ok: bool | None
    detail: str


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def probe_aio_syscalls() -> AioProbe:
    """Create an AIO context, poll it once with ``io_pgetevents`` (timeout 0), destroy it."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return AioProbe(None, f"not probed on {platform.machine()}")
    io_setup, io_destroy, io_pgetevents = numbers
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ctx = ctypes.c_ulong(0)
    if libc.syscall(ctypes.c_long(io_setup), ctypes.c_uint(1), ctypes.byref(ctx)) != 0:
        err = ctypes.get_errno()
        return AioProbe(False, f"io_setup failed: {errno.errorcode.get(err, err)} ({os.strerror(err)})")
    try:
        events = (ctypes.c_char * 64)()
        zero = _Timespec(0, 0)
        rc = libc.syscall(ctypes.c_long(io_pgetevents), ctx, ctypes.c_long(0), ctypes.c_long(1), events,
                          ctypes.byref(zero), ctypes.c_void_p(None))
        if rc < 0:
            err = ctypes.get_errno()
            return AioProbe(False, f"io_pgetevents failed: {errno.errorcode.get(err, err)} ({os.strerror(err)})")
    finally:
        libc.syscall(ctypes.c_long(io_destroy), ctx)
    return AioProbe(True, "io_setup, io_pgetevents, io_destroy allowed")


AIO_BLOCKED_FIX = ("allow io_pgetevents in the container's seccomp profile (docker/podman run "
                   "--security-opt seccomp=PROFILE, or seccomp=unconfined), or swap to a raw store "
                   "(--nvme-path /dev/XXX or FILE.store), which does not use DeepSpeed's aio")


def check_aio_syscalls(required: bool = True):
    """Doctor row ``aio syscalls``: PASS when the probe passes, FAIL (with the fix) when the kernel
    or a seccomp profile refuses one, SKIP on an architecture whose numbers are not known.

    Args:
        required: whether the run swaps through DeepSpeed's aio (a swap folder); a raw store
            does not need it.
    """
    from memascend.host.result import CheckResult, Status

    probe = probe_aio_syscalls()
    if probe.ok is None:
        return CheckResult(name="aio syscalls", status=Status.SKIP, detail=probe.detail, required=False)
    if probe.ok:
        return CheckResult(name="aio syscalls", status=Status.PASS, detail=probe.detail, required=required)
    return CheckResult(name="aio syscalls", status=Status.FAIL, detail=probe.detail, fix=AIO_BLOCKED_FIX,
                       required=required)
