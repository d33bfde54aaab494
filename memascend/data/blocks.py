"""Tokenise documents into fixed-length training blocks with a held-out split.

Text documents are concatenated (EOS between documents) and cut into blocks of ``seq_len`` tokens
(packing). Chat documents are rendered with the model's chat template; only assistant tokens (the
reply and its end-of-turn marker) carry a loss, everything else is labelled ``-100``.

The held-out split is made by document: documents are shuffled with the seed and the first ones
that cover ``eval_blocks`` blocks are held out. A corpus of a single document falls back to
holding out its last blocks.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from memascend.data import token_cache
from memascend.data.readers import Document
from memascend.data.token_cache import Pieces
from memascend.errors import UserError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenBlocks:
    """Packed blocks.

    Attributes:
        input_ids: int64 ``[num_blocks, seq_len]``.
        labels: int64 ``[num_blocks, seq_len]``; ``-100`` where no loss is taken. Where every token
            carries a loss (plain text) the labels equal the ids and share their storage (one copy
            of the tokens, not two); read them, never write them in place.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def trained_tokens_per_block(self) -> float:
        return float((self.labels != IGNORE_INDEX).sum()) / max(1, len(self))


@dataclass(frozen=True)
class DataSplit:
    train: TokenBlocks
    eval: TokenBlocks
    num_documents: int
    num_tokens: int


def _assistant_spans(text: str, messages: Sequence[dict], end_marker: str | None) -> list[tuple[int, int]]:
    """Character spans of assistant replies (plus a directly following end-of-turn marker) in ``text``."""
    spans, cursor = [], 0
    for msg in messages:
        content = msg["content"]
        if not content:
            continue
        pos = text.find(content, cursor)
        if pos < 0:
            continue  # template altered the content (e.g. stripped it); skip rather than mislabel
        end = pos + len(content)
        if msg["role"] == "assistant":
            if end_marker and text.startswith(end_marker, end):
                end += len(end_marker)
            spans.append((pos, end))
        cursor = end
    return spans


#: Longest piece of text handed to the tokenizer in one call, in characters. A fast (Rust)
#: tokenizer holds the GIL for the whole call and needs ~160 bytes of transient memory per
#: character (its encoding, offsets and the returned Python lists): 256 Ki characters is ~40 MiB
#: and a fraction of a second, so memory stays bounded and SIGTERM/Ctrl-C are served between
#: calls whatever the document sizes.
TOKENIZE_WINDOW_CHARS = 1 << 18


def _cut(text: str, lo: int, hi: int) -> int:
    """Where to end the piece ``text[lo:...]`` (a position in ``(lo, hi]``); see :func:`text_pieces`."""
    floor = lo + (hi - lo) // 2  # keep pieces at least half a window long
    # 1. Before a single space between two non-space characters ("word| word").
    p = text.rfind(" ", floor, hi)
    while p > floor:
        if not text[p - 1].isspace() and not text[p + 1].isspace():
            return p
        p = text.rfind(" ", floor, p)
    # 2. After a single newline between two non-space characters ("line\n|next").
    p = text.rfind("\n", floor, hi - 1)
    while p > floor:
        if not text[p - 1].isspace() and not text[p + 1].isspace():
            return p + 1
        p = text.rfind("\n", floor, p)
    # 3. Before any whitespace; 4. at the window's end (text without whitespace).
    for p in range(hi - 1, floor, -1):
        if text[p].isspace():
            return p
    return hi


def text_pieces(text: str, window_chars: int = TOKENIZE_WINDOW_CHARS) -> Iterator[tuple[int, int]]:
    """Split ``text`` into consecutive pieces of at most ``window_chars`` characters.

    A text no longer than the window is one piece (every ordinary document: the tokens are then
    exactly those of one tokenizer call, as before chunking existed). A longer one is cut, in this
    order of preference, before a single space between two non-space characters, after a single
    newline between two non-space characters, before any whitespace, or, in a window without any
    whitespace, at the window's end.

    Tokenizing the pieces one by one and concatenating the ids gives exactly the ids of the whole
    text when the tokenizer's pre-tokenizer always starts a new piece at such a cut and never looks
    across it: byte-level BPE with the GPT-2 / Llama 3 split patterns (SmolLM2, GPT-2, Llama 3,
    Qwen2), where " word" begins a pre-token and a lone newline between words is a pre-token of its
    own (tests/data/test_blocks.py checks this on every built-in play with a small window). The
    ids can differ within a few tokens of a cut of the last two kinds (a whitespace run split in
    two, or a word cut in a text without whitespace), and with tokenizers whose normalizer adds a
    prefix to every call (SentencePiece "prepend ▁"): the cut's neighbourhood is then tokenized as
    if a new text started there. Nothing is lost: the pieces cover the text exactly.

    Yields:
        ``(start, end)`` character offsets, ``end - start <= window_chars``.
    """
    start, n = 0, len(text)
    while n - start > window_chars:
        end = _cut(text, start, start + window_chars)
        yield start, end
        start = end
    if start < n or n == 0:
        yield start, n


