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

from memascend.data.readers import Document
from memascend.errors import UserError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenBlocks:
    """Packed blocks.

    Attributes:
        input_ids: int64 ``[num_blocks, seq_len]``.
        labels: int64 ``[num_blocks, seq_len]``; ``-100`` where no loss is taken.
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


def tokenize_document(doc: Document, tokenizer) -> tuple[list[int], list[bool]]:
    """Token ids of one document and, per token, whether it carries a loss.

    Raises:
        UserError: the tokenizer has no chat template for a chat document.
    """
    if doc.text is not None:
        ids = tokenizer(doc.text, add_special_tokens=False, verbose=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        return ids, [True] * len(ids)
    if not tokenizer.chat_template:
        raise UserError(f"{doc.origin}: chat data needs a model whose tokenizer has a chat template")
    text = tokenizer.apply_chat_template(list(doc.messages), tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    spans = _assistant_spans(text, doc.messages, tokenizer.eos_token)
    mask, span_i = [], 0
    for start, end in enc["offset_mapping"]:
        while span_i < len(spans) and spans[span_i][1] <= start:
            span_i += 1
        inside = span_i < len(spans) and spans[span_i][0] <= start < spans[span_i][1] and end > start
        mask.append(inside)
    return enc["input_ids"], mask


def _pack(token_lists: Iterator[tuple[list[int], list[bool]]], seq_len: int) -> TokenBlocks:
    ids: list[int] = []
    mask: list[bool] = []
    for t, m in token_lists:
        ids.extend(t)
        mask.extend(m)
    n = len(ids) // seq_len
    if n == 0:
        return TokenBlocks(torch.empty(0, seq_len, dtype=torch.long), torch.empty(0, seq_len, dtype=torch.long))
    input_ids = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
    keep = torch.tensor(mask[: n * seq_len], dtype=torch.bool).view(n, seq_len)
    labels = torch.where(keep, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    return TokenBlocks(input_ids, labels)


def build_blocks(docs: Sequence[Document], tokenizer, seq_len: int, eval_blocks: int, seed: int) -> DataSplit:
    """Tokenise, split by document and pack into blocks.

    Raises:
        UserError: the corpus is too small for one training block after the held-out split.
    """
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    tokenized = [tokenize_document(docs[i], tokenizer) for i in order]
    total = sum(len(t) for t, _ in tokenized)
    eval_tokens_needed = eval_blocks * seq_len
    n_eval_docs, acc = 0, 0
    while acc < eval_tokens_needed and n_eval_docs < len(tokenized):
        acc += len(tokenized[n_eval_docs][0])
        n_eval_docs += 1
    if eval_blocks and (n_eval_docs >= len(tokenized) or acc > total // 2):
        # Too few documents to hold out whole ones: hold out the tail of the token stream instead.
        everything = _pack(iter(tokenized), seq_len)
        if len(everything) <= eval_blocks:
            raise UserError(
                f"corpus too small: {total} tokens give {len(everything)} blocks of {seq_len}, "
                f"need more than the {eval_blocks} held-out blocks"
            )
        train = TokenBlocks(everything.input_ids[:-eval_blocks], everything.labels[:-eval_blocks])
        held = TokenBlocks(everything.input_ids[-eval_blocks:], everything.labels[-eval_blocks:])
    else:
        held_all = _pack(iter(tokenized[:n_eval_docs]), seq_len)
        held = TokenBlocks(held_all.input_ids[:eval_blocks], held_all.labels[:eval_blocks])
        train = _pack(iter(tokenized[n_eval_docs:]), seq_len)
    if len(train) == 0:
        raise UserError(f"corpus too small: {total} tokens give no training block of {seq_len} tokens")
    trainable = (train.labels != IGNORE_INDEX).any(dim=1)
    if not bool(trainable.any()):
        raise UserError("no training block contains a token to learn (no assistant replies?)")
    # Blocks without a single assistant token contribute no loss: drop them.
    train = TokenBlocks(train.input_ids[trainable], train.labels[trainable])
    if len(held):
        keep = (held.labels != IGNORE_INDEX).any(dim=1)
        held = TokenBlocks(held.input_ids[keep], held.labels[keep])
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
