"""The chunked causal-LM loss against the model's own (full-logits) loss on short sequences.

Tolerance: the chunked loss adds the same fp32 cross-entropy terms in another order (per-chunk sums,
then one division) and sums the output projection's weight gradient over chunks, so in fp32 loss and
every gradient agree within 2e-6 relative (of the largest gradient element per parameter); in bf16 the
loss within 1e-5 relative and the gradients within a few units of bf16's last place (2e-2 relative).
"""

from __future__ import annotations

import copy

import pytest
import torch

from memascend.errors import UserError
from memascend.train import chunked_loss


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=1, eos_token_id=2))


def _phi_untied_bias():
    from transformers import PhiConfig, PhiForCausalLM

    return PhiForCausalLM(PhiConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, tie_word_embeddings=False, resid_pdrop=0.0,
                                    embd_pdrop=0.0, attention_dropout=0.0))


def _pair(make, dtype):
    torch.manual_seed(0)
    full = make().to(dtype)
    chunked = copy.deepcopy(full)
    return full, chunked


def _inputs():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (2, 37), generator=gen)
    labels = ids.clone()
    labels[0, :6] = chunked_loss.IGNORE_INDEX  # a masked prompt
    return ids, labels


def _max_rel_grad_diff(a, b) -> float:
    return max(float((pa.grad.float() - pb.grad.float()).abs().max() / pa.grad.float().abs().max())
               for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("make", [_llama, _gpt2, _phi_untied_bias], ids=["llama-tied", "gpt2", "phi-untied-bias"])
@pytest.mark.parametrize("chunk", [1, 16, 74, 1000])
def test_fp32_loss_and_gradients_match_the_full_loss(make, chunk):
    full, chunked = _pair(make, torch.float32)
    chunked_loss.install(chunked, chunk)
    ids, labels = _inputs()
    want = full(input_ids=ids, labels=labels).loss
    got = chunked(input_ids=ids, labels=labels).loss
    want.backward()
    got.backward()
    assert got.dtype == torch.float32
    assert abs(got.item() - want.item()) <= 2e-6 * abs(want.item())
    assert _max_rel_grad_diff(full, chunked) <= 2e-6


def test_bf16_within_bf16_rounding():
    full, chunked = _pair(_llama, torch.bfloat16)
    chunked_loss.install(chunked, 10)
    ids, labels = _inputs()
    want, got = full(input_ids=ids, labels=labels).loss, chunked(input_ids=ids, labels=labels).loss
    want.backward()
    got.backward()
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item())
    assert _max_rel_grad_diff(full, chunked) <= 2e-2


def test_no_logits_held_and_forward_without_labels_is_the_models():
    full, chunked = _pair(_llama, torch.float32)
    chunked_loss.install(chunked, 8)
    ids, labels = _inputs()
    assert chunked(input_ids=ids, labels=labels).logits is None
    torch.testing.assert_close(chunked(input_ids=ids).logits, full(input_ids=ids).logits, rtol=0, atol=0)


def test_peak_logits_are_one_chunk():
    """The forward saves no logits for the backward (the unchunked loss saves tokens x vocab of them)."""
    _, chunked = _pair(_llama, torch.float32)
    chunked_loss.install(chunked, 8)
    ids, labels = _inputs()
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        assert chunked(input_ids=ids, labels=labels).loss.requires_grad
    assert shapes and not any(s and s[-1] == 300 for s in shapes)  # no logits (..., vocab) saved


def test_refusals():
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32))
    with pytest.raises(UserError, match="--loss-chunk-tokens: model class BertForMaskedLM is not supported"):
        chunked_loss.install(bert, 16)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        chunked_loss.chunked_causal_lm_loss(torch.nn.Linear(4, 5), torch.zeros(1, 2, 4), torch.zeros(1, 2).long(), 0)
    from memascend.config import TrainConfig

    with pytest.raises(UserError, match="--loss-chunk-tokens must be >= 1"):
        TrainConfig(loss_chunk_tokens=0)
