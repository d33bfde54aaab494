"""Tokenized documents kept on disk, so a run on a corpus and tokenizer seen before skips tokenizing.

Tokenizing is the slowest part of a run's start on a small model (the built-in Shakespeare corpus,
1.6M tokens, takes seconds on two cores, every run and every rank). The tokenized documents are
saved under ``<cache>/tokens/<key>.pt`` (``<cache>``: ``$MEMASCEND_CACHE`` or ``~/.cache/memascend``),
where ``key`` is the SHA-256 of everything the tokens depend on: the tokenizer, the tokenization
window, this module's format version and every document's content (text, or chat messages) in order.
A tokenizer is keyed one of two ways:

* a model folder's tokenizer not loaded yet (:class:`FolderTokenizer`, what a run tokenizes with) by
  its files (:func:`files_key`: every file of the folder but the weights, and the versions of the
  libraries that read them), so a cache hit never loads the tokenizer at all;
* a loaded tokenizer by its full serialized state (vocabulary, merges, normalizer, pre-tokenizer,
  added tokens), its chat template and EOS token. A slow (non-Rust) tokenizer, whose state has no
  canonical serialized form, is not cached this way.

A different corpus, tokenizer or tokenization code gives another key; nothing is ever reused across
them. Set ``MEMASCEND_TOKEN_CACHE=0`` to neither read nor write it. An entry also holds the
tokenizer's number of ids (``len(tokenizer)``, which a from-scratch model's vocabulary must cover).

A corpus of more than :data:`MAX_CACHED_TOKENS` tokens (its file would cost more disk than tokenizing
costs time) or of fewer than :data:`MIN_CACHED_CHARS` characters (tokenized at once) is not cached.
Writing is best effort and atomic (a temporary file renamed into place): two ranks or runs writing
the same key leave one whole file, and a full or read-only cache folder only means the next run
tokenizes again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from memascend.data.readers import Document
from memascend.errors import UserError

FORMAT_VERSION = 2
"""Bumped whenever the tokenization code (or how a run loads its tokenizer,
:func:`memascend.models.loading.load_tokenizer`) changes what it produces for the same inputs, and
whenever an entry's contents change."""

MAX_CACHED_TOKENS = 64 << 20
"""Corpora up to this many tokens (256 MiB of int32 ids) are cached."""

MIN_CACHED_CHARS = 1 << 20
"""Corpora of fewer characters (tokenized in well under a second) are not cached."""

ENV_SWITCH = "MEMASCEND_TOKEN_CACHE"

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx",
                   ".onnx_data", ".ot", ".npz", ".tflite", ".mlmodel")
"""Files of a model folder that :func:`files_key` leaves out: weights, which no tokenizer reads."""

KEYED_SUBFOLDERS = ("additional_chat_templates",)
"""Subfolders of a model folder whose files a tokenizer reads (``transformers`` loads the named chat
templates kept there); :func:`files_key` keys their files too."""

KEYED_LIBRARIES = ("transformers", "tokenizers", "sentencepiece", "tiktoken", "protobuf", "regex")
"""Distributions whose versions :func:`files_key` keys: the code that turns the files into a tokenizer."""

_HASH_CHUNK_BYTES = 1 << 20

#: One document's tokens as consecutive pieces: ``(ids, mask)`` with int32 ids ``[k]`` and a bool
#: mask ``[k]`` of the tokens that carry a loss, or ``None`` when all of them do (plain text).
Pieces = list[tuple[torch.Tensor, "torch.Tensor | None"]]


def _keyed_files(folder: Path) -> Iterator[Path]:
    """The files of ``folder`` :func:`files_key` hashes, in a fixed order: every regular file
    directly in it (symlinks followed) but weights (:data:`WEIGHT_SUFFIXES`) and hidden files, then
    those of :data:`KEYED_SUBFOLDERS`."""
    for sub in (folder, *(folder / name for name in KEYED_SUBFOLDERS)):
        if not sub.is_dir():
            continue
        for path in sorted(sub.iterdir(), key=lambda p: p.name):
            if path.name.startswith(".") or path.suffix.lower() in WEIGHT_SUFFIXES or not path.is_file():
                continue
            yield path


def _library_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def files_key(folder: Path) -> str:
    """SHA-256 hex of what a model folder's tokenizer is loaded from, without loading it: the
    relative path, size and bytes of every file :func:`_keyed_files` names (the tokenizer's files,
    ``config.json``, chat templates; not the weights), the installed versions of
    :data:`KEYED_LIBRARIES` and :data:`FORMAT_VERSION`. Reads each file once, 1 MiB at a time.

    Raises:
        UserError: a file of the folder cannot be read.
    """
    h = hashlib.sha256()
    meta = {"format": FORMAT_VERSION, "libraries": {name: _library_version(name) for name in KEYED_LIBRARIES}}
    h.update(json.dumps(meta, sort_keys=True).encode())
    for path in _keyed_files(folder):
        try:
            with open(path, "rb") as f:
                size_bytes = os.fstat(f.fileno()).st_size
                h.update(b"F" + path.relative_to(folder).as_posix().encode("utf-8", "surrogatepass") + b"\0")
                h.update(size_bytes.to_bytes(8, "little"))
                while chunk := f.read(_HASH_CHUNK_BYTES):
                    h.update(chunk)
        except OSError as exc:
            raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    return h.hexdigest()


