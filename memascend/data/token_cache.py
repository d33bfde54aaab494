"""Tokenized documents kept on disk, so a run on a corpus and tokenizer seen before skips tokenizing.

Tokenizing is the slowest part of a run's start on a small model (the built-in Shakespeare corpus,
1.6M tokens, takes seconds on two cores, every run and every rank). The tokenized documents are
saved under ``<cache>/tokens/<key>.pt`` (``<cache>``: ``$MEMASCEND_CACHE`` or ``~/.cache/memascend``),
where ``key`` is the SHA-256 of everything the tokens depend on: the tokenizer's full serialized
state (vocabulary, merges, normalizer, pre-tokenizer, added tokens), its chat template and EOS
token, the tokenization window, this module's format version and every document's content (text,
or chat messages) in order. A different corpus, tokenizer or tokenization code gives another key;
nothing is ever reused across them. Set ``MEMASCEND_TOKEN_CACHE=0`` to neither read nor write it.

A slow (non-Rust) tokenizer, whose state has no canonical serialized form, is never cached; neither
is a corpus of more than :data:`MAX_CACHED_TOKENS` tokens (its file would cost more disk than
tokenizing costs time) or of fewer than :data:`MIN_CACHED_CHARS` characters (tokenized at once).
Writing is best effort and atomic (a temporary file renamed into place): two ranks or runs writing
the same key leave one whole file, and a full or read-only cache folder only means the next run
tokenizes again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from memascend.data.readers import Document

FORMAT_VERSION = 1
"""Bumped whenever the tokenization code changes what it produces for the same inputs."""

MAX_CACHED_TOKENS = 64 << 20
"""Corpora up to this many tokens (256 MiB of int32 ids) are cached."""

MIN_CACHED_CHARS = 1 << 20
"""Corpora of fewer characters (tokenized in well under a second) are not cached."""

ENV_SWITCH = "MEMASCEND_TOKEN_CACHE"

#: One document's tokens as consecutive pieces: ``(ids, mask)`` with int32 ids ``[k]`` and a bool
#: mask ``[k]`` of the tokens that carry a loss, or ``None`` when all of them do (plain text).
Pieces = list[tuple[torch.Tensor, "torch.Tensor | None"]]


def cache_key(docs: Sequence[Document], tokenizer, window_chars: int) -> str | None:
    """SHA-256 hex of the documents, the tokenizer's state and the tokenization settings, or
    ``None`` when the tokens cannot be cached (a slow tokenizer, or the cache switched off)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if sum(len(d.text) if d.text is not None else sum(len(str(m)) for m in d.messages) for d in docs) < MIN_CACHED_CHARS:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    h = hashlib.sha256()
    meta = {"format": FORMAT_VERSION, "window_chars": window_chars, "class": type(tokenizer).__name__,
            "chat_template": getattr(tokenizer, "chat_template", None), "eos_token": tokenizer.eos_token,
            "eos_token_id": tokenizer.eos_token_id}
    h.update(json.dumps(meta, sort_keys=True, default=str).encode())
    h.update(backend.to_str().encode())
    for doc in docs:
        body = doc.text if doc.text is not None else json.dumps(list(doc.messages), sort_keys=True, default=str)
        part = body.encode("utf-8", "surrogatepass")
        h.update(b"T" if doc.text is not None else b"C")
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def cache_path(key: str) -> Path:
    """Where the tokens of ``key`` are kept."""
    from memascend.models.loading import cache_dir

    return cache_dir() / "tokens" / f"{key}.pt"


def load(key: str, num_docs: int) -> list[Pieces] | None:
    """The cached tokenized documents of ``key`` (one :data:`Pieces` per document, in the order they
    were stored: int32 ids, bool masks or ``None``), or ``None`` when absent or unreadable."""
    path = cache_path(key)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        ids, masks = saved["ids"], saved["masks"]
        lengths, has_mask, doc_pieces = saved["piece_numel"], saved["piece_has_mask"], saved["doc_pieces"]
    except Exception:  # absent, truncated by a crash, or written by another format: tokenize again
        return None
    if len(doc_pieces) != num_docs or int(lengths.sum()) != ids.numel():
        return None
    id_views = torch.split(ids, lengths.tolist())
    mask_views = iter(torch.split(masks, lengths[has_mask].tolist()))
    pieces = [(t, next(mask_views) if m else None) for t, m in zip(id_views, has_mask.tolist(), strict=True)]
    out, pos = [], 0
    for n in doc_pieces.tolist():
        out.append(pieces[pos:pos + n])
        pos += n
    return out


def store(key: str, tokenized: Sequence[Pieces]) -> None:
    """Save ``tokenized`` (one :data:`Pieces` per document) under ``key``, atomically; skipped past
    :data:`MAX_CACHED_TOKENS` tokens; an ``OSError`` (full disk, read-only folder) is ignored."""
    flat = [p for doc in tokenized for p in doc]
    total_numel = sum(len(t) for t, _ in flat)
    if total_numel > MAX_CACHED_TOKENS:
        return
    saved = {
        "ids": torch.cat([t for t, _ in flat]) if flat else torch.empty(0, dtype=torch.int32),
        "masks": torch.cat([m for _, m in flat if m is not None] or [torch.empty(0, dtype=torch.bool)]),
        "piece_numel": torch.tensor([len(t) for t, _ in flat], dtype=torch.long),
        "piece_has_mask": torch.tensor([m is not None for _, m in flat], dtype=torch.bool),
        "doc_pieces": torch.tensor([len(doc) for doc in tokenized], dtype=torch.long),
    }
    path = cache_path(key)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}-", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            torch.save(saved, f)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def tokenized_documents(docs: Sequence[Document], tokenizer, window_chars: int,
                        tokenize: Callable[[Document], Pieces]) -> list[Pieces]:
    """Every document of ``docs`` tokenized (``tokenize(doc)``), in order, from the cache when it
    holds them, else tokenized now and stored."""
    key = cache_key(docs, tokenizer, window_chars)
    if key is not None:
        cached = load(key, len(docs))
        if cached is not None:
            return cached
    tokenized = [tokenize(doc) for doc in docs]
    if key is not None:
        store(key, tokenized)
    return tokenized
