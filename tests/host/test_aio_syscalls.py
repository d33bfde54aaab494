"""The AIO syscall probe: real syscalls on this host; a refused one gives the one-line preflight error."""

from __future__ import annotations

import platform

import pytest

from memascend.errors import UserError
from memascend.host import aio_syscalls
from memascend.train.preflight import check_aio_for_swap_folder

pytestmark = pytest.mark.skipif(platform.machine() not in aio_syscalls._SYSCALLS,
                                reason=f"syscall numbers not known for {platform.machine()}")


def test_probe_passes_where_deepspeed_aio_works():
    probe = aio_syscalls.probe_aio_syscalls()
    assert probe.ok is True, probe.detail
    check_aio_for_swap_folder()  # no error


def test_refused_syscall_is_reported_with_the_fix(monkeypatch):
    io_setup, io_destroy, _ = aio_syscalls._SYSCALLS[platform.machine()]
    # A syscall number the kernel does not have stands in for one a seccomp filter refuses.
    monkeypatch.setitem(aio_syscalls._SYSCALLS, platform.machine(), (io_setup, io_destroy, 100_000))
    probe = aio_syscalls.probe_aio_syscalls()
    assert probe.ok is False and probe.detail.startswith("io_pgetevents failed: ENOSYS")
    with pytest.raises(UserError, match=r"io_pgetevents failed: ENOSYS.*seccomp") as exc:
        check_aio_for_swap_folder()
    assert "\n" not in str(exc.value)


def test_unknown_architecture_is_not_probed(monkeypatch):
    monkeypatch.setattr(aio_syscalls.platform, "machine", lambda: "riscv128")
    assert aio_syscalls.probe_aio_syscalls().ok is None
    check_aio_for_swap_folder()  # unknown: no error, DeepSpeed decides


def test_doctor_row_fails_with_the_fix_only_where_a_folder_needs_it(monkeypatch):
    from memascend.host.aio_syscalls import check_aio_syscalls
    from memascend.host.result import Status

    assert check_aio_syscalls().status is Status.PASS
    io_setup, io_destroy, _ = aio_syscalls._SYSCALLS[platform.machine()]
    monkeypatch.setitem(aio_syscalls._SYSCALLS, platform.machine(), (io_setup, io_destroy, 100_000))
    row = check_aio_syscalls(required=True)
    assert row.status is Status.FAIL and row.blocks_run and "seccomp" in row.fix
    assert not check_aio_syscalls(required=False).blocks_run  # a raw store does not need it
