"""The input embedding of a tied output head adds its gradient rows into the head's, in place.

A causal LM whose input embedding and output head are one ``nn.Parameter`` (``tie_word_embeddings``)
ends every backward pass with two vocabulary-sized gradients of it at once: the head's (``vocab x
hidden``, from ``F.linear``'s backward, held in autograd's input buffer of the parameter) and the
lookup's, which stock torch 2.x computes with ``aten::embedding_dense_backward``: a zero-filled
``vocab x hidden`` tensor to which the gradient of every token position is added. Autograd then adds
the second into the first. The lookup's gradient is zero outside the rows of the micro-batch's tokens.

:func:`install` replaces the ``forward`` of such an embedding (on the instance; ``nn.Module.__call__``
and with it every forward hook, DeepSpeed ZeRO-3's parameter fetch included, is unchanged) by
:class:`SparseRowsLookup` where the lookup records gradients on the CPU. Its backward computes the
touched rows with the same kernel on a compacted problem: ``u, inv = torch.unique(ids, sorted=True,
return_inverse=True)``, ``aten::embedding_dense_backward(grad, inv, len(u), padding_idx's position in
u or -1, scale_grad_by_freq)``, each row the kernel's sequential sum over the token positions in order
(from +0.0), as in stock's ``vocab``-row call. To autograd it returns a zero of stride 0 expanded to
``vocab x hidden`` (no memory), which autograd adds in place into the head's gradient: ``lm + 0.0``,
what stock's zero rows give. A post-accumulate-grad hook on the parameter (:func:`_settle_gradient`,
registered before DeepSpeed's, which reads ``param.grad``) then adds the rows into ``param.grad`` in
place. One vocabulary-sized gradient fewer at the end of the backward pass.

Bit-identical to stock:

* untouched rows are ``lm + 0.0`` in both, through the same add kernel (same vector lanes);
* a touched row is ``(lm + 0.0) + rows`` against stock's ``lm + rows``: ``(a + 0) + b`` equals
  ``(a + b) + 0`` in IEEE arithmetic with round to nearest, and ``a + b`` is never -0.0 here (the
  kernel's sums start at +0.0, so ``rows`` is never -0.0), so the values are equal; a NaN takes the
  encoding of the add that wrote it (bf16: its kernel lane's canonical NaN), so where a touched row
  holds a NaN the hook adds 0.0 to the whole gradient once more, through stock's lanes (it changes
  nothing else: no -0.0 is left);
* where only the rows reach the parameter (the head unused), a tensor hook turns the expanded zero into
  ``zeros`` with the rows copied in: stock's tensor;
* the rows are added last, so they must arrive last: only the lookup created first among the
  parameter's pending lookups (autograd runs nodes created later first) returns the zero, the others
  stock's dense gradient; and only where ``param.grad`` is empty before the backward pass (a gradient
  accumulated into an existing one is added in another order: stock's dense gradient then). The
  lookup is taken to be the parameter's first use in the forward pass (a causal LM's input embedding
  is its first operation); a use of the weight created before it in the same graph would be summed
  after the rows.

Only where it is safe and helps: an ``nn.Embedding`` (its class's own ``forward``, none on the
instance), ``sparse=False``, ``max_norm=None``, trainable, whose weight is the weight of an
``nn.Linear`` of the same model (the output head); no other embedding with ``sparse=True`` shares it,
and it has no post-accumulate-grad hook yet (the seam installs before ``DeepSpeedEngine.__init__``).
At call time the lookup falls back to stock's ``forward`` without gradients (evaluation,
``no_grad``, inference mode), for a weight off the CPU (the CUDA kernel's summation order is not
checked here), a frozen or replaced weight, or ``max_norm``/``sparse`` set since.

Replaces torch 2.13 ``nn.Embedding.forward`` (``F.embedding``) and, for its gradient,
``EmbeddingBackward0``'s ``aten::embedding_dense_backward``. :func:`grad_path` says whether it ran
(``report.json`` ``memory_breakdown.gradient_buffers.tied_embedding_grad``).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SparseRowsLookup", "eligible_embeddings", "grad_path", "install", "make_engine_init", "reset_stats",
           "stats", "uninstall"]


@dataclasses.dataclass
class _ParamState:
    """What one tied parameter's lookups and its gradient hooks share."""

    param: nn.Parameter
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    pending: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)
    """The lookups (their autograd nodes) whose backward has not run; a freed graph drops out."""
    task_id: int = -1
    """Graph task (``torch._C._current_graph_task_id``) whose rows are to be added, or -1."""
    rows: tuple[torch.Tensor, torch.Tensor] | None = None
    """That task's rows: their indices (int64, sorted) and values (``len x hidden``)."""

    def last_to_arrive(self, node: Any, task_id: int) -> bool:
        """Whether ``node``'s rows may be added last in ``task_id``: no lookup created before it is
        pending (autograd runs the nodes created later first) and none of this task has rows yet."""
        with self.lock:
            self.pending.discard(node)
            seq = node._sequence_nr()
            return self.task_id != task_id and all(other._sequence_nr() > seq for other in list(self.pending))

    def record(self, task_id: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        with self.lock:
            self.task_id, self.rows = task_id, (rows, values)

    def take(self, task_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows recorded in ``task_id`` (forgotten then), or ``None``."""
        with self.lock:
            if self.task_id != task_id:
                return None
            rows, self.task_id, self.rows = self.rows, -1, None
            return rows


_lock = threading.Lock()
_handles: list[Any] = []
"""Gradient hooks of the installed parameters (removed by :func:`uninstall`)."""
_installed: dict[int, _ParamState] = {}
"""id(module) -> the state of its weight, for the installed embeddings."""
_stats = {"rows_backwards": 0, "dense_backwards": 0, "rows_alone": 0}


class SparseRowsLookup(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx, scale_grad_by_freq=...)`` whose weight gradient is added
    by the parameter's hooks as the rows of the tokens used.

    Forward: ``ids`` (int64 or int32, any shape ``S``, values in ``[0, vocab)``), ``weight`` (``vocab x
    hidden``, any floating dtype) -> ``S x hidden`` in the weight's dtype, as ``F.embedding``.

    Backward: where its rows may be added last (:meth:`_ParamState.last_to_arrive`) and the parameter
    has no gradient yet, a zero of the incoming gradient's dtype expanded (stride 0) to ``vocab x
    hidden``, with the rows (the sorted distinct ids, int64, and ``aten::embedding_dense_backward`` of
    the compacted problem, ``len x hidden``; the row of ``padding_idx``, where used, zeros) left for the
    hooks; otherwise stock's dense gradient (``aten::embedding_dense_backward`` over the vocabulary).
    """

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None,
                scale_grad_by_freq: bool, state: _ParamState) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.num_weights = int(weight.shape[0])
        ctx.padding_idx = -1 if padding_idx is None else int(padding_idx)
        ctx.scale_grad_by_freq = bool(scale_grad_by_freq)
        ctx.state = state
        with state.lock:
            state.pending.add(ctx)
        return F.embedding(ids, weight, padding_idx, None, 2.0, scale_grad_by_freq, False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (ids,) = ctx.saved_tensors
        state: _ParamState = ctx.state
        task_id = torch._C._current_graph_task_id()
        if not state.last_to_arrive(ctx, task_id) or state.param.grad is not None:
            _count("dense_backwards")
            dense = torch.ops.aten.embedding_dense_backward(grad, ids, ctx.num_weights, ctx.padding_idx,
                                                            ctx.scale_grad_by_freq)
            return None, dense, None, None, None
        rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        rows = rows.to(torch.int64)
        padding = -1
        if ctx.padding_idx >= 0 and rows.numel():
            at = int(torch.searchsorted(rows, ctx.padding_idx))
            padding = at if at < rows.numel() and int(rows[at]) == ctx.padding_idx else -1
        hidden = grad.shape[-1]
        values = torch.ops.aten.embedding_dense_backward(grad.reshape(-1, hidden), inverse.reshape(-1),
                                                         rows.numel(), padding, ctx.scale_grad_by_freq)
        state.record(task_id, rows, values)
        _count("rows_backwards")
        zero = torch.zeros((), dtype=grad.dtype, device=grad.device).expand(ctx.num_weights, hidden)
        return None, zero, None, None, None


def _count(key: str) -> None:
    with _lock:
        _stats[key] += 1


def _rows_alone(state: _ParamState, grad: torch.Tensor) -> torch.Tensor | None:
    """The tied parameter's gradient pre-hook: where the lookup's expanded zero alone reached it (the
    head unused), stock's tensor: zeros with the rows copied in (``vocab x hidden``, contiguous)."""
    if grad.dim() != 2 or grad.stride() != (0, 0) or grad.numel() < 2:
        return None
    taken = state.take(torch._C._current_graph_task_id())
    if taken is None:
        return None
    rows, values = taken
    _count("rows_alone")
    return torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device).index_copy_(0, rows, values)


def _settle_gradient(state: _ParamState, param: nn.Parameter) -> None:
    """The tied parameter's post-accumulate-grad hook: adds this backward pass's rows into
    ``param.grad`` (``lm + 0.0`` from autograd's in-place sum), in place, with stock's bits.

    Runs after ``AccumulateGrad`` stored the pass's sum and before DeepSpeed's hook (:func:`install`
    registers it first). Holds ``len(rows) x hidden`` elements besides the gradient.
    """
    taken = state.take(torch._C._current_graph_task_id())
    grad = param.grad
    if taken is None or grad is None:
        return
    rows, values = taken
    touched = grad.index_select(0, rows).add_(values)
    grad.index_copy_(0, rows, touched)
    if bool(torch.isnan(touched).any()):
        grad.add_(0.0)  # a NaN in stock's encoding: its lane of the full-tensor add (no -0.0 is left)


def _plain_forward(module: nn.Module) -> bool:
    return type(module).forward is nn.Embedding.forward and "forward" not in vars(module)


def eligible_embeddings(model: nn.Module) -> list[nn.Embedding]:
    """The input embeddings of ``model`` whose lookup :func:`install` replaces.

    An ``nn.Embedding`` qualifies where it uses its class's ``forward`` (no subclass override, none on
    the instance), ``sparse`` is false, ``max_norm`` is ``None``, its weight requires a gradient and
    is also the ``weight`` of an ``nn.Linear`` (plain ``forward``) of ``model`` -- a tied output head --
    and no ``sparse=True`` embedding shares it, and it has no post-accumulate-grad hook yet (the
    settling hook must run first). Each weight counts once (its first such embedding).

    Args:
        model: any ``torch.nn.Module`` (a ZeRO-3 partitioned one included: identity of the
            ``Parameter`` objects is what is compared).
    """
    owners: dict[int, list[nn.Module]] = {}
    modules = list(model.modules())
    for module in modules:
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    out: list[nn.Embedding] = []
    seen: set[int] = set()
    for module in modules:
        if not isinstance(module, nn.Embedding) or not _plain_forward(module):
            continue
        weight = module._parameters.get("weight")
        if weight is None or id(weight) in seen or not weight.requires_grad or module.sparse \
                or module.max_norm is not None or getattr(weight, "_post_accumulate_grad_hooks", None):
            continue  # (a hook already there, DeepSpeed's reading param.grad, would run before the settling one)
        sharing = owners.get(id(weight), [])
        heads = [m for m in sharing if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward]
        if heads and not any(isinstance(m, nn.Embedding) and m.sparse for m in sharing):
            seen.add(id(weight))
            out.append(module)
    return out


def _make_forward(module: nn.Embedding, state: _ParamState) -> Any:
    stock = nn.Embedding.forward.__get__(module)

    def forward(input: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if (weight is state.param and weight.requires_grad and torch.is_grad_enabled() and weight.device.type == "cpu"
                and module.max_norm is None and not module.sparse and not torch._C._get_tracing_state()
                and not torch.compiler.is_compiling()):
            return SparseRowsLookup.apply(input, weight, module.padding_idx, module.scale_grad_by_freq, state)
        return stock(input)

    forward.__wrapped__ = stock  # type: ignore[attr-defined]
    return forward


def install(registry: Any, model: nn.Module) -> int:
    """Replace the lookup of every :func:`eligible_embeddings` of ``model`` (once per module).

    Args:
        registry: the seam's :class:`~memascend.integrations.deepspeed.patches.PatchRegistry`: each
            module's instance ``forward`` is patched through it (its revert deletes the attribute, so
            the class's ``forward`` shows again).
        model: the model (``DeepSpeedEngine.module``).

    Returns:
        How many embeddings were replaced now.
    """
    count = 0
    with _lock:
        for module in eligible_embeddings(model):
            if id(module) in _installed:
                continue
            state = _ParamState(module.weight)
            registry.patch(module, "forward", _make_forward(module, state))
            _handles.append(module.weight.register_hook(lambda grad, state=state: _rows_alone(state, grad)))
            _handles.append(module.weight.register_post_accumulate_grad_hook(
                lambda param, state=state: _settle_gradient(state, param)))
            _installed[id(module)] = state
            count += 1
    return count


def make_engine_init(original: Callable[..., None], install_into: Callable[[Any], None]) -> Callable[..., None]:
    """Replacement for ``DeepSpeedEngine.__init__`` (DeepSpeed 0.19.8: ``(self, args, model, optimizer=None,
    ...)``) that calls ``install_into(model)`` first, then ``original`` with the same arguments.

    Before: the stage-3 optimizer registers DeepSpeed's post-accumulate-grad hooks in ``original``,
    after :func:`install`'s, so the rows are in the gradient before DeepSpeed reads it. Subclasses
    (``PipelineEngine``) reach it through ``super().__init__``. A ``model`` that is not a
    ``torch.nn.Module`` is passed on untouched.
    """

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        model = kwargs["model"] if "model" in kwargs else (args[1] if len(args) > 1 else None)
        if isinstance(model, nn.Module):
            install_into(model)
        original(self, *args, **kwargs)

    return __init__


def uninstall() -> None:
    """Remove the gradient hooks :func:`install` registered (two per weight) and forget the modules (the seam's
    registry restores their ``forward``). The counters stay for a report written after it."""
    with _lock:
        for handle in _handles:
            handle.remove()
        _handles.clear()
        _installed.clear()


def reset_stats() -> None:
    """Zero the counters (the seam calls it when it is applied)."""
    with _lock:
        for key in _stats:
            _stats[key] = 0


def stats() -> dict[str, int]:
    """Counters since :func:`reset_stats`: ``rows_backwards`` (backward passes of a replaced lookup whose
    rows the hooks added), ``dense_backwards`` (replaced lookups that returned stock's dense gradient:
    a lookup created earlier still pending, or the parameter's gradient not empty), ``rows_alone`` (of
    ``rows_backwards``, those whose rows alone reached the parameter, made stock's dense tensor)."""
    with _lock:
        return dict(_stats)


def grad_path() -> str:
    """``"sparse_rows"`` where a replaced lookup's gradient was added as its rows since the seam was
    applied (``stats()["rows_backwards"]``), else ``"dense"`` (stock's ``embedding_dense_backward`` only)."""
    return "sparse_rows" if stats()["rows_backwards"] else "dense"
