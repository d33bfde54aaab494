"""Optimizer sub-groups kept in DRAM (memascend.integrations.deepspeed.optimizer_dram), in process:
which sub-groups the setting keeps, the replaced ``_swappable_optimizer_subgroup``, its patch and
revert, the report, and what a resume across placements reads from a checkpoint's swap copies. The
training runs are in ``test_optimizer_dram_e2e.py``."""

from __future__ import annotations

import json
import types

import pytest
import torch

import memascend.integrations.deepspeed as ma_ds
from memascend.errors import UserError
from memascend.integrations.deepspeed import optimizer_dram
from memascend.integrations.deepspeed.optimizer_dram import (
    KEPT_ATTR,
    dram_report,
    kept_sub_groups,
    make_swappable_optimizer_subgroup,
)


def test_kept_sub_groups_is_the_longest_prefix_that_fits():
    numels = [100, 50, 30, 10]
    assert kept_sub_groups(numels, None) == () and kept_sub_groups(numels, 0) == ()
    assert kept_sub_groups(numels, 99) == ()  # the first does not fit: nothing, not a later one
    assert kept_sub_groups(numels, 100) == (0,)
    assert kept_sub_groups(numels, 179) == (0, 1)  # 180 would take the third
    assert kept_sub_groups(numels, 180) == (0, 1, 2)
    assert kept_sub_groups(numels, 10**12) == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="optimizer_dram_numel"):
        kept_sub_groups(numels, -1)


def _fake_stage3(numels, swap_optimizer=True):
    return types.SimpleNamespace(fp16_partitioned_groups_flat_numel=list(numels), swap_optimizer=swap_optimizer)


def test_replacement_decides_once_and_defers_to_stock_for_the_rest():
    calls = []

    def stock(self, sub_group_id):
        calls.append(sub_group_id)
        return self.swap_optimizer

    method = make_swappable_optimizer_subgroup(stock, 150)
    opt = _fake_stage3([100, 50, 30])
    assert [method(opt, i) for i in range(3)] == [False, False, True]
    assert calls == [2] and opt.__dict__[KEPT_ATTR] == frozenset({0, 1})
    opt.fp16_partitioned_groups_flat_numel[0] = 10**9  # decided once: later sizes change nothing
    assert method(opt, 0) is False and optimizer_dram.kept_by_setting(opt) == frozenset({0, 1})
    cpu = _fake_stage3([100, 50, 30], swap_optimizer=False)  # optimizer not on NVMe: stock decides
    assert [method(cpu, i) for i in range(3)] == [False, False, False] and calls[-3:] == [0, 1, 2]
    assert optimizer_dram.kept_by_setting(cpu) == frozenset()
    assert optimizer_dram.kept_by_setting(object()) == frozenset()
    assert method.__wrapped__ is stock


class _OnDemandManager:
    """What fit_swap_buffers reads of memascend's on-demand swap buffer manager."""

    def __init__(self, num_elems):
        self.num_elems, self.all_buffers, self.window_buffers = num_elems, [], []

    def allocate_window(self, num_elems, count):  # marks the on-demand manager
        raise AssertionError("not called")


