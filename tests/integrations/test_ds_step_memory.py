"""Stock-grouped gradient norm, page release, freeing optimizer buffers between steps, breakdown."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memascend.integrations.deepspeed import exact_norm, grad_norm, step_memory
from memascend.integrations.deepspeed.accounting import (
    gradient_transients,
    memory_breakdown,
    peak_sample,
    step_transient_bytes,
)
from memascend.integrations.deepspeed.exact_norm import make_constant_buffered_norm2, transient_bytes
from memascend.integrations.deepspeed.optimizer_swapper import OnDemandSwapBufferManager
from memascend.integrations.deepspeed.single_rank_reduce import make_reduce_scatter_coalesced
from memascend.memory import host_allocator


class _P:
    def __init__(self, numel: int, pg: object = None) -> None:
        self.n = numel
        self.pg = pg

    def partition_numel(self) -> int:
        return self.n


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(1, 50), min_size=1, max_size=30),
       size=st.one_of(st.none(), st.integers(1, 2000)))
def test_stock_sub_groups_match_deepspeed(numels, size):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    params = [_P(n) for n in numels]
    fake = types.SimpleNamespace(sub_group_size=size)
    expected = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(fake, params)
    assert grad_norm.stock_sub_groups(params, size, lambda p: p.n) == expected


class _FakeStage3:
    """Enough of a stage-3 optimizer for _get_norm_groups: sub-groups and the per-group norm."""

    offload_optimizer = True
    use_muon = False

    def __init__(self, groups: list[list[_P]], group_ids: list[int]) -> None:
        self.fp16_groups = groups
        self.sub_group_to_group_id = dict(enumerate(group_ids))
        self.calls: list[list[int]] = []

    def _get_param_partition_group(self, p: _P) -> object:
        return p.pg

    def complete_grad_norm_calculation_for_cpu_offload(self, params: list[_P]) -> torch.Tensor:
        self.calls.append([p.n for p in params])
        return torch.tensor(float(sum(p.n for p in params)))


def test_norm_groups_follow_the_stock_grouping_per_param_group():
    a = [_P(n) for n in (5, 1, 1, 5)]
    b = [_P(n) for n in (3, 3)]
    opt = _FakeStage3([a[:1], a[1:3], a[3:], b[:1], b[1:]], [0, 0, 0, 1, 1])
    original_called = []
    patched = grad_norm.make_get_norm_groups(lambda self: original_called.append(1) or [], 10**9)
    norms = patched(opt)
    assert opt.calls == [[5, 1, 1, 5], [3, 3]] and [float(n) for n in norms] == [12.0, 6.0]
    assert not original_called
    # With a stock size of 6 the first param group splits after 5+1 (>= 6), as DeepSpeed would.
    opt.calls.clear()
    grad_norm.make_get_norm_groups(lambda self: [], 6)(opt)
    assert opt.calls == [[5, 1], [1, 5], [3, 3]]


def test_norm_groups_fall_back_to_stock_when_not_applicable():
    mixed = [_P(1, pg="a"), _P(1, pg="b")]
    opt = _FakeStage3([mixed[:1], mixed[1:]], [0, 0])
    sentinel = [torch.tensor(1.0)]
    patched = grad_norm.make_get_norm_groups(lambda self: sentinel, 10**9)
    assert patched(opt) is sentinel  # would mix partition groups
    opt = _FakeStage3([[_P(1)]], [0])
    opt.offload_optimizer = False
    assert patched(opt) is sentinel


def test_grad_buffer_release_only_for_offloaded_non_fp16():
    buf = torch.ones(4 << 20)
    opt = types.SimpleNamespace(offload_optimizer=True, dtype=torch.bfloat16, grad_partitions_flat_buffer=buf)
    assert step_memory.release_grad_buffer_pages(opt) > 0
    buf2 = torch.ones(4 << 20)
    assert step_memory.release_grad_buffer_pages(
        types.SimpleNamespace(offload_optimizer=True, dtype=torch.float16, grad_partitions_flat_buffer=buf2)) == 0
    assert step_memory.release_grad_buffer_pages(
        types.SimpleNamespace(offload_optimizer=False, dtype=torch.bfloat16, grad_partitions_flat_buffer=buf2)) == 0
    assert bool((buf2 == 1).all())


class _Handle:
    def __init__(self) -> None:
        self.live = 0

    def new_cpu_locked_tensor(self, numel, like):
        self.live += 1
        return torch.empty(numel, dtype=like.dtype)

    def free_cpu_locked_tensor(self, tensor):
        self.live -= 1

    def is_pinned(self, tensor):
        return True


def test_optimizer_buffers_are_freed_between_steps_where_they_cannot_be_parked(monkeypatch):
    # Parking (tests/integrations/test_ds_optimizer_swapper.py) needs glibc's mlock/madvise; without
    # them the buffers are freed and the next step allocates new ones.
    monkeypatch.setattr(host_allocator, "can_park", lambda: False)
    handle = _Handle()
    manager = OnDemandSwapBufferManager(1024, 4, torch.float32, handle)
    bufs = manager.allocate(1000, 4, torch.float32)
    assert manager.release_free_buffers() == 0  # in use: nothing freed
    manager.free(bufs)
    assert manager.release_free_buffers() == 4 * 1024 * 4
    assert handle.live == 0 and manager.all_buffers == [] and manager.locked_bytes() == 0
    assert manager.peak_locked_bytes == 4 * 1024 * 4 and manager.peak_buffers_in_use == 4
    again = manager.allocate(1024, 2, torch.float32)  # next step locks new ones
    assert len(again) == 2 and handle.live == 2 and bool((again[0] == 0).all())


def test_post_step_hook_runs_stock_then_releases():
    order = []
    settings_ = step_memory.MemAscendSettings()
    manager = types.SimpleNamespace(release_free_buffers=lambda: order.append("buffers") or 0)
    opt = types.SimpleNamespace(offload_optimizer=True, dtype=torch.bfloat16, grad_partitions_flat_buffer=None,
                                optimizer_swapper=types.SimpleNamespace(swap_buffer_manager=manager))
    hook = step_memory.make_post_step(lambda self, names: order.append("stock") or "ok", settings_)
    assert hook(opt, set()) == "ok" and order == ["stock", "buffers"]


def test_step_transient_and_breakdown_keys():
    S = types.SimpleNamespace
    samples = [S(phase="load", rss_bytes=100), S(phase="forward", rss_bytes=200), S(phase="forward", rss_bytes=260),
               S(phase="backward", rss_bytes=300), S(phase="step", rss_bytes=900), S(phase="forward", rss_bytes=250),
               S(phase="backward", rss_bytes=420)]
    assert step_transient_bytes(samples) == 170
    grad = torch.zeros(1 << 20, dtype=torch.bfloat16)  # 2 MiB, every page written
    engine = S(module=None, optimizer=S(grad_partitions_flat_buffer=grad, ipg_buckets={},
                                        param_groups_fp16_flat_cpu_memory=[torch.empty(1)]))
    out = memory_breakdown(engine, {"peak_rss_bytes": 10 << 20, "peak_locked_bytes": 5,
                                    "phase_peak_rss_bytes": {"load": 100}}, samples)
    flat = out["gradient_buffers"]["grad_partitions_flat"]
    assert flat["allocated_bytes"] == 2 << 20 and flat["resident_at_end_bytes"] >= (2 << 20) - 8192
    assert out["param_dram_copy"]["allocated_bytes"] == 0  # stock's 1-element placeholder (params on NVMe)
    assert out["unattributed_bytes"] == (10 << 20) - 100 - flat["resident_at_end_bytes"] - 170
    assert out["at_peak"] == {"phase": "step", "rss_bytes": 900, "locked_bytes": 0}
    host_allocator.release_pages(grad)
    out = memory_breakdown(engine, {"peak_rss_bytes": 10 << 20, "phase_peak_rss_bytes": {}}, samples)
    assert out["gradient_buffers"]["grad_partitions_flat"]["resident_at_end_bytes"] <= 8192
    if out["malloc"] is not None:
        assert out["malloc"]["heap_bytes"] >= out["malloc"]["free_held_bytes"] >= 0


def test_breakdown_counts_buffers_locked_during_the_step_once():
    """Swap buffers locked only while backward runs (memascend's optimizer buffers) are locked at the
    peak, not transient; buffers locked after the peak (the optimizer step) are not in it at all."""
    S = types.SimpleNamespace
    samples = [S(phase="load", rss_bytes=100, locked_bytes=0),
               S(phase="forward", rss_bytes=300, locked_bytes=50),
               S(phase="backward", rss_bytes=700, locked_bytes=250),  # +200 locked, +200 unlocked
               S(phase="backward", rss_bytes=650, locked_bytes=250),
               S(phase="step", rss_bytes=680, locked_bytes=480)]
    assert step_transient_bytes(samples) == 200
    assert peak_sample(samples) == {"phase": "backward", "rss_bytes": 700, "locked_bytes": 250}
    assert peak_sample([]) is None
    engine = S(module=None, optimizer=S(grad_partitions_flat_buffer=None, ipg_buckets={},
                                        param_groups_fp16_flat_cpu_memory=[]))
    out = memory_breakdown(engine, {"peak_rss_bytes": 700, "peak_locked_bytes": 480,
                                    "phase_peak_rss_bytes": {"load": 100}}, samples)
    # 700 = 100 runtime + 250 locked at the peak + 200 transient + 150 unlocked already held when the forward began
    assert out["unattributed_bytes"] == 150


def test_gradient_transients_norm_copy_and_reduce_path(monkeypatch):
    import deepspeed.comm as dist
    from deepspeed.runtime.zero import stage3

    S = types.SimpleNamespace
    part = lambda n: S(partition_numel=lambda: n)  # noqa: E731
    opt = S(fp16_groups=[[part(10), part(300_000_000)], [part(7)]], dp_process_group=None)
    # stock's reduce-scatter: the norm's fp64 piece (the CPU has fp64) is capped at 250e6 elements;
    # up to two bucket copies
    assert gradient_transients(opt, 64) == {"grad_norm_copy_bytes": 8 * 250_000_000, "grad_norm_path": "stock_copy",
                                            "single_rank_reduce": False, "reduce_copy_bytes": 128}
    # exact_norm patched in (self-check passed): its piece buffer instead of the copy
    monkeypatch.setattr(stage3.DeepSpeedZeroOptimizer_Stage3, "_constant_buffered_norm2",
                        make_constant_buffered_norm2(stage3.DeepSpeedZeroOptimizer_Stage3._constant_buffered_norm2))
    assert gradient_transients(opt, 64)["grad_norm_path"] == "exact_chunked"
    assert gradient_transients(opt, 64)["grad_norm_copy_bytes"] == transient_bytes(250_000_000) == 8 * (16384 + 4)
    monkeypatch.setattr(exact_norm, "_check_result", False)  # self-check failed: stock's copy
    assert gradient_transients(opt, 64)["grad_norm_path"] == "stock_copy"
    assert gradient_transients(opt, 64)["grad_norm_copy_bytes"] == 8 * 250_000_000
    monkeypatch.undo()
    opt.fp16_groups = [[part(1000)]]
    assert gradient_transients(opt, 64)["grad_norm_copy_bytes"] == 8000
    assert gradient_transients(None, 64) == {"grad_norm_copy_bytes": 0, "grad_norm_path": "stock_copy",
                                             "single_rank_reduce": False, "reduce_copy_bytes": 0}
    # the single-rank path in force on a one-rank group: no copies
    monkeypatch.setattr(stage3, "reduce_scatter_coalesced",
                        make_reduce_scatter_coalesced(stage3.reduce_scatter_coalesced, lambda group: 1))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert gradient_transients(opt, 64) == {"grad_norm_copy_bytes": 8000, "grad_norm_path": "stock_copy",
                                            "single_rank_reduce": True, "reduce_copy_bytes": 0}
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert gradient_transients(opt, 64)["reduce_copy_bytes"] == 128
    # no bucket buffer (contiguous_gradients false): twice the most one bucket holds, reduce_bucket_size
    # elements of the communication dtype or the largest gradient (reduced in a bucket of its own)
    import torch

    grads = [S(partition_numel=lambda: 500, ds_numel=1000), S(partition_numel=lambda: 1500, ds_numel=3000)]
    bucketless = S(fp16_groups=[grads], dp_process_group=None, reduce_bucket_size=2000,
                   ipg_buckets={torch.bfloat16: S(buffer=None)})
    assert gradient_transients(bucketless, 0)["reduce_copy_bytes"] == 2 * 3000 * 2
    bucketless.reduce_bucket_size = 3500
    assert gradient_transients(bucketless, 0)["reduce_copy_bytes"] == 2 * 3500 * 2


def test_partition_grads_trims_before_stock(monkeypatch):
    order = []
    monkeypatch.setattr(host_allocator, "trim", lambda: order.append("trim") or True)
    hook = step_memory.make_partition_grads(lambda self, params, grads: order.append(("stock", params, grads)))
    hook(object(), ["p"], ["g"])
    assert order == ["trim", ("stock", ["p"], ["g"])]


def _stage3_like(*, boundary: bool, dtype=torch.bfloat16, offload=True, managed=True):
    return types.SimpleNamespace(offload_optimizer=offload, dtype=dtype, is_gradient_accumulation_boundary=lambda: boundary,
                                 _memascend_managed_accumulation=managed)


@pytest.mark.parametrize(("boundary", "dtype", "offload", "released"), [
    (True, torch.bfloat16, True, True),
    (True, torch.float32, True, False),  # .float() aliases the partition: the swapper may still read it
    (False, torch.bfloat16, True, False),  # gradient accumulation: the next micro step adds to it
    (True, torch.float16, True, False),  # fp16 has_overflow reads the whole buffer in step
    (True, torch.bfloat16, False, False),  # optimizer in DRAM reads it in step
    (True, "unmanaged", True, False),  # unmanaged accumulation swaps the partitions out again at step
])
def test_partition_grads_releases_written_partitions_only_when_dead(boundary, dtype, offload, released):
    flat = torch.ones(8 << 20, dtype=torch.bfloat16)
    views = [flat.narrow(0, 0, 3 << 20), flat.narrow(0, 3 << 20, 2 << 20)]
    settings_ = step_memory.MemAscendSettings(enable_malloc_policy=False)
    hook = step_memory.make_partition_grads(lambda self, params, grads: list(views), settings_)
    before = host_allocator.resident_bytes(flat)
    managed = dtype != "unmanaged"
    dtype = torch.bfloat16 if dtype == "unmanaged" else dtype
    assert hook(_stage3_like(boundary=boundary, dtype=dtype, offload=offload, managed=managed), ["p"], ["g"]) == views
    untouched = flat.narrow(0, 5 << 20, 3 << 20)
    assert bool((untouched == 1).all())  # partitions not handed back keep their values
    if released:
        assert host_allocator.resident_bytes(flat) <= before - (9 << 20)
        assert not bool(flat.narrow(0, 4096, (3 << 20) - 8192).any())  # page-interior: reads as zero now
    else:
        assert host_allocator.resident_bytes(flat) == before and bool((flat == 1).all())


def test_optimizer_buffers_kept_between_steps_when_release_is_off():
    calls = []
    settings_ = step_memory.MemAscendSettings(enable_optimizer_buffer_release=False, enable_malloc_policy=False,
                                              enable_grad_buffer_release=False)
    manager = types.SimpleNamespace(release_free_buffers=lambda: calls.append("buffers") or 0)
    opt = types.SimpleNamespace(offload_optimizer=True, dtype=torch.bfloat16, grad_partitions_flat_buffer=None,
                                optimizer_swapper=types.SimpleNamespace(swap_buffer_manager=manager))
    step_memory.make_post_step(lambda self, names: None, settings_)(opt, set())
    step_memory.make_init(lambda self: None, settings_)(opt)
    assert calls == []


def test_init_gradient_buffer_released_only_when_all_zero():
    zeros = torch.zeros(4 << 20)
    # The fp32 sub-group tensors' .grad: views of one zeroed buffer (stage 3's initialize_optimizer_states).
    a = types.SimpleNamespace(grad=zeros.narrow(0, 0, 1 << 20))
    b = types.SimpleNamespace(grad=zeros.narrow(0, 1 << 20, 3 << 20))
    assert step_memory.release_init_gradient_pages(types.SimpleNamespace(fp32_partitioned_groups_flat=[a, b])) > 0
    assert host_allocator.resident_bytes(zeros) <= 8192 and not bool(zeros.any())
    used = torch.zeros(4 << 20)
    used[123] = 1.0
    c = types.SimpleNamespace(grad=used)
    assert step_memory.release_init_gradient_pages(types.SimpleNamespace(fp32_partitioned_groups_flat=[c])) == 0
    assert float(used[123]) == 1.0


def test_engine_forward_trims_only_in_training(monkeypatch):
    calls = []
    monkeypatch.setattr(host_allocator, "trim", lambda: calls.append("trim") or True)
    fwd = step_memory.make_engine_forward(lambda self, x: x + 1)
    engine = types.SimpleNamespace(module=types.SimpleNamespace(training=True))
    assert fwd(engine, 1) == 2 and calls == ["trim"]
    engine.module.training = False
    assert fwd(engine, 1) == 2 and calls == ["trim"]


def test_engine_forward_installs_the_host_block_cache_once_at_the_first_forward(monkeypatch):
    from memascend.memory import host_cache

    monkeypatch.setattr(host_allocator, "trim", lambda: pytest.fail("trim is off"))
    fwd = step_memory.make_engine_forward(lambda self, x: host_cache.installed(), trim=False,
                                          install_host_cache=True)
    assert not host_cache.installed()
    engine = types.SimpleNamespace(module=types.SimpleNamespace(training=True))
    try:
        assert fwd(engine, 1) is True  # installed before the forward runs
        assert fwd(engine, 1) is True
    finally:
        assert host_cache.uninstall()
    plain = step_memory.make_engine_forward(lambda self, x: host_cache.installed(), trim=False)
    assert plain(engine, 1) is False


def test_managed_accumulation_read_from_the_config_stage3_gets(tmp_path):
    assert step_memory.managed_accumulation({"train_batch_size": 1}) is True
    assert step_memory.managed_accumulation({"managed_gradient_accumulation": False}) is False
    path = tmp_path / "ds.json"
    path.write_text('{"managed_gradient_accumulation": false}')
    assert step_memory.managed_accumulation(str(path)) is False
    path.write_text("{}")
    assert step_memory.managed_accumulation(path) is True
    assert step_memory.managed_accumulation(str(tmp_path / "missing.json")) is False
    assert step_memory.managed_accumulation(None) is False
