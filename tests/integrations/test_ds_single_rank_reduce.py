"""The one-rank reduce-scatter (single_rank_reduce) against DeepSpeed 0.19.8's own
``reduce_scatter_coalesced`` over a real one-rank gloo group: the same bits, without the copies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from memascend.integrations.deepspeed.single_rank_reduce import make_reduce_scatter_coalesced  # noqa: E402
from memascend.train.dist import free_port  # noqa: E402


def _buckets() -> list[list[torch.Tensor]]:
    """Buckets as stage 3 reduces them: one tensor, several of odd sizes, bf16 and fp32, with
    infinities, NaNs and signed zeros."""
    gen = torch.Generator().manual_seed(7)
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-40])
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        out.append([torch.randn(64, 48, generator=gen).to(dtype)])
        out.append([torch.randn(n, generator=gen).to(dtype) for n in (1, 7, 4097, 3)]
                   + [torch.cat([special, torch.randn(5, generator=gen)]).to(dtype)])
    return out


def _bits(tensor: torch.Tensor) -> list[int]:
    as_int = torch.int16 if tensor.element_size() == 2 else torch.int32
    return tensor.contiguous().view(as_int).tolist()


def _rank_main(rank: int, port: int, out: str) -> None:
    import os

    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="gloo")
    replacement = make_reduce_scatter_coalesced(reduce_scatter_coalesced, dist.get_world_size)
    results = []
    for bucket in _buckets():
        stock = reduce_scatter_coalesced([t.clone() for t in bucket], None)
        inputs = [t.clone() for t in bucket]
        ours = replacement(inputs, None)
        results.append({"stock": [_bits(t) for t in stock], "ours": [_bits(t) for t in ours],
                        "aliases_input": all(o.data_ptr() == i.data_ptr() for o, i in zip(ours, inputs)),
                        "shapes": [list(o.shape) for o in ours], "numels": [t.numel() for t in bucket]})
    Path(out).write_text(json.dumps(results))
    import torch.distributed as tdist

    tdist.destroy_process_group()


@pytest.mark.distributed
def test_one_rank_matches_stock_bits_without_copies(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "results.json"
    mp.start_processes(_rank_main, args=(free_port(), str(out)), nprocs=1, start_method="spawn")
    results = json.loads(out.read_text())
    assert len(results) == 4
    for case in results:
        assert case["ours"] == case["stock"]
        assert case["aliases_input"]  # no flat copy: each result is its gradient, flattened
        assert case["shapes"] == [[n] for n in case["numels"]]


def test_larger_groups_run_stock():
    calls = []

    def original(tensors, group=None):
        calls.append((tensors, group))
        return ["stock"]

    replacement = make_reduce_scatter_coalesced(original, lambda group: 2)
    grads = [torch.ones(3)]
    assert replacement(grads, "group") == ["stock"]
    assert calls == [(grads, "group")]
    assert replacement.__wrapped__ is original
