"""16-bit gradient swap files (grad_store) through the chunk window (chunked_swap_out), against
DeepSpeed 0.19.8's ``PartitionedOptimizerSwapper``: each swappable gradient file is half the bytes
of stock's fp32 file (whole 4 KiB blocks), every read path widens it back to exactly the fp32
values (inf, nan and signed zeros included), and an fp32 write drops the 16-bit record."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from memascend.integrations.deepspeed import grad_store  # noqa: E402
from memascend.integrations.deepspeed.aligned_io import read_widened  # noqa: E402
from tests.integrations.test_ds_chunked_swap_out import (  # noqa: E402
    _call,
    _gradients,
    _swapper,
)

pytestmark = pytest.mark.usefixtures("single_rank")  # conftest: get_rank() is 0


def _special(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """bf16 gradients widened to fp32 (what streaming hands the swapper), with fp16 loss scaling's
    overflow values and a signed zero in the first."""
    out = [g.float() for g in grads]
    out[0][:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    return out


def _write(folder: Path, dtype: torch.dtype | None, grads: list[torch.Tensor], offsets: list[int]):
    swapper = _swapper(folder, True)
    fp32 = torch.empty(0)
    fp32.ds_id = "0_5"
    _call(True, "initialize_parameters", swapper, [fp32], [torch.zeros(sum(g.numel() for g in grads))])
    with grad_store.writing_as(swapper, dtype):
        _call(True, "swap_out_gradients", swapper, fp32, offsets, grads)
    from memascend.integrations.deepspeed.chunked_swap_out import complete_gradient_writes

    complete_gradient_writes(swapper)
    return swapper, swapper.swap_params_info["0_5"]


def test_16bit_files_are_half_and_read_back_exactly(tmp_path, aio_ok):
    grads, offsets = _gradients()
    grads = _special(grads)
    _, stock_info = _write(tmp_path / "fp32", None, grads, offsets)
    swapper, info = _write(tmp_path / "bf16", torch.bfloat16, grads, offsets)
    assert info.swapped_gradients.keys() == stock_info.swapped_gradients.keys() and len(info.swapped_gradients) >= 3
    fragments = list(info.swapped_gradients.values())
    for frag, stock in zip(fragments, stock_info.swapped_gradients.values()):
        size, stock_size = Path(frag.path).stat().st_size, Path(stock.path).stat().st_size
        assert size == grad_store.file_numel(frag.length, torch.bfloat16) * 2 and size % 4096 == 0
        assert stock_size == swapper._io_aligned_numel(frag.length) * 4 and size <= stock_size // 2 + 4096
        assert grad_store.stored_dtype(swapper, frag.path) == torch.bfloat16
    counters = grad_store.stats(types_ns(swapper))
    assert counters["files_16bit"] == len(fragments)
    assert counters["saved_write_bytes"] == sum(swapper._io_aligned_numel(f.length) * 4 for f in fragments) \
        - counters["written_16bit_bytes"] > 0
    # the fp32 values of every swapped fragment, bit for bit (nan's payload and -0.0 included)
    flat = torch.cat(grads)
    views = [torch.full((f.length,), 7.0) for f in fragments]
    read_widened(swapper.aio_handle, swapper, views, [f.path for f in fragments])
    for frag, view in zip(fragments, views):
        assert torch.equal(view.view(torch.int32), flat.narrow(0, frag.offset, frag.length).view(torch.int32))
    # an fp32 write of the same files (stock's writeback) drops their records: read as fp32 again
    from memascend.integrations.deepspeed.aligned_io import make_writeback_gradients

    parameter = torch.empty_like(flat)
    parameter.grad = flat.clone()
    make_writeback_gradients()(swapper, info, parameter, swapper.aio_handle)
    assert all(grad_store.stored_dtype(swapper, f.path) == torch.float32 for f in fragments)
    views = [torch.zeros(f.length) for f in fragments]
    read_widened(swapper.aio_handle, swapper, views, [f.path for f in fragments])
    assert all(torch.equal(v.view(torch.int32), flat.narrow(0, f.offset, f.length).view(torch.int32))
               for f, v in zip(fragments, views))


def types_ns(swapper):
    """An optimizer stand-in carrying the run's decision and the swapper, for :func:`grad_store.stats`."""
    import types

    opt = types.SimpleNamespace(optimizer_swapper=swapper)
    opt.__dict__[grad_store._RUN_ATTR] = {"dtype": torch.bfloat16, "reason": "test"}
    return opt


def test_a_bucket_is_16bit_only_unaccumulated_and_in_the_run_dtype():
    import types

    opt = types.SimpleNamespace()
    bf16, fp32 = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)
    assert grad_store.bucket_dtype(opt, [bf16], False) is None  # no decision: fp32
    opt.communication_data_type, opt.gradient_accumulation_steps = torch.bfloat16, 2
    opt.optimizer_swapper = types.SimpleNamespace(swap_buffer_manager=types.SimpleNamespace(allocate_window=None))
    assert grad_store.decide(opt, True) is None  # accumulation: fp32
    opt.gradient_accumulation_steps = 1
    assert grad_store.decide(opt, False) is None
    assert grad_store.decide(opt, True) == torch.bfloat16
    assert grad_store.bucket_dtype(opt, [bf16, bf16], False) == torch.bfloat16
    assert grad_store.bucket_dtype(opt, [bf16, fp32], False) is None
    assert grad_store.bucket_dtype(opt, [bf16], True) is None
    opt.communication_data_type = torch.float32  # reduced in fp32: a mean of 16-bit values is not 16-bit
    assert grad_store.decide(opt, True) is None
