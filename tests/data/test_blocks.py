import hashlib
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memascend.data import BlockSampler, Document, build_blocks, read_documents
from memascend.data import blocks as blocks_mod
from memascend.data.blocks import IGNORE_INDEX, text_pieces, tokenize_document


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
    ids, mask = ids.tolist(), mask.tolist()
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


def _blocks_sha256(split) -> str:
    d = hashlib.sha256()
    for t in (split.train.input_ids, split.train.labels, split.eval.input_ids, split.eval.labels):
        d.update(str(tuple(t.shape)).encode())
        d.update(t.contiguous().numpy().tobytes())
    return d.hexdigest()


def test_blocks_of_real_corpora_are_unchanged_by_piecewise_tokenizing(smollm2_tokenizer):
    """The blocks (ids, labels, held-out split) of the built-in corpora, bit for bit, as produced
    before tokenizing went piecewise (hashes recorded from commit 3fe5197's build_blocks), so the
    regression suite's losses stay the same."""
    shakespeare = build_blocks(read_documents("shakespeare"), smollm2_tokenizer, 128, 4, 0)
    assert _blocks_sha256(shakespeare) == "d33870c2fa9b17e7774ac8fc745e2eb5e1954fa6318e3a512a6bdbc54f57165a"
    chitchat = build_blocks(read_documents("chitchat", 300), smollm2_tokenizer, 64, 3, 1)
    assert _blocks_sha256(chitchat) == "64dd5f5e702b62f6d153a28962372d378ac7098793610e9525bab96cd3db1183"


def test_pieces_cover_the_text_and_tokenize_as_the_whole(smollm2_tokenizer):
    """Every play cut into 2,000-character pieces: the pieces tile the text, none is longer than the
    window, and their concatenated ids equal the ids of the whole play (SmolLM2's byte-level BPE)."""
    tok = smollm2_tokenizer
    cuts = 0
    for doc in read_documents("shakespeare"):
        pieces = list(text_pieces(doc.text, 2000))
        cuts += len(pieces) - 1
        assert pieces[0][0] == 0 and pieces[-1][1] == len(doc.text)
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert all(0 < end - start <= 2000 for start, end in pieces)
        whole = tok(doc.text, add_special_tokens=False, verbose=False)["input_ids"]
        joined = [i for s, e in pieces for i in tok(doc.text[s:e], add_special_tokens=False, verbose=False)["input_ids"]]
        assert joined == whole, doc.origin
    assert cuts > 1000


@pytest.mark.parametrize("text", ["x" * 5000, ("ab  " * 2000), "\n\n".join(["word"] * 2000), ""])
def test_pieces_of_texts_without_a_clean_cut(text):
    pieces = list(text_pieces(text, 1000))
    assert pieces[0][0] == 0 and pieces[-1][1] == len(text)
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert all(end - start <= 1000 for start, end in pieces)
    assert "".join(text[s:e] for s, e in pieces) == text


def test_chat_document_longer_than_the_window_keeps_its_mask(smollm2_tokenizer, monkeypatch):
    """A conversation tokenized in small pieces learns exactly the tokens it learns whole."""
    tok = smollm2_tokenizer
    doc = Document(messages=tuple(
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: " + "lorem ipsum dolor sit amet " * 30}
        for i in range(12)
    ))
    whole_ids, whole_mask = tokenize_document(doc, tok)
    monkeypatch.setattr(blocks_mod, "TOKENIZE_WINDOW_CHARS", 500)
    ids, mask = tokenize_document(doc, tok)
    assert torch.equal(ids, whole_ids) and torch.equal(mask, whole_mask)
    assert 0 < int(mask.sum()) < len(mask)


_MEMORY_PROBE = r"""
import json, resource, sys
from memascend.config import ModelConfig
from memascend.data import build_blocks, read_documents
from memascend.models.loading import load_tokenizer, resolve_model
tok = load_tokenizer(resolve_model(ModelConfig()))
build_blocks(read_documents(sys.argv[2]), tok, 64, 1, 0)   # warm up on a small corpus
docs = read_documents(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
split = build_blocks(docs, tok, 64, 1, 0)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
block_bytes = sum(t.numel() * t.element_size() for t in (split.train.input_ids, split.train.labels, split.eval.input_ids, split.eval.labels))
print(json.dumps({"chars": len(docs[0].text), "peak_growth_bytes": after - before, "block_bytes": block_bytes, "blocks": len(split.train)}))
"""


def test_one_huge_document_tokenizes_in_bounded_memory(tmp_path):
    """A single 6 MB JSONL line (3.3 M tokens): beyond the block tensors the run keeps (51 MiB), the
    peak RSS grows by the document's int32 ids and one window's transient encoding (memory the
    allocator reuses): 11 MiB measured, against 933 MiB when one tokenizer call took the whole text
    (~160 bytes per character). A 100 MB line: peak RSS 1.6 GiB of which 0.83 GiB are its blocks
    (55.5 M tokens), where one call needed an estimated 16 GiB."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    text = " ".join(rng.choice(words) for _ in range(1_000_000))[:6_000_000]
    (tmp_path / "big.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (tmp_path / "small.jsonl").write_text(json.dumps({"text": text[:200_000]}) + "\n")
    proc = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(tmp_path / "big.jsonl"), str(tmp_path / "small.jsonl")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["chars"] == 6_000_000 and result["blocks"] > 10_000
    assert result["peak_growth_bytes"] - result["block_bytes"] < 64 * 2**20, result