class FolderTokenizer:
    """A model folder's tokenizer, loaded only when first needed: the token cache keys it by its files
    (:func:`files_key`), so a run whose tokens are cached never loads it.

    Args:
        folder: the model folder the tokenizer's files are in.
        load: makes the tokenizer (no arguments); what it raises, :meth:`get` raises.

    Attributes:
        folder: as given.
        num_ids: ``len(tokenizer)`` once known (the tokenizer loaded, or read from a cache entry),
            else ``None``.
    """

    def __init__(self, folder: Path, load: Callable[[], Any]):
        self.folder = Path(folder)
        self._load = load
        self._tokenizer: Any = None
        self._key: str | None = None
        self.num_ids: int | None = None

    @property
    def key(self) -> str:
        """:func:`files_key` of the folder (computed once)."""
        if self._key is None:
            self._key = files_key(self.folder)
        return self._key

    @property
    def loaded(self) -> bool:
        """Whether :meth:`get` has made the tokenizer."""
        return self._tokenizer is not None

    def get(self) -> Any:
        """The tokenizer, made on the first call."""
        if self._tokenizer is None:
            self._tokenizer = self._load()
            self.num_ids = len(self._tokenizer)
        return self._tokenizer


def loaded_tokenizer(tokenizer) -> Any:
    """``tokenizer`` itself, or for a :class:`FolderTokenizer` the tokenizer it loads."""
    return tokenizer.get() if isinstance(tokenizer, FolderTokenizer) else tokenizer


def cache_key(docs: Sequence[Document], tokenizer, window_chars: int) -> str | None:
    """SHA-256 hex of the documents, the tokenizer (a :class:`FolderTokenizer` by its files, a loaded
    one by its state; see the module doc) and the tokenization settings, or ``None`` when the tokens
    cannot be cached (a loaded slow tokenizer, a corpus under :data:`MIN_CACHED_CHARS` characters, or
    the cache switched off)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if sum(len(d.text) if d.text is not None else sum(len(str(m)) for m in d.messages) for d in docs) < MIN_CACHED_CHARS:
        return None
    h = hashlib.sha256()
    if isinstance(tokenizer, FolderTokenizer):
        meta = {"format": FORMAT_VERSION, "window_chars": window_chars, "tokenizer_files": tokenizer.key}
        h.update(json.dumps(meta, sort_keys=True).encode())
    else:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
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


def load(key: str, num_docs: int) -> tuple[list[Pieces], int] | None:
    """The cached tokenized documents of ``key`` (one :data:`Pieces` per document, in the order they
    were stored: int32 ids, bool masks or ``None``) and the tokenizer's number of ids, or ``None``
    when absent or unreadable."""
    path = cache_path(key)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        ids, masks = saved["ids"], saved["masks"]
        lengths, has_mask, doc_pieces = saved["piece_numel"], saved["piece_has_mask"], saved["doc_pieces"]
        num_ids = int(saved["tokenizer_num_ids"])
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
    return out, num_ids


def store(key: str, tokenized: Sequence[Pieces], tokenizer_num_ids: int) -> None:
    """Save ``tokenized`` (one :data:`Pieces` per document) and the tokenizer's number of ids
    (``len(tokenizer)``) under ``key``, atomically; skipped past :data:`MAX_CACHED_TOKENS` tokens; an
    ``OSError`` (full disk, read-only folder) is ignored."""
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
        "tokenizer_num_ids": int(tokenizer_num_ids),
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
    """Every document of ``docs`` tokenized (``tokenize(doc)``, which loads a :class:`FolderTokenizer`
    when it needs it), in order, from the cache when it holds them (a :class:`FolderTokenizer` then
    stays unloaded and gets its ``num_ids`` from the entry), else tokenized now and stored."""
    key = cache_key(docs, tokenizer, window_chars)
    if key is not None:
        cached = load(key, len(docs))
        if cached is not None:
            pieces, num_ids = cached
            if isinstance(tokenizer, FolderTokenizer) and tokenizer.num_ids is None:
                tokenizer.num_ids = num_ids
            return pieces
    tokenized = [tokenize(doc) for doc in docs]
    if key is not None:
        store(key, tokenized, len(loaded_tokenizer(tokenizer)))
    return tokenized