def _assistant_mask(offsets: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Bool ``[k]``: tokens (character offsets int32 ``[k, 2]``) that start inside an assistant span
    and are not empty."""
    if not spans:
        return torch.zeros(len(offsets), dtype=torch.bool)
    span_start = torch.tensor([a for a, _ in spans], dtype=torch.int32)
    span_end = torch.tensor([b for _, b in spans], dtype=torch.int32)
    tok_start, tok_end = offsets[:, 0].contiguous(), offsets[:, 1].contiguous()
    # The first span ending after the token's start (spans are sorted and disjoint).
    idx = torch.searchsorted(span_end, tok_start, right=True)
    found = idx < len(spans)
    idx = idx.clamp(max=len(spans) - 1)
    return found & (span_start[idx] <= tok_start) & (tok_start < span_end[idx]) & (tok_end > tok_start)


def _tokenize_pieces(doc: Document, tokenizer) -> Pieces:
    """:func:`tokenize_document` as one ``(ids, mask)`` per text piece (:func:`text_pieces`), so no
    copy of the whole document's ids is ever made (ids beyond int32 raise instead of wrapping)."""
    if doc.text is not None:
        text, spans = doc.text, None
    else:
        if not tokenizer.chat_template:
            raise UserError(f"{doc.origin}: chat data needs a model whose tokenizer has a chat template")
        text = tokenizer.apply_chat_template(list(doc.messages), tokenize=False)
        spans = _assistant_spans(text, doc.messages, tokenizer.eos_token)
    pieces: Pieces = []
    for start, end in text_pieces(text, TOKENIZE_WINDOW_CHARS):
        enc = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=spans is not None,
                        verbose=False)
        ids = torch.tensor(enc["input_ids"], dtype=torch.int32)
        mask = None
        if spans is not None:
            offsets = torch.tensor(enc["offset_mapping"], dtype=torch.int32).view(-1, 2) + start
            mask = _assistant_mask(offsets, spans)
        del enc
        pieces.append((ids, mask))
    if doc.text is not None and tokenizer.eos_token_id is not None:
        pieces.append((torch.tensor([tokenizer.eos_token_id], dtype=torch.int32), None))
    return pieces


