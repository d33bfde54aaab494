"""The sparse-rows lookup of a tied input embedding (:mod:`memascend.integrations.deepspeed.tied_embedding`)
gives stock torch's weight gradient bit for bit, only where it is safe, and reverts exactly.

In-process checks on plain torch models (an ``nn.Embedding`` whose weight is an ``nn.Linear`` head's);
end to end: a script driving DeepSpeed itself (``tied_embedding_worker.py``, ZeRO-3, stock then
memascend in one process) and ``memascend finetune`` against a live ``--engine baseline`` run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from memascend.integrations.deepspeed import tied_embedding as te
from memascend.integrations.deepspeed.patches import PatchRegistry

WORKER = Path(__file__).with_name("tied_embedding_worker.py")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TiedLM(nn.Module):
    """Embedding -> tanh -> tied head -> logsumexp; ``extra``: a dense ``vocab x hidden`` tensor ``C``
    whose ``(W * C).sum()`` adds ``C`` itself to the weight gradient (to place -0.0 and NaN there)."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, padding_idx: int | None = None,
                 scale_grad_by_freq: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq,
                                  dtype=dtype)
        self.head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, extra: torch.Tensor | None = None, use_head: bool = True,
                lookups: int = 1) -> torch.Tensor:
        w = self.embed.weight
        h = sum(self.embed(ids if i == 0 else ids.flip(-1)) for i in range(lookups))
        loss = torch.tanh(h.float()).sum() * 1e-3
        if use_head:
            loss = loss + self.head(torch.tanh(h.float()).to(w.dtype)).float().logsumexp(-1).mean()
        if extra is not None:
            loss = loss + (w * extra).float().sum()
        return loss


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _grad(model: nn.Module, *args, accumulate: int = 1, **kwargs) -> torch.Tensor:
    model.embed.weight.grad = None
    for _ in range(accumulate):
        model(*args, **kwargs).backward()
    return model.embed.weight.grad.clone()


def _stock_and_ours(model: nn.Module, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, dict]:
    stock = _grad(model, *args, **kwargs)
    registry = PatchRegistry()
    te.reset_stats()
    assert te.install(registry, model) == 1
    try:
        ours = _grad(model, *args, **kwargs)
        assert ours.layout == torch.strided
        stats = te.stats()
    finally:
        registry.restore_all()
        te.uninstall()
    return stock, ours, stats


def _stock_and_ours_with_forward(model: nn.Module, forward, *args) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """:func:`_stock_and_ours` with ``forward`` as the model instance's ``forward`` (removed after)."""
    model.forward = forward
    try:
        return _stock_and_ours(model, *args)
    finally:
        del model.forward


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b)), f"{int((_bits(a) != _bits(b)).sum())} elements differ in their bits"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding_idx,scale", [(None, False), (3, False), (None, True), (5, True), (299, False)])
def test_gradient_is_stocks_bit_for_bit(dtype, padding_idx, scale):
    torch.manual_seed(0)
    model = TiedLM(300, 16, dtype, padding_idx, scale)
    ids = torch.randint(0, 20, (4, 33))
    ids[0, :5] = 3  # repeated tokens, the padding row among them
    ids[1, :3] = 5
    stock, ours, stats = _stock_and_ours(model, ids)
    _assert_same_bits(stock, ours)
    assert stats == {"rows_backwards": 1, "dense_backwards": 0, "rows_alone": 0}


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_zero_and_nan_rows_are_stocks(dtype):
    """Stock adds the lookup's +0.0 to rows no token used: the -0.0 of the other gradient (``extra``)
    becomes +0.0 there, and a NaN takes the add's encoding."""
    torch.manual_seed(1)
    vocab, hidden = 64, 8
    model = TiedLM(vocab, hidden, dtype)
    extra = torch.zeros(vocab, hidden, dtype=dtype)
    extra[::2] = -0.0
    extra[1::4, 0] = float("nan")
    ids = torch.tensor([[1, 2, 2, 4, 7, 2]])
    stock, ours, _ = _stock_and_ours(model, ids, extra, use_head=False)
    negative_zero = (stock == 0) & stock.signbit()
    assert not negative_zero.any()
    _assert_same_bits(stock, ours)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_unused_leaves_a_dense_gradient_equal_to_stocks(dtype):
    model = TiedLM(50, 8, dtype)
    ids = torch.tensor([[1, 2, 2, 9]])
    stock, ours, stats = _stock_and_ours(model, ids, use_head=False)
    _assert_same_bits(stock, ours)
    assert stats["rows_alone"] == 1


