"""apply_raw_store/revert: DeepSpeed's swappers get store-backed handles; revert restores
DeepSpeed exactly; a DeepSpeed swap path round-trips through the store under a run-independent key."""

from __future__ import annotations

import importlib

import pytest
import torch

import memascend.integrations.deepspeed as seam
from memascend.integrations.deepspeed import raw_store
from memascend.integrations.deepspeed.swap_backend import StoreSwapHandle
from memascend.io.errors import DeviceRefusedError

MiB = 1 << 20

_MODULES = [importlib.import_module(name) for name in raw_store._BUILDER_MODULES]


def _snapshot():
    from deepspeed.runtime.engine import DeepSpeedEngine

    snap = {(m.__name__, "AsyncIOBuilder"): m.__dict__["AsyncIOBuilder"] for m in _MODULES}
    for cls, name in ((DeepSpeedEngine, "save_checkpoint"), (DeepSpeedEngine, "load_checkpoint")):
        snap[(cls.__qualname__, name)] = cls.__dict__[name]
    return snap


@pytest.fixture()
def applied(tmp_path):
    handle = seam.apply_raw_store(tmp_path / "r.store", world_rank=0, size_bytes=32 * MiB)
    try:
        yield handle
    finally:
        seam.revert()


def test_revert_restores_deepspeed_exactly(tmp_path):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    before = _snapshot()
    handle = seam.apply_raw_store(tmp_path / "r.store", world_rank=0, size_bytes=32 * MiB)
    during = _snapshot()
    assert all(during[k] is not before[k] for k in before)
    assert len(seam.patch_records()) == len(before)
    assert seam.active_raw_store() is handle
    seam.revert()
    after = _snapshot()
    assert all(after[k] is before[k] for k in before)
    assert all(m.AsyncIOBuilder is AsyncIOBuilder for m in _MODULES)
    assert seam.patch_records() == () and seam.active_raw_store() is None
    assert not (tmp_path / "r.store").exists() and not handle.key_root.exists()
    seam.revert()  # idempotent
    assert seam.patch_records() == () and seam.active_raw_store() is None


def test_swapper_builder_gives_store_handles(applied):
    from deepspeed.runtime.swap_tensor import partitioned_param_swapper as pps

    aio = pps.AsyncIOBuilder().load(verbose=False).aio_handle
    h = aio(block_size=MiB, queue_depth=8, single_submit=False, overlap_events=True, intra_op_parallelism=1)
    assert isinstance(h, StoreSwapHandle) and h.get_block_size() == MiB and h.get_queue_depth() == 8
    path = applied.key_root / "zero_stage_3" / "bfloat16params" / "rank0" / "7_param.tensor.swp"
    buf = h.new_cpu_locked_tensor(MiB, torch.empty(0, dtype=torch.bfloat16))
    assert h.is_pinned(buf) and h.is_pinned(buf.narrow(0, 10, 100)) and not h.is_pinned(torch.empty(10))
    src = torch.randn(MiB).bfloat16()
    buf.copy_(src)
    assert h.async_pwrite(buf, str(path), 0) == 0 and h.wait() == 1
    assert applied.store.keys() == ["zero_stage_3/bfloat16params/rank0/7_param.tensor.swp"]
    assert not path.exists()  # no swap file on the filesystem
    out = h.new_cpu_locked_tensor(MiB + 1024, buf)
    assert h.async_pread(out, str(path), 0) == 0 and h.wait() == 1
    assert torch.equal(out[:MiB], src)
    assert h.free_cpu_locked_tensor(out) and not h.is_pinned(out)


def test_checkpoint_export_import_by_relative_key(applied, tmp_path):
    h = applied.new_aio_handle()
    opt_dir = applied.key_root / "zero_stage_3" / "optimizer" / "rank0"
    tensors = {name: torch.randn(300_000) for name in ("0_19.tensor.swp", "exp_avg-0_19.tensor.swp",
                                                        "0_gradient_0_300000.tensor.swp")}
    for name, t in tensors.items():
        h.sync_pwrite(t, str(opt_dir / name))
    h.sync_pwrite(torch.randn(1000), str(applied.key_root / "zero_stage_3" / "bfloat16params" / "x.swp"))
    applied.export_checkpoint(tmp_path / "ck" / "tag", opt_dir)
    rank_dir = raw_store.checkpoint_rank_dir(tmp_path / "ck" / "tag", 0)
    import json

    keys = sorted(e["key"] for e in json.loads((rank_dir / "manifest.json").read_text())["tensors"])
    assert keys == ["zero_stage_3/optimizer/rank0/0_19.tensor.swp", "zero_stage_3/optimizer/rank0/exp_avg-0_19.tensor.swp"]
    h.sync_pwrite(torch.zeros(300_000), str(opt_dir / "0_19.tensor.swp"))
    assert sorted(applied.import_checkpoint(rank_dir)) == keys
    out = torch.empty(300_000)
    h.sync_pread(out, str(opt_dir / "0_19.tensor.swp"))
    assert torch.equal(out, tensors["0_19.tensor.swp"])


def test_second_apply_refused_and_foreign_store_refused(applied, tmp_path):
    from memascend.errors import UserError

    with pytest.raises(UserError, match="already applied"):
        seam.apply_raw_store(tmp_path / "b.store", world_rank=0, size_bytes=32 * MiB)
    seam.revert()
    from memascend.io.store import TensorStore

    TensorStore.create(tmp_path / "foreign.store", size_bytes=16 * MiB).close()
    before = (tmp_path / "foreign.store").read_bytes()
    with pytest.raises(DeviceRefusedError, match="memascend store header"):
        seam.apply_raw_store(tmp_path / "foreign.store", world_rank=0, size_bytes=32 * MiB)
    assert (tmp_path / "foreign.store").read_bytes() == before
    assert seam.patch_records() == ()
