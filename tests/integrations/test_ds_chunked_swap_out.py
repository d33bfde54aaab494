"""Gradient swap-out and the initial fp32 write-out through a chunk-sized window (chunked_swap_out)
against DeepSpeed 0.19.8's own ``PartitionedOptimizerSwapper``: the same files with the same bytes,
the same DRAM fragments, with a window far smaller than the largest tensor; and the raw store's
in-order piece writes leave each key whole with its CRC32C."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from memascend.config.settings import MemAscendSettings  # noqa: E402
from memascend.integrations.deepspeed import chunked_swap_out  # noqa: E402
from memascend.integrations.deepspeed.chunk_io import StoreRangeIO  # noqa: E402
from memascend.integrations.deepspeed.optimizer_swapper import make_swap_buffer_manager_class  # noqa: E402

CHUNK = 64 * 1024
"""Window elements: the largest gradient below spans several windows."""
LARGEST = 18 * CHUNK
"""The sub-group's elements (stock's buffers each hold this many)."""


pytestmark = pytest.mark.usefixtures("single_rank")  # conftest: get_rank() is 0


def _swapper(folder: Path, ours: bool):
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper

    aio = {"block_size": 1 << 20, "queue_depth": 8, "single_submit": False, "overlap_events": True,
           "intra_op_parallelism": 1}
    swapper = PartitionedOptimizerSwapper(types.SimpleNamespace(buffer_count=4), aio, str(folder),
                                          types.SimpleNamespace(state={}), LARGEST,
                                          torch.device("cpu"), torch.float32, None)
    if ours:
        swapper.swap_buffer_manager = make_swap_buffer_manager_class(MemAscendSettings())(
            swapper.largest_numel, 4, torch.float32, swapper.aio_handle)
    return swapper


def _call(ours: bool, name: str, swapper, *args):
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper

    stock = getattr(PartitionedOptimizerSwapper, name)
    method = getattr(chunked_swap_out, f"make_{name}")(stock, CHUNK) if ours else stock
    return method(swapper, *args)


def _run(folder: Path, ours: bool, grads: list[torch.Tensor], offsets: list[int]):
    """Initial write-out of a sub-group, two backward passes of gradient swap-out."""
    swapper = _swapper(folder, ours)
    fp32 = torch.empty(0)
    fp32.ds_id = "0_5"
    master = torch.randn(LARGEST - 100, generator=torch.Generator().manual_seed(3))  # unaligned: padded file
    _call(ours, "initialize_parameters", swapper, [fp32], [master])
    for scale in (1.0, -0.5):
        _call(ours, "swap_out_gradients", swapper, fp32, offsets, [g * scale for g in grads])
        if ours:  # the last window's writes are in flight until the swapper's flush completes them
            assert chunked_swap_out._IN_FLIGHT in vars(swapper)
            chunked_swap_out.make_flush_gradients(type(swapper).flush_gradients)(swapper)
            assert chunked_swap_out._IN_FLIGHT not in vars(swapper)
        else:
            swapper.flush_gradients()
    info = swapper.swap_params_info["0_5"]
    files = {p.name: p.read_bytes() for p in Path(swapper.swap_folder).iterdir()}
    return swapper, info, files


def _gradients():
    gen = torch.Generator().manual_seed(7)
    # swappable from 1 MiB (256 Ki fp32, min_aio_bytes) up: a tensor of five windows, one that
    # ends mid-window (the next is packed behind it), one kept in DRAM, one split at the I/O
    # alignment (its 77-element tail kept in DRAM)
    sizes = [5 * CHUNK + 2048, 300_032, 1000, 4 * CHUNK + 77, 4 * CHUNK]
    grads = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += n
    return grads, offsets


def test_same_files_and_fragments_as_stock_through_a_chunk_window(tmp_path, aio_ok):
    grads, offsets = _gradients()
    _, stock_info, stock_files = _run(tmp_path / "stock", False, grads, offsets)
    swapper, info, files = _run(tmp_path / "ours", True, grads, offsets)
    assert files.keys() == stock_files.keys() and len(files) == 1 + len(stock_info.swapped_gradients) >= 4
    assert all(files[name] == stock_files[name] for name in files), "file bytes differ from stock's"
    assert info.swapped_gradients.keys() == stock_info.swapped_gradients.keys()
    assert info.unswapped_gradients.keys() == stock_info.unswapped_gradients.keys()
    assert all(torch.equal(info.unswapped_gradients[k], stock_info.unswapped_gradients[k])
               for k in info.unswapped_gradients)
    # The locked window is one chunk, however large the sub-group and its largest gradient.
    manager = swapper.swap_buffer_manager
    assert manager.peak_window_bytes == CHUNK * 4 < max(g.numel() for g in grads) * 4
    assert manager.peak_locked_bytes == CHUNK * 4 and manager.all_buffers == []
    assert manager.release_free_buffers() == CHUNK * 4 and manager.locked_bytes() == 0


def test_piece_writer_on_the_raw_store_records_whole_keys(tmp_path):
    from memascend.integrations.deepspeed.swap_backend import StoreSwapHandle
    from memascend.io.store import TensorStore

    with TensorStore.create(tmp_path / "store.bin", size_bytes=64 << 20, request_bytes=256 << 10) as store:
        handle = StoreSwapHandle(store)
        buffer = handle.new_cpu_locked_tensor(CHUNK, torch.empty(0))
        writer = chunked_swap_out.PieceWriter(StoreRangeIO(handle), buffer)
        gen = torch.Generator().manual_seed(11)
        sources = {"a": torch.randn(4 * CHUNK + 512, generator=gen).bfloat16(),
                   "b": torch.randn(3000, generator=gen), "c": torch.randn(CHUNK, generator=gen).bfloat16()}
        file_numels = {"a": 4 * CHUNK + 512, "b": 3072, "c": CHUNK}
        for key, src in sources.items():
            writer.add(src, key, file_numels[key])
        writer.flush()
        assert writer.pieces_written >= 6
        for key, src in sources.items():
            out = torch.empty(file_numels[key])
            assert handle.sync_pread(out, key) == 1  # a whole read checks the recorded CRC32C
            expected = torch.zeros(file_numels[key])
            expected[: src.numel()] = src.float()
            assert torch.equal(out, expected) and store.record(key).nbytes == file_numels[key] * 4