def test_two_lookups_in_one_backward_one_adds_rows_the_other_stocks_dense():
    model = TiedLM(100, 8, torch.bfloat16)
    ids = torch.randint(0, 30, (2, 17), generator=torch.Generator().manual_seed(3))
    stock, ours, stats = _stock_and_ours(model, ids, lookups=2)
    _assert_same_bits(stock, ours)
    assert stats == {"rows_backwards": 1, "dense_backwards": 1, "rows_alone": 0}


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulating_into_an_existing_gradient_is_stocks(dtype):
    model = TiedLM(80, 8, dtype)
    ids = torch.randint(0, 25, (3, 11), generator=torch.Generator().manual_seed(4))
    stock, ours, stats = _stock_and_ours(model, ids, accumulate=3)
    _assert_same_bits(stock, ours)
    # the first pass adds its rows; later ones add into an existing gradient: stock's dense one
    assert stats == {"rows_backwards": 1, "dense_backwards": 2, "rows_alone": 0}


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_lookup_is_stocks(use_reentrant):
    """The lookup inside an activation checkpoint: recomputed in backward (reentrant: in a nested
    backward pass of its own, where its rows reach the parameter alone)."""
    model = TiedLM(120, 8, torch.bfloat16)
    ids = torch.randint(0, 40, (2, 19), generator=torch.Generator().manual_seed(5))

    scale = torch.ones((), requires_grad=True)  # reentrant: a float input needing a gradient, else none flows

    def forward(ids, **kwargs):
        emb = checkpoint(lambda x, s: torch.tanh(model.embed(x).float()) * s, ids, scale, use_reentrant=use_reentrant)
        logits = model.head(emb.to(model.embed.weight.dtype)).float()
        return logits.logsumexp(-1).mean()

    stock, ours, stats = _stock_and_ours_with_forward(model, forward, ids)
    _assert_same_bits(stock, ours)
    assert stats["rows_backwards"] + stats["dense_backwards"] == 1


def test_chunked_loss_head_called_per_chunk_is_stocks():
    """As ``memascend.train.chunked_loss``: the head run once per token chunk under a non-reentrant
    checkpoint, several dense contributions before the lookup's rows."""
    model = TiedLM(90, 8, torch.bfloat16)
    ids = torch.randint(0, 30, (1, 24), generator=torch.Generator().manual_seed(6))

    def forward(ids, **kwargs):
        h = torch.tanh(model.embed(ids).float()).to(torch.bfloat16)[0]
        parts = [checkpoint(lambda x: model.head(x).float().logsumexp(-1).sum(), chunk, use_reentrant=False)
                 for chunk in h.split(8)]
        return sum(parts) / h.shape[0]

    stock, ours, _ = _stock_and_ours_with_forward(model, forward, ids)
    _assert_same_bits(stock, ours)


@settings(max_examples=40, deadline=None)
@given(vocab=st.integers(2, 200), hidden=st.integers(1, 24), batch=st.integers(1, 3), seq=st.integers(0, 40),
       distinct=st.integers(1, 200), dtype=st.sampled_from(DTYPES), scale=st.booleans(),
       padding=st.one_of(st.none(), st.integers(0, 199)), seed=st.integers(0, 2**16))
def test_any_shape_gives_stocks_bits(vocab, hidden, batch, seq, distinct, dtype, scale, padding, seed):
    padding = None if padding is None or padding >= vocab else padding
    torch.manual_seed(seed)
    model = TiedLM(vocab, hidden, dtype, padding, scale)
    ids = torch.randint(0, min(distinct, vocab), (batch, seq))
    stock, ours, _ = _stock_and_ours(model, ids)
    _assert_same_bits(stock, ours)


def test_int32_ids_and_empty_batches():
    model = TiedLM(40, 4, torch.float32)
    for ids in (torch.tensor([[3, 3, 7]], dtype=torch.int32), torch.zeros(1, 0, dtype=torch.int64)):
        stock, ours, _ = _stock_and_ours(model, ids)
        _assert_same_bits(stock, ours)


def test_no_grad_and_eval_run_stocks_lookup():
    model = TiedLM(30, 4, torch.float32)
    registry = PatchRegistry()
    te.install(registry, model)
    try:
        ids = torch.tensor([[1, 2]])
        with torch.no_grad():
            out = model.embed(ids)
        assert out.grad_fn is None and torch.equal(out, model.embed.weight[ids])
        with torch.inference_mode():
            assert torch.equal(model.embed(ids), model.embed.weight[ids])
        assert type(model.embed(ids).grad_fn).__name__ == "SparseRowsLookupBackward"
        model.embed.weight.requires_grad_(False)
        assert model.embed(ids).grad_fn is None
    finally:
        registry.restore_all()
        te.uninstall()


class _OwnForward(nn.Embedding):
    def forward(self, input):
        return super().forward(input) * 2


def _tied(embed: nn.Embedding, head: nn.Module | None = None) -> nn.Module:
    model = nn.Module()
    model.embed = embed
    if head is not None:
        head.weight = embed.weight
        model.head = head
    return model


@pytest.mark.parametrize("case", ["untied", "frozen", "sparse", "max_norm", "subclass_forward", "instance_forward",
                                  "head_not_linear", "sparse_sharer", "hooked"])
