"""Data files and data sets read with the Hugging Face ``datasets`` library.

- ``.json`` (an array of objects, or one object per line), ``.parquet``, ``.csv`` (every cell read
  as text; an empty cell is an empty string) and ``.arrow`` files, loaded with
  ``datasets.load_dataset(<builder>, data_files=...)`` (which prepares an Arrow copy in the
  ``datasets`` cache, ``HF_DATASETS_CACHE`` or ``HF_HOME/datasets``, and memory-maps it);
- a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
  (``datasets.load_from_disk``; memory-mapped in place);
- a data set id on the Hugging Face Hub (``org/name``), local cache first, downloaded where the
  network allows (``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``: the cache only).

Of a data set with several splits the ``train`` split is read. Rows are mapped to documents by
:mod:`memascend.data.formats`; errors name the file and the row, counted from 1 (a CSV's header
line is not a row).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Mapping
from pathlib import Path

from memascend.data.formats import Document, check_columns, row_to_document
from memascend.errors import UserError
from memascend.hub_ids import looks_like_repo_id

#: File suffix -> ``datasets`` packaged builder.
TABLE_BUILDERS = {".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}

#: Files ``save_to_disk`` writes into the folder of a ``Dataset`` or a ``DatasetDict``.
SAVED_MARKERS = ("state.json", "dataset_dict.json")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub repository id ``org/name`` (and not as a data file's path)."""
    known = (".jsonl", ".txt", ".md", *TABLE_BUILDERS)
    return looks_like_repo_id(name, known)


def is_saved_dataset(path: Path) -> bool:
    """Whether the folder ``path`` was written by ``save_to_disk``."""
    return path.is_dir() and any((path / m).is_file() for m in SAVED_MARKERS)


def _datasets():
    """The ``datasets`` module, its progress bars and info logging off (rank output stays one line
    per event)."""
    try:
        import datasets
    except ImportError:
        raise UserError("reading this data needs the PyPI package 'datasets' (run ./install.sh)") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _first_line(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    text = str(exc) or type(exc).__name__
    if cause is not None and str(cause) and "error occurred while generating" in text:
        text = str(cause)  # DatasetGenerationError wraps the reader's own error
    return " ".join(text.split())[:300]


def _train_split(ds, where: str):
    """A ``Dataset`` from a ``Dataset`` or the ``train`` split (or only split) of a ``DatasetDict``."""
    if hasattr(ds, "column_names") and isinstance(ds.column_names, list):
        return ds
    splits = list(ds)
    if "train" in splits:
        return ds["train"]
    if len(splits) == 1:
        return ds[splits[0]]
    raise UserError(f"{where}: has splits {', '.join(splits)} but no 'train' split")


def _csv_features(path: Path, datasets):
    """Every column of a CSV file as a string column (a CSV has no types; pandas would otherwise
    turn ``0012`` into 12 and ``NA`` into a missing value)."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read the CSV header ({_first_line(exc)})") from None
    if not header:
        raise UserError(f"{path}: CSV file has no header line")
    return datasets.Features({name: datasets.Value("string") for name in header})


def load_table_file(path: Path):
    """A ``.json``/``.parquet``/``.csv``/``.arrow`` file as a ``datasets.Dataset``.

    Raises:
        UserError: naming the file, when ``datasets`` cannot read it (malformed JSON, a damaged
            parquet file, ...).
    """
    datasets = _datasets()
    builder = TABLE_BUILDERS[path.suffix.lower()]
    kwargs = {}
    if builder == "csv":
        kwargs = {"features": _csv_features(path, datasets), "keep_default_na": False}
    try:
        return datasets.load_dataset(builder, data_files=str(path.resolve()), split="train", **kwargs)
    except (datasets.exceptions.DatasetGenerationError, ValueError, OSError, TypeError) as exc:
        raise UserError(f"{path}: cannot read it as {builder} data: {_first_line(exc)}") from None


def load_saved(path: Path):
    """A ``save_to_disk`` folder's ``Dataset`` (its ``train`` split for a ``DatasetDict``).

    Raises:
        UserError: naming the folder, when ``datasets`` cannot load it.
    """
    datasets = _datasets()
    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise UserError(f"{path}: cannot load the save_to_disk folder: {_first_line(exc)}") from None
    return _train_split(ds, str(path))


def load_hub(repo_id: str):
    """A Hub data set's ``train`` split: the local cache first, else downloaded.

    Raises:
        UserError: naming the id: not cached while offline or the Hub cannot be reached, no such
            data set (or it is gated/private), no ``train`` split among several.
    """
    datasets = _datasets()
    from huggingface_hub.errors import HfHubHTTPError

    try:
        ds = datasets.load_dataset(repo_id)
    except ConnectionError:
        raise UserError(
            f"data not found: {repo_id} is not a local path, and as a Hugging Face data set id it is not in the "
            "local cache while the Hub cannot be reached (HF_HUB_OFFLINE=1 or no network): run once with network "
            "or give a local file"
        ) from None
    except datasets.exceptions.DatasetNotFoundError:
        raise UserError(
            f"data not found: {repo_id} is neither a local path nor a data set on the Hugging Face Hub "
            "(a private or gated one needs `hf auth login`)"
        ) from None
    except (HfHubHTTPError, datasets.exceptions.DatasetGenerationError, ValueError, OSError) as exc:
        raise UserError(f"cannot load data set {repo_id} from the Hugging Face Hub: {_first_line(exc)}") from None
    return _train_split(ds, repo_id)


def size_bytes(ds) -> int:
    """Bytes of a ``datasets.Dataset``'s Arrow table (what its rows hold; 0 where it does not say)."""
    table = getattr(ds, "data", None)
    return int(getattr(table, "nbytes", 0) or 0)


def iter_rows(ds, name: str, data_format: str, columns: Mapping[str, str]) -> Iterator[Document]:
    """The documents of a ``datasets.Dataset``, one per row.

    Args:
        ds: the data set.
        name: the file, folder or id it came from, in error messages (``data.parquet row 17: ...``).
        data_format, columns: see :func:`memascend.data.formats.row_to_document`.

    Raises:
        UserError: naming ``name`` (and the row): the columns do not fit the format or a row is bad.
    """
    check_columns(ds.column_names, data_format, columns, name)
    for i, row in enumerate(ds, 1):
        yield row_to_document(row, data_format, columns, f"{name} row {i}")
