"""Corpora (JSONL text/chat, plain text, built-in real corpora) turned into token blocks."""

from memascend.data.blocks import BlockSampler, DataSplit, TokenBlocks, build_blocks
from memascend.data.readers import Document, read_documents

__all__ = ["Document", "read_documents", "TokenBlocks", "DataSplit", "build_blocks", "BlockSampler"]
