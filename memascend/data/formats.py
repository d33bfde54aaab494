"""Row formats of data files and data sets, mapped to the two kinds of :class:`Document`.

A row (a JSONL line, a parquet/CSV/arrow row, a ``datasets`` record) is one of:

- ``text``: ``{"text": str}``: plain text, every token learned;
- ``chat``: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``;
- ``alpaca``: ``{"instruction": str, "input": str (optional), "output": str, "system": str
  (optional), "history": [[user, assistant], ...] (optional)}``: one exchange (after the history's
  turns) whose user message is the instruction and the input joined by a newline (LLaMA-Factory's
  rendering); ``prompt`` / ``response`` are other names of ``instruction`` / ``output``;
- ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...],
  "system": str (optional)}``; ``human``/``user`` become ``user``, ``gpt``/``assistant``/``chatgpt``/
  ``model`` ``assistant`` (``role``/``content`` keys are read as well).

``alpaca``, ``sharegpt`` and ``chat`` rows become chat documents (rendered with the model's chat
template, loss on the assistant's tokens only), ``text`` rows text documents. ``auto`` decides per
row from the fields it has, in the order text, messages, conversations, instruction/output. A
column mapping (``--data-columns text=body`` or ``prompt=q,response=a``) names the column that
holds a field when it is not called by the field's name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from memascend.errors import UserError

DATA_FORMATS = ("auto", "text", "chat", "alpaca", "sharegpt")
"""Values of ``--data-format``."""

FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "chat": ("messages",),
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
}
"""The fields a row of each format must have."""

OPTIONAL_FIELDS = ("input", "system", "history")
"""Fields a row may have (alpaca's ``input``, ``system`` and ``history``; sharegpt's ``system``)."""

FIELD_ALIASES = {"prompt": "instruction", "response": "output"}
"""Other names of alpaca's fields in a column mapping."""

FIELDS = tuple(f for fs in FORMAT_FIELDS.values() for f in fs) + OPTIONAL_FIELDS
CHAT_ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "system": "system"}


@dataclass(frozen=True)
class Document:
    """One training document: ``text`` or a chat ``messages`` list (role/content dicts), not both."""

    text: str | None = None
    messages: tuple[dict, ...] | None = None
    origin: str = ""
    """Where it came from (file and line or row) for error messages."""


def parse_columns(spec: str | Mapping[str, str] | None) -> dict[str, str]:
    """A column mapping, field -> column, from ``"field=column,..."`` or a TOML table.

    ``prompt`` and ``response`` are returned as ``instruction`` and ``output``.

    Raises:
        UserError: an entry without ``=``, an unknown field, an empty column name, a field given twice.
    """
    if spec is None:
        return {}
    if isinstance(spec, str):
        pairs = []
        for entry in (e.strip() for e in spec.split(",")):
            if not entry:
                continue
            field_name, sep, column = entry.partition("=")
            if not sep:
                raise UserError(f"--data-columns: '{entry}' is not FIELD=COLUMN (e.g. text=body or prompt=q,response=a)")
            pairs.append((field_name.strip(), column.strip()))
    elif isinstance(spec, Mapping):
        pairs = list(spec.items())
    else:
        raise UserError(f"--data-columns ([data] columns) must be FIELD=COLUMN pairs, got {type(spec).__name__}")
    mapping: dict[str, str] = {}
    for field_name, column in pairs:
        canonical = FIELD_ALIASES.get(field_name, field_name)
        if canonical not in FIELDS:
            raise UserError(f"--data-columns: unknown field '{field_name}' (one of: "
                            f"{', '.join(FIELDS + tuple(FIELD_ALIASES))})")
        if not isinstance(column, str) or not column:
            raise UserError(f"--data-columns: field '{field_name}' needs a column name")
        if canonical in mapping:
            raise UserError(f"--data-columns: field '{field_name}' is given twice")
        mapping[canonical] = column
    return mapping


def check_format(data_format: str) -> None:
    """Raises:
    UserError: ``data_format`` is not one of :data:`DATA_FORMATS`."""
    if data_format not in DATA_FORMATS:
        raise UserError(f"--data-format must be one of {', '.join(DATA_FORMATS)}, got '{data_format}'")


def _column(name: str, columns: Mapping[str, str]) -> str:
    return columns.get(name, name)


def _label(name: str, columns: Mapping[str, str]) -> str:
    """How a field is named in an error: ``'text'`` or ``'text' (column 'body')``."""
    col = columns.get(name)
    return f"'{name}'" if col is None or col == name else f"'{name}' (column '{col}')"


