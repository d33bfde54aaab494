"""Streaming gradients (grad_stream) against stock DeepSpeed 0.19.8's own partition_grads.

Both run on the same fake stage-3 optimizer object whose methods are stock's
(``partition_grads``, ``_offload_grad_partition_at_boundary``, ``_swap_out_offload_fp32_gradients``,
``_constant_buffered_norm2``), with a fake swap target (files kept in a dict, fragments split and
kept in DRAM as ``OptimizerSwapper`` does): stock with its whole-partition buffer, streaming with an
empty one. After every accumulation window the swap target, the per-parameter norms and the fp16
overflow flag must be the same bits.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch

pytest.importorskip("deepspeed")

from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerStateSwapInfo, OptimizerSwapper  # noqa: E402
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3  # noqa: E402

from memascend.integrations.deepspeed import grad_stream  # noqa: E402

MAP = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


class FakeAio:
    """An aio handle over a dict of "files" (path -> tensor)."""

    def __init__(self, disk: dict) -> None:
        self.disk, self.done = disk, 0

    def async_pread(self, view, path, offset):
        view.copy_(self.disk[path][: view.numel()])
        self.done += 1

    def wait(self):
        done, self.done = self.done, 0
        return done

    def new_cpu_locked_tensor(self, numel, like):
        return torch.empty(numel, dtype=like.dtype)

    def free_cpu_locked_tensor(self, tensor):
        pass


class FakeSwapper:
    """``swap_out_gradients`` as ``OptimizerSwapper._swap_out_gradients``: split at the I/O
    alignment, small fragments kept in DRAM, the others written (here: into ``disk``)."""

    _adjust_for_misaligned_lengths = OptimizerSwapper._adjust_for_misaligned_lengths
    is_swappable_tensor = OptimizerSwapper.is_swappable_tensor

    def __init__(self, fp32_groups, swappable) -> None:
        self.numel_alignment, self.swap_element_size, self.min_aio_bytes = 64, 4, 64 * 4
        self.disk: dict = {}
        self.aio_handle = FakeAio(self.disk)
        self.swap_params_info = {g.ds_id: OptimizerStateSwapInfo(g, g.numel(), "/nonexistent", self.aio_handle)
                                 for i, g in enumerate(fp32_groups) if i in swappable}

    def swap_out_gradients(self, parameter, gradient_offsets, gradient_tensors):
        info = self.swap_params_info[parameter.ds_id]
        tensors, offsets = self._adjust_for_misaligned_lengths(gradient_tensors, gradient_offsets)
        for tensor, offset in zip(tensors, offsets):
            if not self.is_swappable_tensor(tensor=tensor):
                info.unswapped_gradients[offset] = tensor
                continue
            path = info.get_or_create_gradient_paths([offset], [tensor.numel()])[0]
            # SwapBuffer.insert_tensor: copy_ into the swapper's fp32 pinned buffer
            self.disk[path] = torch.empty(tensor.numel(), dtype=torch.float32).copy_(tensor)


class FakeStage3:
    partition_grads = Stage3.partition_grads
    _offload_grad_partition_at_boundary = Stage3._offload_grad_partition_at_boundary
    _swap_out_offload_fp32_gradients = Stage3._swap_out_offload_fp32_gradients
    _constant_buffered_norm2 = Stage3._constant_buffered_norm2
    get_param_id = Stage3.get_param_id

    def _swappable_optimizer_subgroup(self, i):
        return i in self.swappable

    def _get_param_partition_rank(self, param):
        return 0

    def is_gradient_accumulation_boundary(self):
        return self.boundary


def _param(ds_id: int, numel: int, real: bool = True):
    return types.SimpleNamespace(ds_id=ds_id, ds_numel=numel if real else 0, grad=None,
                                 partition_numel=lambda n=numel: n)


def make_optimizer(dtype: torch.dtype, streaming: bool, groups=((300, 17, 129), (40, 513)), swappable=(0,)):
    opt = FakeStage3()
    opt.offload_optimizer = opt.swap_optimizer = True
    opt.dtype = opt.gradient_accumulation_dtype = dtype
    opt.master_weights_and_grads_dtype = torch.float32
    opt.micro_step_id, opt.boundary, opt.swappable = 0, False, set(swappable)
    opt._offload_boundary_param_ids, opt.norm_for_param_grads = set(), {}
    opt.inf_or_nan_tracker = torch.zeros(1, dtype=torch.bool)
    ids = itertools.count()
    opt.fp16_groups = [[_param(next(ids), n) for n in sizes] for sizes in groups]
    opt.grad_position, opt.fp32_partitioned_groups_flat = {}, []
    for i, group in enumerate(opt.fp16_groups):
        offset = 0
        for p in group:
            opt.grad_position[p.ds_id] = [i, offset, p.partition_numel()]
            offset += p.partition_numel()
        fp32 = torch.zeros(offset)
        fp32.ds_id, fp32.grad = f"fp32-{i}", torch.zeros(offset)
        opt.fp32_partitioned_groups_flat.append(fp32)
    opt.optimizer_swapper = FakeSwapper(opt.fp32_partitioned_groups_flat, opt.swappable)
    params = list(itertools.chain.from_iterable(opt.fp16_groups))
    if streaming:
        opt.grad_partitions_flat_buffer = torch.empty(0, dtype=dtype)
        setattr(opt, MAP, {})
        setattr(opt, grad_stream.ACTIVE_ATTR, True)
    else:
        opt.grad_partitions_flat_buffer = torch.zeros(sum(p.partition_numel() for p in params), dtype=dtype)
        setattr(opt, MAP, dict(zip([p.ds_id for p in params],
                                   opt.grad_partitions_flat_buffer.split([p.partition_numel() for p in params]))))
    return opt


def run_windows(opt, partition_grads, grads_per_micro, buckets):
    """Feed each micro step's reduced partitions to ``partition_grads`` bucket by bucket."""
    params = list(itertools.chain.from_iterable(opt.fp16_groups))
    for micro, grads in enumerate(grads_per_micro):
        opt.micro_step_id, opt.boundary = micro, micro == len(grads_per_micro) - 1
        for bucket in buckets:
            partition_grads(opt, [params[i] for i in bucket], [grads[i] for i in bucket])


