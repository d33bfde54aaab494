"""The token cache: a rerun on the same corpus and tokenizer gets the very blocks it would tokenize,
without tokenizing; any change of corpus or tokenizer tokenizes again; a broken or unwritable cache
only costs the time of tokenizing."""

from __future__ import annotations

import pytest
import torch

from memascend.data import Document, build_blocks, token_cache
from memascend.data import blocks as blocks_mod


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache folder, every corpus cached, and a count of the documents tokenized."""
    monkeypatch.setenv("MEMASCEND_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(token_cache.ENV_SWITCH, raising=False)
    monkeypatch.setattr(token_cache, "MIN_CACHED_CHARS", 0)
    calls = []
    real = blocks_mod._tokenize_pieces

    def counting(doc, tokenizer):
        calls.append(doc)
        return real(doc, tokenizer)

    monkeypatch.setattr(blocks_mod, "_tokenize_pieces", counting)
    return tmp_path / "cache" / "tokens", calls


def _docs(n: int = 12, tag: str = "") -> list[Document]:
    texts = [Document(text=f"Document {i}{tag}: " + "to be or not to be, " * (20 + i)) for i in range(n)]
    chats = [Document(messages=({"role": "user", "content": f"Question {i}?"},
                                {"role": "assistant", "content": f"Answer {i}{tag}."})) for i in range(4)]
    return texts + chats


def _same(a, b) -> None:
    for x, y in ((a.train, b.train), (a.eval, b.eval)):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
    assert (a.num_documents, a.num_tokens) == (b.num_documents, b.num_tokens)


def test_second_build_reads_the_cache_and_gives_the_same_blocks(cache, smollm2_tokenizer, monkeypatch):
    folder, calls = cache
    docs = _docs()
    first = build_blocks(docs, smollm2_tokenizer, seq_len=16, eval_blocks=2, seed=3)
    assert len(calls) == len(docs) and len(list(folder.glob("*.pt"))) == 1
    calls.clear()
    again = build_blocks(docs, smollm2_tokenizer, seq_len=16, eval_blocks=2, seed=3)
    assert calls == []  # nothing tokenized
    _same(first, again)
    # another seed and block length reuse the same tokens (the cache holds documents, not blocks)
    other = build_blocks(docs, smollm2_tokenizer, seq_len=24, eval_blocks=1, seed=9)
    assert calls == []
    monkeypatch.setenv(token_cache.ENV_SWITCH, "0")
    _same(other, build_blocks(docs, smollm2_tokenizer, seq_len=24, eval_blocks=1, seed=9))
    assert len(calls) == len(docs)  # switched off: tokenized, and the result is the cached one's


def test_a_changed_document_or_tokenizer_tokenizes_again(cache, smollm2_tokenizer):
    folder, calls = cache
    build_blocks(_docs(), smollm2_tokenizer, seq_len=16, eval_blocks=2, seed=0)
    calls.clear()
    changed = _docs(tag="!")  # one character more in every assistant reply and text
    build_blocks(changed, smollm2_tokenizer, seq_len=16, eval_blocks=2, seed=0)
    assert len(calls) == len(changed) and len(list(folder.glob("*.pt"))) == 2
    calls.clear()
    tok = smollm2_tokenizer
    template = tok.chat_template
    tok.chat_template = template.replace("<|im_start|>", "<|im_start|> ")
    try:
        build_blocks(changed, tok, seq_len=16, eval_blocks=2, seed=0)
    finally:
        tok.chat_template = template
    assert len(calls) == len(changed) and len(list(folder.glob("*.pt"))) == 3


def test_a_truncated_cache_file_is_tokenized_again(cache, smollm2_tokenizer):
    folder, calls = cache
    docs = _docs()
    want = build_blocks(docs, smollm2_tokenizer, seq_len=16, eval_blocks=2, seed=1)
    (path,) = folder.glob("*.pt")
    path.write_bytes(path.read_bytes()[:100])  # a crash while another run wrote it
    calls.clear()
    _same(want, build_blocks(docs, smollm2_tokenizer, seq_len=16, eval_blocks=2, seed=1))
    assert len(calls) == len(docs)


def test_an_unwritable_cache_folder_costs_only_the_tokenizing(cache, smollm2_tokenizer):
    folder, calls = cache
    folder.parent.mkdir()
    folder.write_text("not a folder")  # mkdir fails with an OSError
    docs = _docs()
    want = build_blocks(docs, smollm2_tokenizer, seq_len=16, eval_blocks=2, seed=1)
    calls.clear()
    _same(want, build_blocks(docs, smollm2_tokenizer, seq_len=16, eval_blocks=2, seed=1))
    assert len(calls) == len(docs) and folder.read_text() == "not a folder"
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tokens"]  # no temporary file left


def test_small_and_huge_corpora_are_not_cached(cache, smollm2_tokenizer, monkeypatch):
    folder, _ = cache
    monkeypatch.setattr(token_cache, "MIN_CACHED_CHARS", 1 << 20)
    build_blocks(_docs(), smollm2_tokenizer, seq_len=16, eval_blocks=2, seed=1)
    monkeypatch.setattr(token_cache, "MIN_CACHED_CHARS", 0)
    monkeypatch.setattr(token_cache, "MAX_CACHED_TOKENS", 100)
    build_blocks(_docs(), smollm2_tokenizer, seq_len=16, eval_blocks=2, seed=1)
    assert not folder.exists() or list(folder.iterdir()) == []
