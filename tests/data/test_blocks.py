import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memascend.data import BlockSampler, Document, build_blocks
from memascend.data.blocks import IGNORE_INDEX, tokenize_document


def test_chat_loss_only_on_assistant_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    doc = Document(
        messages=(
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris is the capital."},
            {"role": "user", "content": "And of Italy?"},
            {"role": "assistant", "content": "Rome."},
        )
    )
    ids, mask = tokenize_document(doc, tok)
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    assert learned == "Paris is the capital.<|im_end|>Rome.<|im_end|>"
    not_learned = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "capital of France" in not_learned and "Italy" in not_learned


def test_text_documents_pack_into_full_blocks_with_eos(smollm2_tokenizer):
    docs = [Document(text=f"Document number {i}. " * 40) for i in range(30)]
    split = build_blocks(docs, smollm2_tokenizer, seq_len=32, eval_blocks=4, seed=0)
    assert split.train.input_ids.shape[1] == 32 and len(split.eval) == 4
    assert torch.equal(split.train.input_ids, split.train.labels)  # plain text: every token learned
    assert (split.train.input_ids == smollm2_tokenizer.eos_token_id).any()


def test_held_out_documents_do_not_appear_in_training(smollm2_tokenizer):
    docs = [Document(text=f"unique{i:03d} " * 60) for i in range(40)]
    split = build_blocks(docs, smollm2_tokenizer, seq_len=16, eval_blocks=3, seed=7)
    train_text = smollm2_tokenizer.decode(split.train.input_ids.flatten())
    eval_text = smollm2_tokenizer.decode(split.eval.input_ids.flatten())
    eval_words = {w for w in eval_text.split() if w.startswith("unique")}
    assert eval_words and not any(w in train_text for w in eval_words if len(w) == 9)


def test_single_document_holds_out_its_tail(smollm2_tokenizer):
    split = build_blocks([Document(text="word " * 500)], smollm2_tokenizer, seq_len=16, eval_blocks=2, seed=0)
    assert len(split.eval) == 2 and len(split.train) > 10


@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(1, 50),
    micro_batch=st.integers(1, 4),
    world=st.integers(1, 4),
    steps=st.integers(1, 20),
)
def test_sampler_ranks_are_disjoint_and_cover_each_epoch(num_blocks, micro_batch, world, steps):
    samplers = [BlockSampler(num_blocks, micro_batch, world, r, seed=3) for r in range(world)]
    seen = []
    for s in range(steps):
        for smp in samplers:
            idx = smp.indices(s)
            assert idx.shape == (micro_batch,) and int(idx.min()) >= 0 and int(idx.max()) < num_blocks
            seen.extend(idx.tolist())
    # consecutive windows of num_blocks draws are permutations within an epoch
    for start in range(0, len(seen) - num_blocks + 1, num_blocks):
        assert sorted(seen[start : start + num_blocks]) == list(range(num_blocks))
    # deterministic
    again = BlockSampler(num_blocks, micro_batch, world, 0, seed=3)
    assert torch.equal(again.indices(0), samplers[0].indices(0))


def test_labels_use_ignore_index_for_prompts(smollm2_tokenizer):
    docs = [
        Document(messages=({"role": "user", "content": "q" * 50}, {"role": "assistant", "content": "a" * 50}))
        for _ in range(20)
    ]
    split = build_blocks(docs, smollm2_tokenizer, seq_len=64, eval_blocks=2, seed=1)
    labels = split.train.labels
    assert (labels == IGNORE_INDEX).any() and (labels != IGNORE_INDEX).any()