def test_swap_buffers_sized_for_the_largest_swapped_sub_group():
    def opt_with(manager, numels=(4096, 1000, 3000)):
        swapper = types.SimpleNamespace(largest_numel=4096, swap_buffer_manager=manager,
                                        _io_aligned_numel=lambda n: -(-n // 512) * 512)
        return types.SimpleNamespace(optimizer_swapper=swapper, fp16_partitioned_groups_flat_numel=list(numels))

    opt = opt_with(_OnDemandManager(4096))
    assert optimizer_dram.fit_swap_buffers(opt, frozenset({0})) == 3072
    assert opt.optimizer_swapper.largest_numel == opt.optimizer_swapper.swap_buffer_manager.num_elems == 3072
    for kept in (frozenset(), frozenset({0, 1, 2}), frozenset({1})):  # nothing kept, all kept, largest swapped
        opt = opt_with(_OnDemandManager(4096))
        assert optimizer_dram.fit_swap_buffers(opt, kept) == 0 and opt.optimizer_swapper.largest_numel == 4096
    busy = _OnDemandManager(4096)
    busy.all_buffers.append(torch.empty(4096))  # already handed out: left as it is
    stock = types.SimpleNamespace(num_elems=4096, all_buffers=[])  # stock's manager locked its buffers
    assert optimizer_dram.fit_swap_buffers(opt_with(busy), frozenset({0})) == 0
    assert optimizer_dram.fit_swap_buffers(opt_with(stock), frozenset({0})) == 0


def _stage3_method():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as S3

    return vars(S3)["_swappable_optimizer_subgroup"]


@pytest.mark.parametrize("dram_numel", [None, 0])
def test_no_patch_without_a_positive_setting(dram_numel):
    before = _stage3_method()
    try:
        ma_ds.apply(ma_ds.MemAscendSettings(optimizer_dram_numel=dram_numel))
        assert _stage3_method() is before
    finally:
        ma_ds.revert()


def test_patch_and_revert_restore_stock_exactly():
    before = _stage3_method()
    try:
        ma_ds.apply(ma_ds.MemAscendSettings(optimizer_dram_numel=1 << 20))
        patched = _stage3_method()
        assert patched is not before and patched.__wrapped__ is before
        assert [r.name for r in ma_ds.patch_records()].count("_swappable_optimizer_subgroup") == 1
    finally:
        ma_ds.revert()
    assert _stage3_method() is before


def test_dram_report_counts_kept_and_small_sub_groups():
    numels = [1024, 512, 2048]
    fp32 = [torch.zeros(1024), torch.zeros(512), torch.empty(0)]
    for t in fp32[:2]:
        t.grad = torch.zeros_like(t)
    state = {fp32[0]: {"step": 3, "exp_avg": torch.zeros(1024), "exp_avg_sq": torch.zeros(1024)},
             fp32[1]: {"step": 3, "exp_avg": torch.zeros(512), "exp_avg_sq": torch.zeros(512)}}
    opt = types.SimpleNamespace(swap_optimizer=True, fp16_partitioned_groups_flat_numel=numels,
                                fp32_partitioned_groups_flat=fp32, optimizer=types.SimpleNamespace(state=state))
    opt.__dict__[KEPT_ATTR] = frozenset({0})
    opt._swappable_optimizer_subgroup = lambda i: i == 2  # 1: below DeepSpeed's min_aio_bytes
    report = dram_report(opt)
    assert report == {"sub_group_numels": numels, "kept_sub_groups": [0], "kept_numel": 1024,
                      "dram_sub_groups": [0, 1], "dram_numel": 1536, "dram_bytes": 1536 * 16, "swapped_numel": 2048}
    assert dram_report(types.SimpleNamespace(swap_optimizer=False)) is None and dram_report(None) is None


def test_swap_files_of_dram_sub_groups_are_recognised():
    opt = types.SimpleNamespace(swap_optimizer=True, _swappable_optimizer_subgroup=lambda i: i != 0,
                                fp32_partitioned_groups_flat=[types.SimpleNamespace(ds_id="1_5"),
                                                              types.SimpleNamespace(ds_id="11_15")])
    skip = optimizer_dram.dram_swap_file_filter(opt)
    assert skip("1_5.tensor.swp") and skip("zero_stage_3/optimizer/rank0/exp_avg-1_5.tensor.swp")
    assert not skip("11_15.tensor.swp") and not skip("exp_avg-11_5.tensor.swp") and not skip("exp_avg-11_15.tensor.swp")
    assert not optimizer_dram.dram_swap_file_filter(types.SimpleNamespace(swap_optimizer=False))("1_5.tensor.swp")


def _engine(swap_folder):
    swapper = types.SimpleNamespace(swap_folder=str(swap_folder))
    return types.SimpleNamespace(local_rank=0, global_rank=0, use_node_local_storage=lambda: False,
                                 optimizer=types.SimpleNamespace(optimizer_swapper=swapper))


def test_checkpoint_swap_copies_are_read_from_the_folder_copy_or_the_export(tmp_path):
    """A swap file is the I/O-aligned buffer (tensor, then padding): the tensor is its first bytes;
    an export file is checked against its manifest's CRC32C."""
    from memascend.integrations.deepspeed.resume_placement import CheckpointSwapFiles
    from memascend.io.errors import ChecksumError
    from memascend.ops import nvme_io

    values = torch.arange(1000, dtype=torch.float32)
    padded = torch.cat([values, torch.full((24,), 7.0)])
    stock = tmp_path / "ck" / "global_step2" / "offloaded_tensors" / "rank00"
    stock.mkdir(parents=True)
    padded.numpy().tofile(stock / "1_5.tensor.swp")
    export = tmp_path / "ck" / "global_step2" / "memascend_store" / "rank00"
    export.mkdir(parents=True)
    padded.numpy().tofile(export / "tensor_000000.bin")
    crc = nvme_io.load().crc32c_bytes(padded.numpy().tobytes(), 0)
    (export / "manifest.json").write_text(json.dumps({"tensors": [
        {"key": "zero_stage_3/optimizer/rank0/exp_avg-1_5.tensor.swp", "file": "tensor_000000.bin",
         "nbytes": 4096, "dtype": "torch.float32", "shape": [1024], "crc32c": crc}]}))
    files = CheckpointSwapFiles(_engine(tmp_path / "key" / "zero_stage_3" / "optimizer" / "rank0"),
                                tmp_path / "ck", "global_step2")
    for name in ("1_5.tensor.swp", "exp_avg-1_5.tensor.swp"):
        out = torch.empty(1000)
        files.read_into(name, out)
        assert torch.equal(out, values)
    with pytest.raises(UserError, match="no copy of the swapped optimizer tensor exp_avg_sq-1_5.tensor.swp"):
        files.read_into("exp_avg_sq-1_5.tensor.swp", torch.empty(1000))
    (export / "tensor_000000.bin").write_bytes(torch.zeros(1024).numpy().tobytes())
    with pytest.raises(ChecksumError):
        CheckpointSwapFiles(_engine(tmp_path / "key" / "zero_stage_3" / "optimizer" / "rank0"), tmp_path / "ck",
                            "global_step2").read_into("exp_avg-1_5.tensor.swp", torch.empty(1000))
