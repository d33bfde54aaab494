"""apply()/apply_raw_store()/revert() leave DeepSpeed (and glibc malloc, the host block cache) exactly as
it was; settings load from a DeepSpeed config."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import memascend.integrations.deepspeed as ma_ds
from memascend.errors import UserError
from memascend.integrations.deepspeed import chunked_step, overflow
from memascend.integrations.deepspeed.patches import PatchRegistry


@pytest.fixture(autouse=True)
def _stand_in_overflow_op(monkeypatch):
    # Pure-torch stand-in for memascend.ops.overflow_check so apply() works before the op lands.
    monkeypatch.setattr(overflow, "load_checker", lambda: (lambda t: bool((~torch.isfinite(t)).any())))
    yield
    ma_ds.revert()


def _seam_objects():
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.swap_tensor import optimizer_utils
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.runtime.zero import stage3 as stage3_module
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as S3

    acc = type(get_accelerator())
    return {
        "partition_parameters.AsyncPartitionedParameterSwapper": (partition_parameters,
                                                                  "AsyncPartitionedParameterSwapper"),
        "optimizer_utils.SwapBufferManager": (optimizer_utils, "SwapBufferManager"),
        "accelerator.pin_memory": (acc, "pin_memory"),
        "accelerator.unpin_memory": (acc, "unpin_memory"),
        "stage3.has_overflow": (S3, "has_overflow"),
        "stage3._has_inf_or_nan": (S3, "_has_inf_or_nan"),
        "stage3._get_norm_groups": (S3, "_get_norm_groups"),
        "stage3._constant_buffered_norm2": (S3, "_constant_buffered_norm2"),  # enable_exact_grad_norm
        "stage3.__init__": (S3, "__init__"),
        "stage3._post_step": (S3, "_post_step"),
        "stage3.partition_grads": (S3, "partition_grads"),
        "stage3._setup_for_real_optimizer": (S3, "_setup_for_real_optimizer"),
        "stage3._finalize_offload_gradient_accumulation": (S3, "_finalize_offload_gradient_accumulation"),
        "stage3.reduce_scatter_coalesced": (stage3_module, "reduce_scatter_coalesced"),  # enable_grad_streaming
        "stage3._swappable_optimizer_subgroup": (S3, "_swappable_optimizer_subgroup"),  # optimizer_dram_numel
        "engine.forward": (DeepSpeedEngine, "forward"),
        "engine.__init__": (DeepSpeedEngine, "__init__"),  # enable_sparse_tied_embedding_grad
        "PartitionedOptimizerSwapper._swap_in_pinned_gradients": (PartitionedOptimizerSwapper,
                                                                  "_swap_in_pinned_gradients"),
        "OptimizerSwapper._writeback_gradients": (optimizer_utils.OptimizerSwapper, "_writeback_gradients"),
        # chunked_swap_out (optimizer_chunk_numel with enable_optimizer_pool)
        "PartitionedOptimizerSwapper.swap_out_gradients": (PartitionedOptimizerSwapper, "swap_out_gradients"),
        "PartitionedOptimizerSwapper.initialize_parameters": (PartitionedOptimizerSwapper, "initialize_parameters"),
        "PartitionedOptimizerSwapper.flush_gradients": (PartitionedOptimizerSwapper, "flush_gradients"),
        "stage3.independent_gradient_partition_epilogue": (S3, "independent_gradient_partition_epilogue"),
        "stage3._create_fp32_partitions": (S3, "_create_fp32_partitions"),  # chunked_init
        "stage3.create_reduce_and_remove_grad_hooks": (S3, "create_reduce_and_remove_grad_hooks"),  # grad_hook_setup
        "engine._load_checkpoint": (DeepSpeedEngine, "_load_checkpoint"),
        "stage3.reset_swap_buffers": (S3, "reset_swap_buffers"),  # fix_exact_resume
        "deepspeed.initialize": (deepspeed, "initialize"),
        # step_overlap (enable_step_overlap with optimizer_chunk_numel)
        "stage3.step": (S3, "step"),
        "stage3.backward_prologue": (S3, "backward_prologue"),
        "stage3.checkpoint_event_prologue": (S3, "checkpoint_event_prologue"),
        "stage3.state_dict": (S3, "state_dict"),
        "stage3.load_state_dict": (S3, "load_state_dict"),
        "GatheredParameters.__enter__": (partition_parameters.GatheredParameters, "__enter__"),
        "engine.destroy": (DeepSpeedEngine, "destroy"),
        "coordinator.fetch_sub_module": (PartitionedParameterCoordinator, "fetch_sub_module"),
        "coordinator.__all_gather_params": (PartitionedParameterCoordinator,
                                            "_PartitionedParameterCoordinator__all_gather_params"),
        "coordinator.__prefetch_nvme_param_partitions": (
            PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__prefetch_nvme_param_partitions"),
    }


def _snapshot():
    # Raw __dict__ entries (so a staticmethod object and "inherited, not own" both count).
    return {key: vars(owner).get(name, "<absent>") for key, (owner, name) in _seam_objects().items()}


INIT = "deepspeed.initialize"
ALL_ON = ma_ds.MemAscendSettings(grad_norm_sub_group_numel=10**9, optimizer_dram_numel=1)


def test_revert_restores_identical_objects():
    before = _snapshot()
    ma_ds.apply(ALL_ON)
    during = _snapshot()
    assert all(during[k] is not before[k] for k in before), "every seam must be patched"
    # plus the chunked optimizer step's stage-3 methods (checked in test_ds_chunked_step.py)
    assert len(ma_ds.patch_records()) == len(before) + len(chunked_step.PATCHED_METHODS)
    ma_ds.revert()
    after = _snapshot()
    assert all(after[k] is before[k] for k in before)
    assert ma_ds.applied_settings() is None and ma_ds.patch_records() == ()


class _MalloptRecorder:
    """Stands in for glibc in memascend.memory.host_allocator: records each mallopt call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1

    def malloc_trim(self, pad: int) -> int:
        return 0


