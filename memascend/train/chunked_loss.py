"""The causal-LM loss over a long sequence without the whole logits tensor (``--loss-chunk-tokens``).

A Hugging Face ``*ForCausalLM`` computes ``logits = lm_head(hidden)`` for every token, upcasts them to
fp32 and takes the cross-entropy: at ``T`` tokens that is ``T x vocab`` elements several times over
(the 16-bit logits, their fp32 copy, the log-softmax saved for backward, the gradient), 0.8 GB per
1024 tokens with a 49,152-token vocabulary. :func:`install` replaces the model's ``forward`` (on the
instance, so parameter names, checkpoints and the saved model are unchanged) by one that runs the
base model to its last hidden states and then the loss chunk by chunk over the tokens: each chunk's
``lm_head`` and cross-entropy run under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant), so
the forward keeps only the chunk's scalar sum and the backward recomputes one chunk's logits at a
time. At most ``chunk_tokens x vocab`` logits exist at once, in forward and in backward.

ZeRO-3: ``lm_head`` is called as a module once per chunk (and once more per chunk in the backward's
recompute), so DeepSpeed 0.19.8's module hooks fetch and release its weight around every call as they
do around any module called several times in a step (``partitioned_param_coordinator`` records each
call in its module trace; the number of chunks depends only on micro-batch x sequence length, so the
trace is the same every step and stays valid). A fetch during the backward's recompute is attributed
to the backward submodule running (``ds_recompute_parameters``) and released when it finishes. A tied
weight (the input embedding's) is one parameter, fetched by whichever module runs. The weight's gradient reaches the parameter through autograd as in the unchunked loss (one
``AccumulateGrad`` per parameter, the chunks' contributions summed before it runs), so DeepSpeed's
gradient hooks see one gradient per backward.

Numerics: the loss is ``sum over chunks of sum-reduced cross-entropy / number of labelled tokens``,
where the unchunked loss is torch's mean-reduced cross-entropy over all tokens: the same terms added
in another order (fp32), and the weight gradient is the sum of per-chunk products (added in the
parameter's dtype) instead of one product. In fp32 the loss agrees to about 1e-6 relative
(``tests/train/test_chunked_loss.py`` checks 2e-6 on loss and gradients); in bf16 the weight gradient
differs in the last bits of the 16-bit format. Runs with the same ``--loss-chunk-tokens`` are
bit-identical to each other (e.g. ``--engine baseline`` and ``--engine memascend``).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memascend.errors import UserError

IGNORE_INDEX = -100
"""Label value that is not scored (Hugging Face's and torch's ``ignore_index``)."""

SUPPORTED_CLASSES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GPTNeoXForCausalLM",
    "PhiForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel", "GemmaForCausalLM", "OlmoForCausalLM",
})
"""Model classes whose logits are exactly ``lm_head(last hidden state)`` (no soft-capping or scaling
after the projection) and whose loss is transformers' ``ForCausalLMLoss``: the ones the chunked loss
reproduces."""


def check_supported(model: Any) -> None:
    """Refuse a model whose loss the chunked loss would not reproduce.

    Raises:
        UserError: the model's class is not in :data:`SUPPORTED_CLASSES`, or it has no output
            embedding.
    """
    model = _causal_lm(model)
    name = type(model).__name__
    if name not in SUPPORTED_CLASSES or model.get_output_embeddings() is None:
        raise UserError(f"--loss-chunk-tokens: model class {name} is not supported (supported: "
                        f"{', '.join(sorted(SUPPORTED_CLASSES))}); leave the flag out")


def _causal_lm(model: Any) -> Any:
    """The ``*ForCausalLM`` of ``model``: itself, or the one a PEFT model (LoRA) wraps, whose forward
    the PEFT model calls with the labels."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def _chunk_loss_sum(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 sum of the cross-entropy of one chunk (``hidden``: tokens x hidden, ``labels``: tokens)."""
    logits = head(hidden).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_causal_lm_loss(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                           chunk_tokens: int) -> torch.Tensor:
    """Transformers' causal-LM loss (``ForCausalLMLoss`` without ``num_items_in_batch``) of ``hidden``
    through ``head``, ``chunk_tokens`` tokens at a time.

    Args:
        head: the output projection (``lm_head``), called once per chunk (and once per chunk in the
            backward's recompute).
        hidden: last hidden states, ``(batch, seq, hidden)``, any float dtype.
        labels: token ids ``(batch, seq)``; position ``t`` is scored against ``labels[:, t + 1]``
            (the last position of every row is not scored), :data:`IGNORE_INDEX` is not scored.
        chunk_tokens: tokens (rows of the flattened ``batch * seq``) per chunk, at least 1.

    Returns:
        The mean cross-entropy over the scored tokens, an fp32 scalar (NaN when none is scored, as
        torch's mean reduction).

    Raises:
        ValueError: ``chunk_tokens`` below 1 or shapes that do not match.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not match")
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    total = None
    for start in range(0, flat.shape[0], chunk_tokens):
        part = checkpoint(_chunk_loss_sum, head, flat[start:start + chunk_tokens],
                          shifted[start:start + chunk_tokens], use_reentrant=False)
        total = part if total is None else total + part
    count = (shifted != IGNORE_INDEX).sum().to(torch.float32)
    return total / count


def install(model: torch.nn.Module, chunk_tokens: int) -> None:
    """Make ``model``'s forward compute its loss with :func:`chunked_causal_lm_loss` when it is given
    ``labels`` (without ``labels`` it is the model's own forward).

    The forward then returns transformers' ``CausalLMOutputWithPast`` with the loss and no logits.
    Call before ``deepspeed.initialize`` (the engine calls ``module(...)``, which calls the instance's
    ``forward``). A PEFT model's wrapped ``*ForCausalLM`` gets the new forward.

    Raises:
        UserError: :func:`check_supported`.
    """
    check_supported(model)
    model = _causal_lm(model)  # with LoRA, PEFT's forward reaches this model's forward with the labels
    own_forward = model.forward

    def forward(self: Any, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        if labels is None:
            return own_forward(input_ids=input_ids, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        kwargs.setdefault("use_cache", False)
        hidden = self.base_model(input_ids=input_ids, **kwargs).last_hidden_state
        loss = chunked_causal_lm_loss(self.get_output_embeddings(), hidden, labels, chunk_tokens)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    model.forward = types.MethodType(forward, model)
