"""Corpora (built-in corpora, JSONL, datasets-backed files/folders/Hub ids, plain text) turned into token blocks."""

from memascend.data.blocks import BlockSampler, DataSplit, TokenBlocks, build_blocks
from memascend.data.formats import DATA_FORMATS, parse_columns
from memascend.data.readers import Document, read_documents

__all__ = ["Document", "read_documents", "DATA_FORMATS", "parse_columns", "TokenBlocks", "DataSplit", "build_blocks",
           "BlockSampler"]