def _raw_store_objects():
    import importlib

    from deepspeed.runtime.engine import DeepSpeedEngine

    from memascend.integrations.deepspeed import raw_store

    found = {f"{name}.AsyncIOBuilder": (importlib.import_module(name), "AsyncIOBuilder")
             for name in raw_store._BUILDER_MODULES}
    found.update({"engine.save_checkpoint": (DeepSpeedEngine, "save_checkpoint"),
                  "engine.load_checkpoint": (DeepSpeedEngine, "load_checkpoint")})
    return found


def _everything():
    return {key: vars(owner).get(name, "<absent>")
            for key, (owner, name) in {**_seam_objects(), **_raw_store_objects()}.items()}


@pytest.fixture()
def mallopt_calls(monkeypatch):
    """glibc's mallopt recorded instead of called; the environment sets the arena limit only."""
    from memascend.memory import host_allocator

    recorder = _MalloptRecorder()
    monkeypatch.setattr(host_allocator, "_libc", lambda: recorder)
    monkeypatch.setattr(host_allocator, "_in_force", None)
    for name in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    return recorder.calls


@pytest.mark.parametrize("raw_store_first", [True, False])
def test_one_revert_restores_patches_raw_store_malloc_policy_and_host_cache(tmp_path, mallopt_calls,
                                                                            raw_store_first):
    from memascend.memory import host_allocator as ha
    from memascend.memory import host_cache

    before = _everything()
    if raw_store_first:
        handle = ma_ds.apply_raw_store(tmp_path / "r.store", world_rank=0, size_bytes=32 << 20)
        ma_ds.apply(ALL_ON)
    else:
        ma_ds.apply(ALL_ON)
        handle = ma_ds.apply_raw_store(tmp_path / "r.store", world_rank=0, size_bytes=32 << 20)
    host_cache.install()  # what the engine's first forward does
    during = _everything()
    assert all(during[k] is not before[k] for k in before), "every seam must be patched"
    assert len(ma_ds.patch_records()) == len(before) + len(chunked_step.PATCHED_METHODS)  # one registry holds both
    assert ma_ds.active_raw_store() is handle and host_cache.installed()
    assert mallopt_calls == [(ha._M_MMAP_THRESHOLD, 4 << 20), (ha._M_TRIM_THRESHOLD, 16 << 20),
                             (ha._M_ARENA_MAX, 2)]

    ma_ds.revert()
    after = _everything()
    assert all(after[k] is before[k] for k in before)
    assert ma_ds.patch_records() == () and ma_ds.applied_settings() is None and ma_ds.active_raw_store() is None
    assert not host_cache.installed()
    # glibc's start-up values: its default thresholds, the arena limit from MALLOC_ARENA_MAX
    assert mallopt_calls[3:] == [(ha._M_MMAP_THRESHOLD, 128 << 10), (ha._M_TRIM_THRESHOLD, 128 << 10),
                                 (ha._M_ARENA_MAX, 4)]
    assert ha.malloc_policy_in_force() == ha.startup_malloc_policy()
    assert not (tmp_path / "r.store").exists() and not handle.key_root.exists()  # the store is closed

    ma_ds.revert()  # twice is safe: nothing left to undo
    assert _everything() == before and len(mallopt_calls) == 6 and ma_ds.active_raw_store() is None


