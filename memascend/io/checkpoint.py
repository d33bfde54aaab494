"""Checkpointing of a device store: export every tensor to ordinary files, import them back.

DeepSpeed checkpoints NVMe-offloaded state by ``shutil.copytree`` of the swap folder
(``DeepSpeedEngine._save_checkpoint`` / ``optimizer_swapper.swap_folder``); a raw store has no folder,
so it writes one ``.bin`` per tensor plus ``manifest.json`` (key, dtype, shape, bytes, CRC32C), streamed
through one aligned staging buffer (host memory: ``chunk_bytes``), every tensor verified against
its CRC32C both ways. Source: MemAscend (arXiv 2505.23254), direct NVMe engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from memascend.errors import IntegrityError, UserError
from memascend.io.errors import ChecksumError
from memascend.io.records import ExtentRecord, Reservation
from memascend.io.store import TensorStore
from memascend.ops import nvme_io as _op

EXPORT_CHUNK_BYTES = 64 << 20
"""Default size of the staging buffer of an export or import (host memory, bytes)."""
MANIFEST_NAME = "manifest.json"
"""The export's index of tensors, written last (its completion marker)."""


def export_files(
    store: TensorStore,
    folder: str | os.PathLike,
    *,
    chunk_bytes: int = EXPORT_CHUNK_BYTES,
    select: Callable[[str], bool] | None = None,
) -> Path:
    """Copy every tensor to ordinary files in ``folder`` (one ``.bin`` per tensor plus
    ``manifest.json`` with key, dtype, shape, bytes, CRC32C): the checkpoint of a raw store,
    in place of DeepSpeed's ``shutil.copytree`` of the swap folder. Host memory used: one
    staging buffer of ``chunk_bytes``. Every tensor is verified against its CRC32C. Complete or
    absent: every tensor file is fsynced before the manifest is written (atomically, then the
    folder fsynced), so a folder without ``manifest.json`` is an export that never finished.

    Args:
        select: export only the keys for which it returns true (default: every key).

    Returns:
        Path of the manifest.

    Raises:
        ChecksumError, StoreIOError: a tensor cannot be read back intact.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    store.wait_all()
    records = [r for r in store.records() if select is None or select(r.key)]
    staging, chunk = _staging(store, chunk_bytes)
    manifest = []
    for i, rec in enumerate(records):
        name = f"tensor_{i:06d}.bin"
        crc = _export_one(store, rec, out / name, staging, chunk)
        manifest.append(
            {
                "key": rec.key,
                "file": name,
                "nbytes": rec.nbytes,
                "dtype": rec.dtype,
                "shape": list(rec.shape),
                "crc32c": crc,
            }
        )
    return _write_manifest(out, manifest)


def _staging(store: TensorStore, chunk_bytes: int):
    """(aligned staging buffer, its bytes): ``chunk_bytes`` rounded down to the store's alignment."""
    chunk = max(store.align_bytes, chunk_bytes // store.align_bytes * store.align_bytes)
    return _op.load().aligned_empty(chunk), chunk


def _export_one(store: TensorStore, rec: ExtentRecord, path: Path, staging, chunk: int) -> int:
    """Copy one tensor to ``path`` (fsynced) through ``staging``; return its CRC32C.

    Raises:
        ChecksumError: the bytes read differ from the record's CRC32C.
    """
    op = _op.load()
    view = staging.numpy()
    crc = 0
    with open(path, "wb") as f:
        for pos in range(0, rec.nbytes, chunk):
            n = min(chunk, rec.nbytes - pos)
            store.read_extent(rec, staging, pos, n)
            crc = op.crc32c(staging, n, crc)
            f.write(view[:n].data)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if rec.crc32c is not None and crc != rec.crc32c:
        raise ChecksumError(
            f"checksum mismatch exporting tensor '{rec.key}' at device offset {rec.offset_bytes} of {store.path}",
            key=rec.key,
            offset_bytes=rec.offset_bytes,
            expected_crc32c=rec.crc32c,
            actual_crc32c=crc,
        )
    return crc


def _write_manifest(out: Path, manifest: list[dict]) -> Path:
    """Write ``out/manifest.json``: the export's completion marker, written last, after every tensor
    file is on the device, atomically (a temporary file renamed into place), then the folder fsynced."""
    path = out / MANIFEST_NAME
    tmp = out / f".{MANIFEST_NAME}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"format": 1, "tensors": manifest}, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def import_files(
    store: TensorStore,
    folder: str | os.PathLike,
    *,
    chunk_bytes: int = EXPORT_CHUNK_BYTES,
    select: Callable[[str], bool] | None = None,
) -> list[str]:
    """Load tensors exported by :func:`export_files` (replacing keys that exist; only the keys for
    which ``select`` returns true, if given).

    Returns:
        The keys imported.

    Raises:
        UserError: no manifest. IntegrityError: a file the manifest lists is missing or of the wrong size.
        ChecksumError: a file's CRC32C differs from the manifest's (names the key and file).
        StoreFullError: no room.
    """
    src = Path(folder)
    manifest = read_manifest(src)
    entries = [
        (e["key"], src / e["file"], int(e["nbytes"]), e["dtype"], tuple(e["shape"]), e.get("crc32c"))
        for e in manifest
        if select is None or select(e["key"])
    ]
    return _import_entries(store, entries, chunk_bytes)