def test_not_applied_where_unsafe(case):
    embed = nn.Embedding(20, 4, sparse=case == "sparse", max_norm=1.0 if case == "max_norm" else None)
    if case == "subclass_forward":
        embed = _OwnForward(20, 4)
    head: nn.Module | None = nn.Linear(4, 20, bias=False)
    if case == "untied":
        head = None
    if case == "head_not_linear":
        head = nn.Embedding(20, 4)
    model = _tied(embed, head)
    if case == "untied":
        model.head = nn.Linear(4, 20, bias=False)
    if case == "frozen":
        embed.weight.requires_grad_(False)
    if case == "instance_forward":
        embed.forward = embed.forward
    if case == "sparse_sharer":
        model.other = nn.Embedding(20, 4, sparse=True)
        model.other.weight = embed.weight
    if case == "hooked":
        embed.weight.register_post_accumulate_grad_hook(lambda p: None)
    assert te.eligible_embeddings(model) == []
    registry = PatchRegistry()
    assert te.install(registry, model) == 0
    assert len(registry) == 0


def test_install_twice_is_once_and_revert_restores():
    model = TiedLM(30, 4, torch.float32)
    class_forward = type(model.embed).forward
    registry = PatchRegistry()
    assert te.install(registry, model) == 1
    assert te.install(registry, model) == 0
    weight = model.embed.weight
    assert "forward" in vars(model.embed)
    assert len(weight._post_accumulate_grad_hooks) == 1 and len(weight._backward_hooks) == 1
    registry.restore_all()
    te.uninstall()
    assert "forward" not in vars(model.embed) and not weight._post_accumulate_grad_hooks and not weight._backward_hooks
    assert type(model.embed).forward is class_forward
    assert model.embed(torch.tensor([1])).grad_fn.name() == "EmbeddingBackward0"
    assert te.install(registry, model) == 1  # installable again after uninstall
    registry.restore_all()
    te.uninstall()


def test_engine_init_wrapper_installs_before_the_original():
    calls = []

    def original(self, args=None, model=None, optimizer=None):
        calls.append(("original", model))

    init = te.make_engine_init(original, lambda model: calls.append(("install", model)))
    model = TiedLM(10, 2, torch.float32)
    init(object(), None, model)
    init(object(), args=None, model=model)
    init(object(), None, None)
    assert [c[0] for c in calls] == ["install", "original", "install", "original", "original"]
    assert calls[0][1] is model


def test_lookup_off_the_cpu_is_stocks():
    model = TiedLM(10, 2, torch.float32)
    registry = PatchRegistry()
    te.install(registry, model)
    try:
        model.to("meta")  # the same Parameter objects, their data on another device
        assert model.embed(torch.tensor([1], device="meta")).grad_fn.name() == "EmbeddingBackward0"
    finally:
        registry.restore_all()
        te.uninstall()


def test_deepspeed_script_zero3_gives_stocks_losses_and_weights(tmp_path):
    """A script driving DeepSpeed itself (``zero.Init``, ``deepspeed.initialize``, ZeRO-3 with offload,
    bf16, clipping): stock and memascend, same losses and the same tied weight after 3 steps; the
    lookup ran sparse under memascend and ``revert()`` took it off."""
    pytest.importorskip("deepspeed")
    proc = subprocess.run([sys.executable, str(WORKER)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("TIED_EMBEDDING_REPORT ")), None)
    assert line is not None, proc.stderr[-4000:]
    report = json.loads(line.split(" ", 1)[1])
    stock, ours = report["stock"], report["memascend"]
    assert ours["losses_hex"] == stock["losses_hex"]
    assert ours["weight_sha256"] == stock["weight_sha256"]
    assert (ours["replaced"], ours["grad_path"], ours["stats"]["rows_backwards"]) == (True, "sparse_rows", 3)
    assert (stock["replaced"], stock["grad_path"]) == (False, "dense")
    assert ours["hooks_during"] == stock["hooks_during"] + 1 and ours["hooks_after"] == stock["hooks_after"]
    assert not ours["forward_after"]


FINETUNE_ARGS = ["--from-scratch", "llama-tiny", "--steps", "3", "--seq-len", "32", "--micro-batch", "2",
                 "--eval-blocks", "0", "--no-save-model", "--report-to", "none"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [
    ["--grad-accum", "1"],
    ["--grad-accum", "2", "--dtype", "fp16", "--activation-checkpointing", "--loss-chunk-tokens", "16"],
], ids=["bf16", "fp16-accum-checkpointing-chunked-loss"])
def test_finetune_gives_the_baselines_losses(tmp_path, extra):
    """``memascend finetune`` (the lookup sparse) against a live ``--engine baseline`` run (stock)."""
    pytest.importorskip("deepspeed")
    from tests.conftest import finetune_report

    ours = finetune_report(tmp_path, "memascend", FINETUNE_ARGS, *extra)
    stock = finetune_report(tmp_path, "baseline", FINETUNE_ARGS, *extra, "--engine", "baseline")
    assert ours["memory_breakdown"]["gradient_buffers"]["tied_embedding_grad"] == "sparse_rows"
    assert stock["memory_breakdown"]["gradient_buffers"]["tied_embedding_grad"] == "dense"
    assert ours["memascend_settings"]["enable_sparse_tied_embedding_grad"] is True
    assert ours["losses_hex"] == stock["losses_hex"]
