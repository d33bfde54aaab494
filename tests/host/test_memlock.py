from memascend.host import Status
from memascend.host.memlock import (
    CAP_IPC_LOCK_BIT,
    check_memlock,
    read_memlock_limit_bytes,
)

GIB = 1 << 30


def test_low_limit_without_capability_fails_with_fix(fake_host):
    fake_host.set_limits("8388608", "8388608")
    result = check_memlock(fake_host.paths, lock_bytes=2 * GIB)
    assert result.status is Status.FAIL and result.blocks_run
    assert "8.00 MiB" in result.detail and "2.00 GiB" in result.detail
    assert "memlock" in result.fix and "--ulimit memlock=-1" in result.fix


def test_capability_lifts_low_limit(fake_host):
    fake_host.set_caps(1 << CAP_IPC_LOCK_BIT)
    result = check_memlock(fake_host.paths, lock_bytes=2 * GIB)
    assert result.status is Status.PASS and "CAP_IPC_LOCK" in result.detail


def test_other_capabilities_do_not_count(fake_host):
    fake_host.set_caps(~(1 << CAP_IPC_LOCK_BIT) & (1 << 40) - 1)
    assert check_memlock(fake_host.paths, lock_bytes=2 * GIB).status is Status.FAIL


def test_unlimited_and_large_enough_limits_pass(fake_host):
    fake_host.set_limits("unlimited", "unlimited")
    assert read_memlock_limit_bytes(fake_host.paths) == (-1, -1)
    assert check_memlock(fake_host.paths, lock_bytes=100 * GIB).status is Status.PASS
    fake_host.set_limits(str(4 * GIB), str(8 * GIB))
    assert check_memlock(fake_host.paths, lock_bytes=4 * GIB).status is Status.PASS
    assert check_memlock(fake_host.paths, lock_bytes=4 * GIB + 1).status is Status.FAIL


def test_missing_limits_file_fails(fake_host):
    (fake_host.paths.proc / "self" / "limits").unlink()
    assert check_memlock(fake_host.paths, lock_bytes=1).status is Status.FAIL