def target_state(opt):
    swapper = opt.optimizer_swapper
    files = {path: t.clone() for path, t in swapper.disk.items()}
    kept = {(info.param_id, off): t.clone() for info in swapper.swap_params_info.values()
            for off, t in info.unswapped_gradients.items()}
    dram = [g.grad.clone() for i, g in enumerate(opt.fp32_partitioned_groups_flat) if i not in opt.swappable]
    return files, kept, dram, dict(opt.norm_for_param_grads)


def assert_same_bits(a, b):
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_bits(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_bits(x, y)
    else:
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)


def random_grads(opt, dtype, micro_steps, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    params = list(itertools.chain.from_iterable(opt.fp16_groups))
    return [[(torch.randn(p.partition_numel(), generator=gen) * scale).to(dtype) for p in params]
            for _ in range(micro_steps)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("micro_steps", [1, 2, 3])
def test_swap_target_and_norms_match_stock(dtype, micro_steps):
    stock = make_optimizer(dtype, streaming=False)
    stream = make_optimizer(dtype, streaming=True)
    streaming_fn = grad_stream.make_partition_grads(Stage3.partition_grads)
    buckets = [[4, 0], [1, 2, 3]]  # stage 3 reduces buckets in backward's order
    for window in range(2):  # a second window starts again at micro step 0 (copy, no add)
        grads = random_grads(stock, dtype, micro_steps, seed=window, scale=1e3 if dtype == torch.float16 else 1.0)
        run_windows(stock, Stage3.partition_grads, grads, buckets)
        run_windows(stream, streaming_fn, [[g.clone() for g in m] for m in grads], buckets)
        assert_same_bits(target_state(stream), target_state(stock))
        assert stock.norm_for_param_grads and not stream.grad_partitions_flat_buffer.numel()
    assert all(p.grad is None for p in itertools.chain.from_iterable(stream.fp16_groups))


def test_fp16_overflow_found_per_bucket_like_stock_buffer_check():
    """An inf in micro step 0 stays inf/nan in the sum: stock's whole-buffer check and the streamed
    per-bucket check both flag it; a finite window flags nothing."""
    stream = make_optimizer(torch.float16, streaming=True)
    grads = random_grads(stream, torch.float16, 2, seed=3)
    grads[0][2][5] = float("inf")
    run_windows(stream, grad_stream.make_partition_grads(Stage3.partition_grads), grads, [[0, 1, 2, 3, 4]])
    assert bool(stream.inf_or_nan_tracker)
    stock = make_optimizer(torch.float16, streaming=False)
    run_windows(stock, Stage3.partition_grads, grads, [[0, 1, 2, 3, 4]])
    assert bool(torch.isinf(stock.grad_partitions_flat_buffer).any() | torch.isnan(stock.grad_partitions_flat_buffer).any())

    clean = make_optimizer(torch.float16, streaming=True)
    run_windows(clean, grad_stream.make_partition_grads(Stage3.partition_grads),
                random_grads(clean, torch.float16, 2, seed=4), [[0, 1, 2, 3, 4]])
    assert not bool(clean.inf_or_nan_tracker)


def test_bf16_does_not_check_overflow():
    opt = make_optimizer(torch.bfloat16, streaming=True)
    grads = random_grads(opt, torch.bfloat16, 1, seed=5)
    grads[0][0][0] = float("nan")
    run_windows(opt, grad_stream.make_partition_grads(Stage3.partition_grads), grads, [[0, 1, 2, 3, 4]])
    assert not bool(opt.inf_or_nan_tracker)  # stock checks only fp16 (_overflow_check_and_loss_scale_update)


def test_padding_only_partition_is_released_not_streamed():
    opt = make_optimizer(torch.bfloat16, streaming=True)
    params = list(itertools.chain.from_iterable(opt.fp16_groups))
    params[0].ds_numel = 0  # this rank's share is padding only
    params[0].grad = torch.ones(1)
    assert grad_stream.make_partition_grads(Stage3.partition_grads)(opt, [params[0]], [torch.ones(300)]) == []
    assert params[0].grad is None and params[0].ds_id not in opt._offload_boundary_param_ids


def test_unmanaged_finalize_reads_back_and_offloads_like_stock():
    """managed_gradient_accumulation false: backward never reaches the boundary; finalize offloads."""
    grads = random_grads(make_optimizer(torch.bfloat16, streaming=False), torch.bfloat16, 2, seed=7)
    states = []
    for streaming in (False, True):
        opt = make_optimizer(torch.bfloat16, streaming=streaming)
        fn = grad_stream.make_partition_grads(Stage3.partition_grads) if streaming else Stage3.partition_grads
        for micro, micro_grads in enumerate(grads):
            opt.micro_step_id, opt.boundary = micro, False
            fn(opt, list(itertools.chain.from_iterable(opt.fp16_groups)), [g.clone() for g in micro_grads])
        finalize = grad_stream.make_finalize_offload_gradient_accumulation(Stage3._finalize_offload_gradient_accumulation)
        finalize(opt)
        states.append(target_state(opt))
    assert_same_bits(states[1], states[0])


def test_non_streaming_optimizer_runs_the_original():
    calls = []
    fn = grad_stream.make_partition_grads(lambda self, p, g: calls.append((p, g)) or ["buffers"])
    opt = types.SimpleNamespace()
    assert fn(opt, ["p"], ["g"]) == ["buffers"] and calls == [(["p"], ["g"])]
    finalize = grad_stream.make_finalize_offload_gradient_accumulation(lambda self: calls.append("finalize"))
    finalize(opt)
    assert calls[-1] == "finalize"


@pytest.mark.parametrize(("attrs", "expected"), [
    ({}, True),
    ({"swap_optimizer": False}, False),  # optimizer in DRAM: stock's buffer kept
    ({"offload_optimizer": False}, False),
    ({"zenflow": True}, False),
    ({"master_weights_and_grads_dtype": torch.bfloat16}, False),  # fp32 could not hold the sums exactly
])
def test_eligible(attrs, expected):
    opt = types.SimpleNamespace(offload_optimizer=True, swap_optimizer=True, zenflow=False,
                                master_weights_and_grads_dtype=torch.float32,
                                gradient_accumulation_dtype=torch.float16)
    for key, value in attrs.items():
        setattr(opt, key, value)
    assert grad_stream.eligible(opt) is expected


def test_subclass_with_its_own_partition_grads_is_not_eligible():
    class SuperOffloadLike(FakeStage3):
        def partition_grads(self, params, grads):
            return []

    opt = make_optimizer(torch.bfloat16, streaming=False)
    opt.__class__ = SuperOffloadLike
    opt.zenflow = False
    assert not grad_stream.eligible(opt, FakeStage3.partition_grads)
    opt.__class__ = FakeStage3
    assert grad_stream.eligible(opt, FakeStage3.partition_grads)


def test_mirrors_installed_deepspeed_source():
    """The re-implemented methods are DeepSpeed 0.19.8's; another source keeps stock's buffer."""
    assert grad_stream.stock_source_matches(Stage3)

    class Changed(Stage3):
        def _setup_for_real_optimizer(self):
            return None

    assert not grad_stream.stock_source_matches(Changed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reduced_partitions_in_a_reused_bucket_buffer(dtype):
    """Stage 3's reduced partitions may be views of a buffer the next bucket overwrites (one rank:
    the IPG bucket itself); nothing the swap target keeps may alias them."""
    stock = make_optimizer(dtype, streaming=False)
    stream = make_optimizer(dtype, streaming=True)
    streaming_fn = grad_stream.make_partition_grads(Stage3.partition_grads)
    grads = random_grads(stock, dtype, 2, seed=11)
    buckets = [[0, 1, 2], [3, 4]]
    for opt, fn in ((stock, Stage3.partition_grads), (stream, streaming_fn)):
        params = list(itertools.chain.from_iterable(opt.fp16_groups))
        shared = torch.empty(sum(g.numel() for g in grads[0]), dtype=dtype)
        for micro, micro_grads in enumerate(grads):
            opt.micro_step_id, opt.boundary = micro, micro == 1
            for bucket in buckets:
                views = list(shared.narrow(0, 0, sum(micro_grads[i].numel() for i in bucket))
                             .split([micro_grads[i].numel() for i in bucket]))
                for view, i in zip(views, bucket):
                    view.copy_(micro_grads[i])
                fn(opt, [params[i] for i in bucket], views)
                shared.fill_(float("nan"))  # the next bucket's gradients land here
    assert_same_bits(target_state(stream), target_state(stock))