def import_swap_files(
    store: TensorStore, files: dict[str, str | os.PathLike], *, chunk_bytes: int = EXPORT_CHUNK_BYTES
) -> list[str]:
    """Load plain files (DeepSpeed's ``.swp`` files of a folder-of-files checkpoint,
    ``<tag>/offloaded_tensors/rank<NN>/``) into the store, one key per file, replacing keys that
    exist. A swap file is the raw bytes of one swap buffer, so each key is stored as the file's
    bytes (``torch.uint8``, shape ``(nbytes,)``); the swappers read bytes, not dtypes. The files
    carry no checksum: the CRC32C is computed while importing.

    Args:
        files: store key -> file path.

    Returns:
        The keys imported.

    Raises:
        UserError: a file is missing. StoreFullError: no room.
    """
    entries = []
    for key, file in sorted(files.items()):
        path = Path(file)
        if not path.is_file():
            raise UserError(f"checkpoint file {path} of tensor '{key}' is missing")
        n = path.stat().st_size
        entries.append((key, path, n, "torch.uint8", (n,), None))
    return _import_entries(store, entries, chunk_bytes)


def read_manifest(folder: str | os.PathLike) -> list[dict]:
    """The tensor entries of ``<folder>/manifest.json`` written by :func:`export_files`.

    Raises:
        UserError: no readable manifest.
    """
    src = Path(folder)
    try:
        return json.loads((src / MANIFEST_NAME).read_text())["tensors"]
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"no readable {MANIFEST_NAME} in {src}: {exc}") from exc


def copy_export_to_folder(
    folder: str | os.PathLike, files: dict[str, str | os.PathLike], *, chunk_bytes: int = EXPORT_CHUNK_BYTES
) -> list[Path]:
    """Write tensors of an export (:func:`export_files`) as plain files, each verified against the
    manifest's CRC32C: how a folder-of-files run (DeepSpeed's ``.swp`` files) resumes from the
    checkpoint of a raw-store run. Uses no store; host memory: one ``chunk_bytes`` buffer.

    Args:
        folder: the export (holds ``manifest.json``).
        files: store key -> destination file path; every key must be in the manifest.

    Returns:
        The files written.

    Raises:
        UserError: no manifest, or a key not in it.
        IntegrityError: an export file the manifest lists is missing or of the wrong size.
        ChecksumError: an export file's CRC32C differs from the manifest's (names key and file;
            the destination file is removed).
    """
    src = Path(folder)
    by_key = {e["key"]: e for e in read_manifest(src)}
    op = _op.load()
    buf = bytearray(max(1, chunk_bytes))
    view = memoryview(buf)
    written = []
    for key, dest in files.items():
        if key not in by_key:
            raise UserError(f"tensor '{key}' is not in {src / MANIFEST_NAME}")
        entry = by_key[key]
        file, nbytes = src / entry["file"], int(entry["nbytes"])
        if not file.is_file() or file.stat().st_size != nbytes:
            raise IntegrityError(f"checkpoint file {file} of tensor '{key}' is missing or not {nbytes} bytes")
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        crc = 0
        with open(file, "rb") as fin, open(dest, "wb") as fout:
            while n := fin.readinto(view):
                crc = op.crc32c_bytes(bytes(view[:n]), crc)
                fout.write(view[:n])
            os.posix_fadvise(fin.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        if entry.get("crc32c") is not None and crc != entry["crc32c"]:
            dest.unlink(missing_ok=True)
            raise ChecksumError(
                f"checksum mismatch reading tensor '{key}' from {file}: the checkpoint file is corrupt",
                key=key,
                offset_bytes=0,
                expected_crc32c=entry["crc32c"],
                actual_crc32c=crc,
            )
        written.append(dest)
    return written


def _import_entries(store: TensorStore, entries: list[tuple], chunk_bytes: int) -> list[str]:
    """Stream ``(key, file, nbytes, dtype, shape, expected crc32c or None)`` into the store."""
    staging, chunk = _staging(store, chunk_bytes)
    keys = []
    for key, file, nbytes, dtype, shape, expected_crc in entries:
        if not file.is_file() or file.stat().st_size != nbytes:
            raise IntegrityError(f"checkpoint file {file} of tensor '{key}' is missing or not {nbytes} bytes")
        res = store.reserve(key, nbytes)
        try:
            crc = _import_one(store, res, file, staging, chunk)
            if expected_crc is not None and crc != expected_crc:
                raise ChecksumError(
                    f"checksum mismatch importing tensor '{key}' from {file}: the checkpoint file is corrupt",
                    key=key,
                    offset_bytes=res.offset_bytes,
                    expected_crc32c=expected_crc,
                    actual_crc32c=crc,
                )
        except BaseException:
            store.release(res)
            raise
        store.commit(res, crc32c=crc, dtype=dtype, shape=tuple(shape))
        keys.append(key)
    return keys


def _import_one(store: TensorStore, res: Reservation, file: Path, staging, chunk: int) -> int:
    """Write ``file`` into the reserved extent through ``staging``; return the CRC32C of its bytes."""
    op = _op.load()
    view = staging.numpy()
    crc = 0
    with open(file, "rb") as f:
        for pos in range(0, res.nbytes, chunk):
            n = f.readinto(view[: min(chunk, res.nbytes - pos)].data)
            crc = op.crc32c(staging, n, crc)
            store.write_extent(res, staging, pos, n)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return crc