def test_failed_apply_keeps_the_raw_store_and_restores_the_malloc_policy(tmp_path, mallopt_calls, monkeypatch):
    def broken():
        raise UserError("op unavailable")

    monkeypatch.setattr(overflow, "load_checker", broken)
    handle = ma_ds.apply_raw_store(tmp_path / "r.store", world_rank=0, size_bytes=32 << 20)
    with_store = _everything()
    records = ma_ds.patch_records()
    with pytest.raises(UserError, match="op unavailable"):
        ma_ds.apply(ALL_ON)  # the fused overflow check comes after the malloc policy
    assert _everything() == with_store and ma_ds.patch_records() == records
    assert ma_ds.applied_settings() is None and ma_ds.active_raw_store() is handle
    assert [value for _, value in mallopt_calls] == [4 << 20, 16 << 20, 2, 128 << 10, 128 << 10, 4]
    ma_ds.revert()
    assert not (tmp_path / "r.store").exists()


def _only(**on) -> ma_ds.MemAscendSettings:
    """Settings with every flag this test toggles off but those given (other settings: defaults)."""
    off = dict.fromkeys(("enable_param_pool", "enable_optimizer_pool", "enable_arena_pinning",
                         "enable_fused_overflow_check", "enable_malloc_policy", "enable_grad_buffer_release",
                         "fix_unaligned_gradient_io", "fix_exact_resume", "enable_host_block_cache",
                         "enable_grad_streaming", "enable_step_overlap", "enable_exact_grad_norm",
                         "enable_sparse_tied_embedding_grad"), False)
    return ma_ds.MemAscendSettings(**{**off, **on})


def test_each_flag_patches_only_its_seams():
    before = _snapshot()
    ma_ds.apply(_only(enable_param_pool=True))
    during = _snapshot()
    changed = {k for k in before if during[k] is not before[k]}
    # the sizes that live in DeepSpeed's config are "auto" by default: deepspeed.initialize resolves them
    assert changed == {"partition_parameters.AsyncPartitionedParameterSwapper", INIT}
    ma_ds.revert()
    ma_ds.apply(_only(enable_grad_buffer_release=True))
    during = _snapshot()
    assert {k for k in before if during[k] is not before[k]} == {"stage3.__init__", "stage3._post_step",
                                                                  "stage3.partition_grads", INIT}
    ma_ds.revert()
    ma_ds.apply(_only(grad_norm_sub_group_numel=1 << 20))
    during = _snapshot()
    assert {k for k in before if during[k] is not before[k]} == {"stage3._get_norm_groups", INIT}
    ma_ds.revert()
    ma_ds.apply(_only(enable_exact_grad_norm=True))
    during = _snapshot()
    assert {k for k in before if during[k] is not before[k]} == {"stage3._constant_buffered_norm2", INIT}
    ma_ds.revert()
    ma_ds.apply(_only(enable_sparse_tied_embedding_grad=True))
    during = _snapshot()
    assert {k for k in before if during[k] is not before[k]} == {"engine.__init__", INIT}
    ma_ds.revert()
    ma_ds.apply(_only(enable_malloc_policy=True))
    during = _snapshot()
    assert {k for k in before if during[k] is not before[k]} == {"stage3.__init__", "stage3._post_step",
                                                                  "stage3.partition_grads", "engine.forward", INIT}
    ma_ds.revert()
    ma_ds.apply(_only(enable_step_overlap=True))
    during = _snapshot()
    # the step beside the forward: its joins and fetch waits, and _post_step (deferred to the worker)
    assert {k for k in before if during[k] is not before[k]} == {
        "stage3.step", "stage3.backward_prologue", "stage3.checkpoint_event_prologue", "stage3.state_dict",
        "stage3.load_state_dict", "GatheredParameters.__enter__", "engine.destroy", "coordinator.fetch_sub_module",
        "coordinator.__all_gather_params", "coordinator.__prefetch_nvme_param_partitions", "stage3.__init__",
        "stage3._post_step", INIT}
    ma_ds.revert()
    # The baseline engine: every optimization off, only the correctness fix on.
    ma_ds.apply(ma_ds.MemAscendSettings.baseline())
    during = _snapshot()
    assert {k for k in before if during[k] is not before[k]} == {
        "PartitionedOptimizerSwapper._swap_in_pinned_gradients", "OptimizerSwapper._writeback_gradients",
        "engine._load_checkpoint", "stage3.reset_swap_buffers"}
    ma_ds.revert()
    assert _snapshot() == before
    ma_ds.revert()
    ma_ds.apply(_only(enable_host_block_cache=True))
    during = _snapshot()
    assert {k for k in before if during[k] is not before[k]} == {"engine.forward", INIT}  # installs the cache
    ma_ds.revert()
    ma_ds.apply(_only(enable_grad_streaming=True))
    during = _snapshot()  # partition_grads composed under step_memory's wrapper (one patch per attribute)
    assert {k for k in before if during[k] is not before[k]} == {
        "stage3._setup_for_real_optimizer", "stage3._finalize_offload_gradient_accumulation",
        "stage3.reduce_scatter_coalesced", "stage3.partition_grads", "stage3.__init__", "stage3._post_step", INIT}
    ma_ds.revert()
    assert _snapshot() == before


