"""The chunked build of the fp32 master weights (memascend.integrations.deepspeed.chunked_init).

In process: a stage-3 optimizer stand-in (stock's ``PartitionedOptimizerSwapper`` with memascend's
on-demand manager, 16-bit partitions in swap files and in DRAM at unaligned offsets) is built
through a window of a few thousand elements; every sub-group's fp32 file holds the partitions
widened, as stock's ``_swap_in_sub_group_to_flat_buffer`` + ``initialize_parameters`` write them,
and a sub-group kept in DRAM is stock's tensor. Where it does not apply, stock's method runs.
Against stock DeepSpeed itself (``slow``, one process per engine): a tiny Llama's fp32 swap files
are byte for byte stock's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from memascend.config.settings import MemAscendSettings  # noqa: E402
from memascend.integrations.deepspeed import chunked_init  # noqa: E402
from memascend.integrations.deepspeed.optimizer_swapper import make_swap_buffer_manager_class  # noqa: E402

WINDOW = 4096
"""Window elements (the chunk): every sub-group below spans several windows."""
AIO = {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True,
       "intra_op_parallelism": 1}
WORKER = Path(__file__).with_name("chunked_init_worker.py")


pytestmark = pytest.mark.usefixtures("single_rank")  # conftest: get_rank() is 0


class _ParamSwapper:
    """The parts of ``AsyncPartitionedParameterSwapper`` the build reads through: 16-bit partition
    files of ``_io_aligned_numel`` elements, written here."""

    def __init__(self, folder: Path) -> None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        self.dtype = torch.bfloat16
        self.numel_alignment = 1024 // 2
        self.aio_read_handle = AsyncIOBuilder().load(verbose=False).aio_handle(
            AIO["block_size"], AIO["queue_depth"], AIO["single_submit"], AIO["overlap_events"],
            AIO["intra_op_parallelism"])
        self.folder = folder
        self.paths: dict[str, str] = {}
        self.synced = 0

    def _io_aligned_numel(self, numel: int) -> int:
        return -(-numel // self.numel_alignment) * self.numel_alignment

    def write(self, param, values: torch.Tensor) -> None:
        padded = torch.zeros(self._io_aligned_numel(values.numel()), dtype=self.dtype)
        padded[: values.numel()] = values
        path = self.folder / f"{param.ds_id}_param.tensor.swp"
        path.write_bytes(padded.view(torch.int16).numpy().tobytes())
        self.paths[param.ds_id] = str(path)

    def get_path(self, param, must_exist: bool = False) -> str:
        assert must_exist
        return self.paths[param.ds_id]

    def synchronize_writes(self) -> None:
        self.synced += 1

    def synchronize_reads(self) -> None:
        self.synced += 1


class _Optimizer:
    """What ``_create_fp32_partitions`` reads of ``DeepSpeedZeroOptimizer_Stage3``."""

    def __init__(self, folder: Path, layout: list[list[tuple[int, bool]]], kept: set[int], manager_cls) -> None:
        from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper
        from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

        (folder / "params").mkdir(parents=True)
        self.param_swapper = _ParamSwapper(folder / "params")
        gen = torch.Generator().manual_seed(11)
        self.fp16_groups, self.fp16_partitioned_groups, self.values = [], [], []
        self.fp16_partitioned_groups_flat_id = []
        ds_id = 0
        for group in layout:
            params, parts, values = [], [], []
            for numel, swapped in group:
                value = (torch.randn(numel, generator=gen) * 3).bfloat16()
                param = types.SimpleNamespace(ds_id=ds_id, nvme_swapper=self.param_swapper)
                if swapped:
                    self.param_swapper.write(param, value)
                    part = types.SimpleNamespace(ds_numel=numel, status=PartitionedParamStatus.NOT_AVAILABLE,
                                                 data=torch.empty(0, dtype=torch.float16))
                else:
                    part = types.SimpleNamespace(ds_numel=numel, status=PartitionedParamStatus.AVAILABLE, data=value)
                params.append(param)
                parts.append(part)
                values.append(value)
                ds_id += 1
            self.fp16_groups.append(params)
            self.fp16_partitioned_groups.append(parts)
            self.fp16_partitioned_groups_flat_id.append([p.ds_id for p in params])
            self.values.append(torch.cat(values))
        self.fp16_partitioned_groups_flat_numel = [int(v.numel()) for v in self.values]
        self.fp16_partitioned_groups_flat = [None] * len(layout)
        self.fp32_partitioned_groups_flat = []
        self.kept = kept
        swapper = PartitionedOptimizerSwapper(types.SimpleNamespace(buffer_count=4), AIO, str(folder / "opt"),
                                              types.SimpleNamespace(state={}), max(self.fp16_partitioned_groups_flat_numel),
                                              torch.device("cpu"), torch.float32, None)
        if manager_cls is not None:
            swapper.swap_buffer_manager = manager_cls(swapper.largest_numel, 4, torch.float32, swapper.aio_handle)
        self.optimizer_swapper = swapper
        self.optimizer = types.SimpleNamespace(param_groups=[{"params": ["x"]}], state={})
        self.swap_optimizer = self.offload_optimizer = self.params_in_nvme_and_cpu = True
        self.offload_optimizer_fast_init = self.use_muon = False
        self.partial_offload = 0.0
        self.master_weights_and_grads_dtype = torch.float32
        self.device = torch.device("cpu")
        self.momentum_calls = []
        self._swap_in_sub_group_to_flat_buffer = types.MethodType(
            DeepSpeedZeroOptimizer_Stage3._swap_in_sub_group_to_flat_buffer, self)

    def _swappable_optimizer_subgroup(self, sub_group_id: int) -> bool:
        return sub_group_id not in self.kept

    def _create_momentum_buffer(self, num_elements, i, ds_id) -> None:
        self.momentum_calls.append(i)


# Per sub-group: (partition elements, swapped to a file?). Offsets of the partitions in a sub-group
# are unaligned; partitions span windows; a window holds several partitions.
LAYOUT = [[(5000, False), (70_001, True), (3, False), (9000, True)], [(20_000, True)],
          [(1000, False), (2000, False)], [(3 * WINDOW, True), (WINDOW + 1, True)]]


def _build(tmp_path: Path, kept: set[int] = frozenset()) -> _Optimizer:
    opt = _Optimizer(tmp_path, LAYOUT, set(kept), make_swap_buffer_manager_class(MemAscendSettings()))
    assert chunked_init.applies(opt)
    chunked_init.build_chunked(opt, WINDOW)
    return opt


def test_files_hold_the_partitions_widened_through_a_window(tmp_path, aio_ok):
    opt = _build(tmp_path, kept={2})
    swapper = opt.optimizer_swapper
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        assert fp32.requires_grad and fp32.dtype == torch.float32
        if i == 2:  # kept in DRAM: stock's whole fp32 tensor
            assert torch.equal(fp32.detach(), opt.values[i].float()) and fp32.ds_id == "5_6"
            continue
        assert fp32.numel() == 0
        numel = opt.fp16_partitioned_groups_flat_numel[i]
        path = Path(swapper.swap_params_info[fp32.ds_id].tensors[0].swap_path)
        data = path.read_bytes()
        assert len(data) == swapper._io_aligned_numel(numel) * 4
        widened = opt.values[i].float().numpy().tobytes()
        assert data[: numel * 4] == widened, f"sub-group {i}: the fp32 file differs from the widened partitions"
        assert data[numel * 4:] == bytes(len(data) - numel * 4)  # the I/O padding: zero
    assert [fp32.ds_id for fp32 in opt.fp32_partitioned_groups_flat] == ["0_3", "4_4", "5_6", "7_8"]
    assert sorted(swapper.swap_params_info) == ["0_3", "4_4", "7_8"]
    assert opt.momentum_calls == [0, 1, 2, 3] and opt.subgroup_to_device == {i: "cpu" for i in range(4)}
    assert opt.optimizer.param_groups[0]["params"] == []
    # No partition was swapped in: the swapped ones still have no data.
    assert all(p.data.numel() == 0 for g in opt.fp16_partitioned_groups for p in g if p.status.name == "NOT_AVAILABLE")
    stats = chunked_init.stats(opt)
    assert (stats.sub_groups, stats.window_numel) == (3, WINDOW)
    assert 0 < stats.read_slab_bytes <= (WINDOW + 2048) * 4  # one small slab, nothing of a sub-group's size
    manager = swapper.swap_buffer_manager
    assert manager.peak_window_bytes == WINDOW * 4 and manager.all_buffers == []
    assert chunked_init.report(opt) == {"fp32_partitions": "chunked", "chunked_sub_groups": 3,
                                        "window_numel": WINDOW, "read_slab_bytes": stats.read_slab_bytes,
                                        "hook_setup_gathers_skipped": None}


def test_sub_groups_in_the_dram_flat_buffer_are_stocks(tmp_path, aio_ok):
    """With ``max_in_cpu`` a prefix of the sub-groups has its 16-bit partitions in the DRAM flat
    buffer: a swapped one is written from it after the loop (``initialize_parameters``), a kept one
    is its fp32 copy; the sub-groups on NVMe are still built chunk by chunk."""
    opt = _Optimizer(tmp_path, LAYOUT, {1}, make_swap_buffer_manager_class(MemAscendSettings()))
    opt.fp16_partitioned_groups_flat[:2] = [opt.values[0].clone(), opt.values[1].clone()]
    assert chunked_init.applies(opt)
    chunked_init.build_chunked(opt, WINDOW)
    swapper = opt.optimizer_swapper
    for i in (0, 2, 3):
        fp32 = opt.fp32_partitioned_groups_flat[i]
        numel = opt.fp16_partitioned_groups_flat_numel[i]
        data = Path(swapper.swap_params_info[fp32.ds_id].tensors[0].swap_path).read_bytes()
        assert data[: numel * 4] == opt.values[i].float().numpy().tobytes(), f"sub-group {i}"
    kept = opt.fp32_partitioned_groups_flat[1]
    assert torch.equal(kept.detach(), opt.values[1].float()) and kept.requires_grad and kept.ds_id == "4_4"
    assert chunked_init.stats(opt).sub_groups == 2


@pytest.mark.parametrize("change", ["fast_init", "muon", "all_in_dram", "stock_manager", "built", "no_swap"])
def test_stock_method_where_it_does_not_apply(tmp_path, aio_ok, change):
    manager_cls = None if change == "stock_manager" else make_swap_buffer_manager_class(MemAscendSettings())
    opt = _Optimizer(tmp_path, LAYOUT[:2], set(), manager_cls)
    if change == "fast_init":
        opt.offload_optimizer_fast_init = True
    elif change == "muon":
        opt.use_muon = True
    elif change == "all_in_dram":  # every sub-group in the 16-bit DRAM flat buffer (max_in_cpu)
        opt.fp16_partitioned_groups_flat = [v.clone() for v in opt.values]
    elif change == "built":
        opt.fp32_partitioned_groups_flat = [torch.empty(0)]
    elif change == "no_swap":
        opt.swap_optimizer = False
    assert not chunked_init.applies(opt)
    calls = []
    patched = chunked_init.make_create_fp32_partitions(lambda self: calls.append(self), WINDOW)
    assert patched(opt) is None and calls == [opt] and chunked_init.stats(opt) is None
    assert chunked_init.report(opt) == {"fp32_partitions": "stock", "hook_setup_gathers_skipped": None}


def test_report_without_an_optimizer():
    assert chunked_init.report(None) is None


def test_patched_with_the_chunk_window_and_reverted():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as S3

    import memascend.integrations.deepspeed as ma_ds

    before = vars(S3)["_create_fp32_partitions"]
    try:
        ma_ds.apply(MemAscendSettings(optimizer_chunk_numel=None))
        assert vars(S3)["_create_fp32_partitions"] is before
        ma_ds.revert()
        ma_ds.apply(MemAscendSettings(optimizer_chunk_numel=WINDOW))
        assert vars(S3)["_create_fp32_partitions"].__wrapped__ is before
    finally:
        ma_ds.revert()
    assert vars(S3)["_create_fp32_partitions"] is before


def _worker(tmp_path: Path, engine: str, *extra: str) -> dict:
    nvme = tempfile.mkdtemp(prefix=f"nvme-{engine}-", dir=tmp_path)
    proc = subprocess.run([sys.executable, str(WORKER), "--engine", engine, "--nvme", nvme, *extra],
                          capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHUNKED_INIT_REPORT ")]
    assert proc.returncode == 0 and lines, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("CHUNKED_INIT_REPORT "))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--dram-numel", "1300000")], ids=["all-swapped", "first-kept-in-dram"])
def test_same_fp32_files_as_stock_deepspeed(tmp_path, aio_ok, extra):
    stock = _worker(tmp_path, "baseline")
    ours = _worker(tmp_path, "memascend", *extra)
    assert len(stock["groups"]) == 3 and all(g["swapped"] for g in stock["groups"])
    if extra:  # optimizer_dram_numel (memascend only) keeps the first sub-group: stock's fp32 copy, same values
        assert not ours["groups"][0]["swapped"]
        assert [(g["numel"], g["sha256"]) for g in ours["groups"]] == [(g["numel"], g["sha256"]) for g in stock["groups"]]
        assert ours["groups"][1:] == stock["groups"][1:]
    else:
        assert ours["groups"] == stock["groups"]
    assert ours["statuses"] == stock["statuses"] and ours["hooks"] == stock["hooks"]
    assert ours["subgroup_to_device"] == stock["subgroup_to_device"] and ours["param_groups_empty"]
    assert ours["chunked_init"]["sub_groups"] == (2 if extra else 3)
    assert ours["chunked_init"]["read_slab_bytes"] > 0  # the embedding and lm_head were read from their files
    assert ours["hook_gathers_skipped"] > 0 and stock["hook_gathers_skipped"] is None


@pytest.mark.slow
def test_fast_init_keeps_stocks_method(tmp_path, aio_ok):
    # fast_init stages a whole sub-group in one parameter buffer: stock needs buffer_size above it.
    extra = ("--fast-init", "--param-buffer-numel", str(1 << 21))
    stock = _worker(tmp_path, "baseline", *extra)
    ours = _worker(tmp_path, "memascend", *extra)
    assert ours["chunked_init"] is None and ours["groups"] == stock["groups"]
