"""StoreSwapHandle used the way DeepSpeed's swap_tensor/utils.py uses an aio handle."""

from __future__ import annotations

import pytest
import torch

from memascend.integrations.deepspeed.swap_backend import StoreSwapHandle
from memascend.io.errors import ChecksumError
from memascend.io.store import TensorStore

MiB = 1 << 20


@pytest.fixture()
def store_path(tmp_path):
    """Path of a store file that does not exist yet (TensorStore.create preallocates it)."""
    return tmp_path / "store.bin"


def test_swap_out_and_in_like_deepspeed(store_path):
    with TensorStore.create(store_path, size_bytes=16 * MiB, request_bytes=256 << 10) as store:
        write_h, read_h = StoreSwapHandle(store), StoreSwapHandle(store)
        params = {
            f"/nvme/zero_stage_3/bfloat16params/rank0/{i}_param.tensor.swp": torch.randn(
                1000 + 37 * i
            ).bfloat16()
            for i in range(12)
        }
        for path, t in params.items():
            assert write_h.async_pwrite(t, path, 0) == 0  # swap_out_tensors asserts this
        assert write_h.wait() == len(params)
        assert write_h.wait() == 0
        # reads land in larger aligned swap buffers, as the param swapper's are
        bufs = {p: write_h.new_cpu_locked_tensor(2048 + 64, t) for p, t in params.items()}
        for p, b in bufs.items():
            assert b.dtype == torch.bfloat16 and b.data_ptr() % 4096 == 0
            assert read_h.async_pread(b, p, 0) == 0
        assert read_h.wait() == len(params)
        for p, t in params.items():
            assert torch.equal(bufs[p][: t.numel()], t)
        assert read_h.get_alignment() == 4096 and read_h.get_queue_depth() == store.engine.queue_depth
        first = next(iter(params))
        used = store.used_bytes
        write_h.free(first)
        assert store.used_bytes < used and first not in store
        with pytest.raises(KeyError):
            read_h.async_pread(bufs[first], first)
        with pytest.raises(ValueError, match="file_offset"):
            write_h.async_pwrite(params[first], first, 4096)


def test_wait_raises_checksum_error_after_draining(store_path):
    with TensorStore.create(store_path, size_bytes=8 * MiB) as store:
        h = StoreSwapHandle(store)
        assert h.sync_pwrite(torch.ones(5000), "a") == 1
        assert h.sync_pwrite(torch.ones(5000), "b") == 1
        rec = store.record("a")
        with open(store_path, "r+b") as f:
            f.seek(rec.offset_bytes)
            f.write(b"\x01\x02")
        out_a, out_b = torch.empty(5000), torch.empty(5000)
        h.async_pread(out_a, "a")
        h.async_pread(out_b, "b")
        with pytest.raises(ChecksumError, match="tensor 'a' at device offset"):
            h.wait()
        assert torch.equal(out_b, torch.ones(5000))  # the other read still completed
        assert h.wait() == 0


def _vmlck_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmLck:"):
            return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/self/status")


@pytest.mark.parametrize("lock_buffers", [False, True])
def test_handle_buffers_locked_as_stock_only_when_asked(store_path, lock_buffers):
    """lock_buffers (the baseline engine on a raw target) page-locks new_cpu_locked_tensor's buffers
    as stock's aio handle does, and free_cpu_locked_tensor unlocks them; without it nothing is locked."""
    import resource

    from memascend.host.memlock import has_cap_ipc_lock
    from memascend.host.result import HostPaths

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if lock_buffers and soft != resource.RLIM_INFINITY and soft < 64 * MiB and not has_cap_ipc_lock(HostPaths()):
        pytest.skip(f"memlock limit {soft} bytes, no CAP_IPC_LOCK: cannot lock the 8 MiB buffer")
    with TensorStore.create(store_path, size_bytes=16 * MiB) as store:
        handle = StoreSwapHandle(store, lock_buffers=lock_buffers)
        before = _vmlck_kib()
        buf = handle.new_cpu_locked_tensor(4 * MiB, torch.empty(0, dtype=torch.float16))  # 8 MiB
        assert buf.numel() == 4 * MiB and buf.data_ptr() % 4096 == 0
        held = _vmlck_kib() - before
        assert held == (8 * 1024 if lock_buffers else 0)
        assert handle.is_pinned(buf[10:20])
        assert handle.free_cpu_locked_tensor(buf)
        assert _vmlck_kib() == before