def check_columns(names: Iterable[str], data_format: str, columns: Mapping[str, str], where: str) -> None:
    """Check a table's columns against the format and mapping before its rows are read.

    Raises:
        UserError: naming ``where`` (the file or data set), a mapped column that is missing, a
            field the format needs that no column holds, or (``auto``) columns of no known format.
    """
    names = list(names)
    have = set(names)
    listed = ", ".join(names) or "none"
    for name, col in columns.items():
        if col not in have:
            raise UserError(f"{where}: --data-columns {name}={col}: no column '{col}' (columns: {listed})")
    if data_format == "auto":
        if not any(all(_column(f, columns) in have for f in fs) for fs in FORMAT_FIELDS.values()):
            raise UserError(
                f"{where}: columns {listed} match no known format (text, messages, alpaca instruction/output, "
                "sharegpt conversations): name it with --data-format and its columns with --data-columns, "
                "e.g. --data-columns text=COLUMN"
            )
        return
    for name in FORMAT_FIELDS[data_format]:
        if _column(name, columns) not in have:
            raise UserError(f"{where}: --data-format {data_format} needs a column {_label(name, columns)} "
                            f"(columns: {listed}; map one with --data-columns {name}=COLUMN)")


def detect_format(row: Mapping, columns: Mapping[str, str]) -> str | None:
    """The format of one row under ``auto`` (``None``: none of them)."""
    if isinstance(row.get(_column("text", columns)), str):
        return "text"
    for fmt in ("chat", "sharegpt", "alpaca"):
        if any(row.get(_column(f, columns)) is not None for f in FORMAT_FIELDS[fmt]):
            return fmt
    return None


def row_to_document(row: Mapping, data_format: str, columns: Mapping[str, str], where: str) -> Document:
    """One row as a :class:`Document`.

    Args:
        row: the row's fields (column name -> value).
        data_format: one of :data:`DATA_FORMATS`.
        columns: field -> column (:func:`parse_columns`).
        where: the row in error messages (``data.jsonl:17``, ``data.parquet row 17``).

    Raises:
        UserError: naming ``where`` and the field: a missing field, a value of the wrong type, an
            unknown role, a conversation without an assistant message.
    """
    fmt = detect_format(row, columns) if data_format == "auto" else data_format
    if fmt is None:
        raise UserError(f"{where}: expected a 'text' string or a 'messages' list (or alpaca 'instruction'/"
                        "'output', sharegpt 'conversations'; other columns: --data-format, --data-columns)")
    if fmt == "text":
        return Document(text=_string(row, "text", columns, where), origin=where)
    if fmt == "chat":
        messages = _chat_messages(_list(row, "messages", columns, where), where)
    elif fmt == "alpaca":
        messages = _alpaca_messages(row, columns, where)
    else:
        messages = _sharegpt_messages(row, columns, where)
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: conversation has no assistant message to learn from")
    return Document(messages=tuple(messages), origin=where)


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _string(row: Mapping, name: str, columns: Mapping[str, str], where: str, optional: bool = False) -> str:
    value = row.get(_column(name, columns))
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        if value is None and _column(name, columns) not in row:
            raise UserError(f"{where}: no {_label(name, columns)} field")
        raise UserError(f"{where}: {_label(name, columns)} must be a string, got {_type_name(value)}")
    return value


def _list(row: Mapping, name: str, columns: Mapping[str, str], where: str) -> list:
    value = row.get(_column(name, columns))
    if not isinstance(value, (list, tuple)):
        raise UserError(f"{where}: {_label(name, columns)} must be a list, got {_type_name(value)}")
    return list(value)


def _chat_messages(msgs: list, where: str) -> list[dict]:
    for m in msgs:
        if not (isinstance(m, Mapping) and m.get("role") in CHAT_ROLES and isinstance(m.get("content"), str)):
            raise UserError(f"{where}: each message needs 'role' (system/user/assistant) and string 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def _alpaca_messages(row: Mapping, columns: Mapping[str, str], where: str) -> list[dict]:
    instruction = _string(row, "instruction", columns, where)
    extra = _string(row, "input", columns, where, optional=True)
    output = _string(row, "output", columns, where)
    system = _string(row, "system", columns, where, optional=True)
    messages = [{"role": "system", "content": system}] if system else []
    history = row.get(_column("history", columns))
    for turn in history or ():
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
            raise UserError(f"{where}: {_label('history', columns)} must be a list of [user, assistant] string pairs")
        messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    prompt = "\n".join(p for p in (instruction, extra) if p)
    return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]


def _sharegpt_messages(row: Mapping, columns: Mapping[str, str], where: str) -> list[dict]:
    turns = _list(row, "conversations", columns, where)
    system = _string(row, "system", columns, where, optional=True)
    messages = [{"role": "system", "content": system}] if system else []
    for i, turn in enumerate(turns, 1):
        if not isinstance(turn, Mapping):
            raise UserError(f"{where}: conversations message {i} must be an object with 'from' and 'value'")
        speaker = turn.get("from", turn.get("role"))
        value = turn.get("value", turn.get("content"))
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise UserError(f"{where}: conversations message {i}: 'from' must be one of "
                            f"{', '.join(SHAREGPT_ROLES)}, got {speaker!r}")
        if not isinstance(value, str):
            raise UserError(f"{where}: conversations message {i}: 'value' must be a string, got {_type_name(value)}")
        messages.append({"role": role, "content": value})
    return messages