def test_apply_twice_same_settings_is_noop_other_settings_is_error():
    s = ma_ds.apply()
    records = ma_ds.patch_records()
    assert ma_ds.apply(ma_ds.MemAscendSettings()) == s
    assert ma_ds.patch_records() == records
    with pytest.raises(UserError, match="revert"):
        ma_ds.apply(ma_ds.MemAscendSettings(enable_param_pool=False))
    ma_ds.revert()
    ma_ds.revert()  # twice is safe


def test_failed_apply_leaves_deepspeed_stock(monkeypatch):
    before = _snapshot()

    def broken():
        raise UserError("op unavailable")

    monkeypatch.setattr(overflow, "load_checker", broken)
    with pytest.raises(UserError):
        ma_ds.apply()
    assert _snapshot() == before and ma_ds.applied_settings() is None


def test_registry_deletes_attributes_that_were_inherited():
    class Base:
        def f(self):
            return "base"

    class Child(Base):
        pass

    reg = PatchRegistry()
    reg.patch(Child, "f", lambda self: "patched")
    assert Child().f() == "patched"
    with pytest.raises(RuntimeError):
        reg.patch(Child, "f", lambda self: "again")
    reg.restore_all()
    assert "f" not in vars(Child) and Child().f() == "base"


def test_apply_from_config_reads_the_memascend_section(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "memascend": {"enable_fused_overflow_check": False, "param_prefetch_slots": 9}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    s = ma_ds.apply_from_config(path)
    assert s == ma_ds.MemAscendSettings(enable_fused_overflow_check=False, param_prefetch_slots=9)
    ma_ds.revert()
    assert ma_ds.apply_from_config({"train_micro_batch_size_per_gpu": 1}) == ma_ds.MemAscendSettings()


@pytest.mark.parametrize("section, match", [
    ({"enable_turbo": True}, "unknown key"),
    ({"enable_param_pool": "yes"}, "true or false"),
    ({"param_prefetch_slots": 0}, ">= 1"),
    ({"optimizer_sub_group_numel": -5}, ">= 1"),
    ({"optimizer_sub_group_numel": "big"}, "auto"),
    ({"grad_norm_sub_group_numel": -1}, ">= 0"),
    ({"param_dram_numel": 1.5}, ">= 0"),
    ({"reduce_bucket_numel": 0}, "auto"),
    ([1, 2], "must be an object"),
])
def test_bad_sections_are_user_errors(section, match):
    with pytest.raises(UserError, match=match):
        ma_ds.MemAscendSettings.from_ds_config({"memascend": section})


def test_bad_config_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="DeepSpeed config not found"):
        ma_ds.apply_from_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        ma_ds.apply_from_config(bad)