def tokenize_document(doc: Document, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of one document and, per token, whether it carries a loss.

    The text is tokenized in pieces of at most :data:`TOKENIZE_WINDOW_CHARS` characters
    (:func:`text_pieces` says when that equals tokenizing it whole: always for documents up to
    that length), so a huge document needs memory for its ids (4 bytes per token, plus the mask
    of a chat document) and one piece's transient encoding only, and a signal is acted on between
    pieces.

    Returns:
        ``(ids, mask)``: int32 ``[n]`` and bool ``[n]``; a text document ends with EOS (when the
        tokenizer has one) and every token is learned; a chat document learns only assistant tokens.

    Raises:
        UserError: the tokenizer has no chat template for a chat document.
    """
    pieces = _tokenize_pieces(doc, tokenizer)
    ids = torch.cat([t for t, _ in pieces])
    mask = torch.cat([torch.ones(len(t), dtype=torch.bool) if m is None else m for t, m in pieces])
    return ids, mask


def _num_tokens(pieces: Pieces) -> int:
    return sum(len(t) for t, _ in pieces)


def _pack(docs: Sequence[Pieces], seq_len: int) -> TokenBlocks:
    """Concatenate documents' tokens and cut the stream into whole blocks (the rest is dropped).

    Returns:
        Blocks whose int64 ids are written in place piece by piece; labels are the ids with
        ``-100`` where the mask is false, or the ids' very tensor where no mask is false.
    """
    n = sum(_num_tokens(d) for d in docs) // seq_len
    if n == 0:
        return TokenBlocks(torch.empty(0, seq_len, dtype=torch.long), torch.empty(0, seq_len, dtype=torch.long))
    input_ids = torch.empty(n * seq_len, dtype=torch.long)
    keep = torch.empty(n * seq_len, dtype=torch.bool)
    pos = 0
    for pieces in docs:
        for t, m in pieces:
            k = min(len(t), n * seq_len - pos)
            if k <= 0:
                break
            input_ids[pos : pos + k] = t[:k]
            keep[pos : pos + k] = True if m is None else m[:k]
            pos += k
    input_ids = input_ids.view(n, seq_len)
    if bool(keep.all()):
        return TokenBlocks(input_ids, input_ids)
    labels = input_ids.masked_fill(keep.logical_not_().view(n, seq_len), IGNORE_INDEX)
    return TokenBlocks(input_ids, labels)


def _with_trainable_rows(blocks: TokenBlocks) -> TokenBlocks:
    """The blocks that have at least one token to learn (the same tensors when all have)."""
    trainable = (blocks.labels != IGNORE_INDEX).any(dim=1)
    if bool(trainable.all()):
        return blocks
    return TokenBlocks(blocks.input_ids[trainable], blocks.labels[trainable])


def build_blocks(docs: Sequence[Document], tokenizer, seq_len: int, eval_blocks: int, seed: int) -> DataSplit:
    """Tokenise, split by document and pack into blocks.

    Args:
        docs: the corpus.
        tokenizer: a loaded tokenizer, or a :class:`memascend.data.token_cache.FolderTokenizer`,
            loaded only if the token cache does not hold this corpus's tokens.
        seq_len: tokens per block.
        eval_blocks: held-out blocks wanted.
        seed: shuffles the documents before the held-out ones are taken.

    Raises:
        UserError: the corpus is too small for one training block after the held-out split; what
            loading a :class:`~memascend.data.token_cache.FolderTokenizer` raises.
    """
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    # one (ids, mask) list per document, from the token cache when it holds this corpus and tokenizer
    by_doc = token_cache.tokenized_documents(
        docs, tokenizer, TOKENIZE_WINDOW_CHARS,
        lambda doc: _tokenize_pieces(doc, token_cache.loaded_tokenizer(tokenizer)))
    tokenized = [by_doc[i] for i in order]
    del by_doc
    total = sum(_num_tokens(d) for d in tokenized)
    eval_tokens_needed = eval_blocks * seq_len
    n_eval_docs, acc = 0, 0
    while acc < eval_tokens_needed and n_eval_docs < len(tokenized):
        acc += _num_tokens(tokenized[n_eval_docs])
        n_eval_docs += 1
    if eval_blocks and (n_eval_docs >= len(tokenized) or acc > total // 2):
        # Too few documents to hold out whole ones: hold out the tail of the token stream instead.
        everything = _pack(tokenized, seq_len)
        if len(everything) <= eval_blocks:
            raise UserError(
                f"corpus too small: {total} tokens give {len(everything)} blocks of {seq_len}, "
                f"need more than the {eval_blocks} held-out blocks"
            )
        train = TokenBlocks(everything.input_ids[:-eval_blocks], everything.labels[:-eval_blocks])
        held = TokenBlocks(everything.input_ids[-eval_blocks:], everything.labels[-eval_blocks:])
    else:
        held_all = _pack(tokenized[:n_eval_docs], seq_len)
        held = TokenBlocks(held_all.input_ids[:eval_blocks], held_all.labels[:eval_blocks])
        train = _pack(tokenized[n_eval_docs:], seq_len)
    if len(train) == 0:
        raise UserError(f"corpus too small: {total} tokens give no training block of {seq_len} tokens")
    del tokenized
    # Blocks without a single assistant token contribute no loss: drop them.
    train = _with_trainable_rows(train)
    if len(train) == 0:
        raise UserError("no training block contains a token to learn (no assistant replies?)")
    if len(held):
        held = _with_trainable_rows(held)
    return DataSplit(train=train, eval=held, num_documents=len(docs), num_tokens=total)


class BlockSampler:
    """Deterministic per-rank micro-batches over the training blocks.

    The global batch of step ``s`` is ``micro_batch * grad_accum * world_size`` blocks from a
    per-epoch permutation (seeded); rank ``r`` takes its contiguous slice of every micro-batch, so
    runs with the same seed see the same data whatever the engine.
    """

    def __init__(self, num_blocks: int, micro_batch: int, world_size: int, rank: int, seed: int):
        self.num_blocks, self.micro_batch = num_blocks, micro_batch
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = torch.randperm(self.num_blocks, generator=g)
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def indices(self, micro_step: int) -> torch.Tensor:
        """Block indices (int64 ``[micro_batch]``) of global micro-step ``micro_step`` for this rank."""
        out = []
        start = (micro_step * self.world_size + self.rank) * self.micro_batch
        for k in range(start, start + self.micro_batch):
            epoch, pos = divmod(k, self.num_blocks)
            out.append(int(self._permutation(epoch)[pos]))
        return torch.tensor(out, dtype=torch.long)