def test_rewrite_ds_config_sets_sub_group_size_without_mutating_input():
    cfg = {"zero_optimization": {"stage": 3, "sub_group_size": 10**9}}
    out = ma_ds.rewrite_ds_config(cfg, ma_ds.MemAscendSettings(optimizer_sub_group_numel=1 << 20))
    # enable_bucketless_reduce (default on): no IPG bucket buffer
    assert out["zero_optimization"] == {"stage": 3, "sub_group_size": 1 << 20, "contiguous_gradients": False}
    assert cfg["zero_optimization"] == {"stage": 3, "sub_group_size": 10**9}
    # "auto" needs the model's shapes (prepare_ds_config); without them the config is kept.
    kept = ma_ds.rewrite_ds_config(cfg, ma_ds.MemAscendSettings())
    assert kept == {"zero_optimization": {**cfg["zero_optimization"], "contiguous_gradients": False}}
    assert ma_ds.rewrite_ds_config(cfg, ma_ds.MemAscendSettings(enable_bucketless_reduce=False)) == cfg


def test_rewrite_ds_config_moves_nvme_params_out_of_dram_only_when_offloaded_to_nvme():
    nvme = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/x"}}}
    out = ma_ds.rewrite_ds_config(nvme, ma_ds.MemAscendSettings(param_dram_numel=0))
    assert out["zero_optimization"]["offload_param"] == {"device": "nvme", "nvme_path": "/x", "max_in_cpu": 0}
    assert "max_in_cpu" not in nvme["zero_optimization"]["offload_param"]
    keep = ma_ds.MemAscendSettings(enable_bucketless_reduce=False)
    assert ma_ds.rewrite_ds_config(nvme, keep) == nvme  # default: keep the config's
    cpu = {"zero_optimization": {"offload_param": {"device": "cpu"}}}
    assert ma_ds.rewrite_ds_config(cpu, dataclasses.replace(keep, param_dram_numel=0)) == cpu


def test_prepare_ds_config_resolves_auto_sub_group_and_stock_norm_grouping():
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}
    numels = [28_311_552, 331_776, 110_592, 884_736]
    out, settings = ma_ds.prepare_ds_config(cfg, ma_ds.MemAscendSettings(), param_numels=numels, world_size=2)
    assert settings.optimizer_sub_group_numel == 14_155_776 == out["zero_optimization"]["sub_group_size"]
    assert settings.grad_norm_sub_group_numel == 10**9  # DeepSpeed's default, what stock would group by
    # The reduce bucket holds one whole (unpartitioned) gradient: the largest parameter.
    assert settings.reduce_bucket_numel == 28_311_552 == out["zero_optimization"]["reduce_bucket_size"]
    # Optimizer state not on NVMe, or no shapes: the sub-group size stays the config's.
    cpu = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "sub_group_size": 7}}
    out, settings = ma_ds.prepare_ds_config(cpu, ma_ds.MemAscendSettings(), param_numels=numels)
    assert out["zero_optimization"]["sub_group_size"] == 7
    assert settings.optimizer_sub_group_numel is None and settings.grad_norm_sub_group_numel is None
    out, settings = ma_ds.prepare_ds_config(cfg, ma_ds.MemAscendSettings())
    assert "sub_group_size" not in out["zero_optimization"] and settings.grad_norm_sub_group_numel is None
    # An explicit size equal to the config's needs no norm regrouping.
    same = {"zero_optimization": {"offload_optimizer": {"device": "nvme"}, "sub_group_size": 5}}
    _, settings = ma_ds.prepare_ds_config(same, ma_ds.MemAscendSettings(optimizer_sub_group_numel=5))
    assert settings.grad_norm_sub_group_numel is None


def test_host_block_cache_is_installed_by_the_first_forward_and_removed_by_revert():
    from deepspeed.runtime.engine import DeepSpeedEngine

    from memascend.memory import host_cache

    def forward_hook_patched() -> bool:
        return any(r.owner is DeepSpeedEngine and r.name == "forward" for r in ma_ds.patch_records())

    assert not host_cache.installed()
    # Only the cache on: the engine's forward still carries the hook that installs it.
    ma_ds.apply(ma_ds.MemAscendSettings(enable_malloc_policy=False))
    assert forward_hook_patched()
    assert not host_cache.installed()  # model and engine construction run on torch's own allocator
    host_cache.install()  # what the first forward does (tests/integrations/test_ds_step_memory.py)
    assert host_cache.owns(torch.empty(1 << 20, dtype=torch.uint8).clone())
    ma_ds.revert()
    assert not host_cache.installed() and not forward_hook_patched()
    ma_ds.apply(ma_ds.MemAscendSettings(enable_host_block_cache=False, enable_malloc_policy=False))
    assert not forward_hook_patched() and not host_cache.installed()
    ma_ds.revert()
    assert not host_cache.installed()
