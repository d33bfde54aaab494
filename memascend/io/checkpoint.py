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
from typing import TYPE_CHECKING

from memascend.errors import IntegrityError, UserError
from memascend.io.errors import ChecksumError
from memascend.io.extent import Extent
from memascend.io.store import EXPORT_CHUNK_BYTES, MANIFEST_NAME, ExtentRecord, _check_job
from memascend.ops import nvme_io as _op

if TYPE_CHECKING:
    from memascend.io.store import TensorStore


def export_files(
    self: TensorStore,
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
    self.wait_all()
    with self._lock:
        records = sorted(self._records.values(), key=lambda r: r.key)
    if select is not None:
        records = [r for r in records if select(r.key)]
    op = _op.load()
    chunk = max(self.align_bytes, chunk_bytes // self.align_bytes * self.align_bytes)
    staging = op.aligned_empty(chunk)
    view = staging.numpy()
    manifest = []
    for i, rec in enumerate(records):
        name = f"tensor_{i:06d}.bin"
        crc = 0
        with open(out / name, "wb") as f:
            for pos in range(0, rec.nbytes, chunk):
                n = min(chunk, rec.nbytes - pos)
                res = self._engine.wait(self._engine.submit_read(staging, rec.offset_bytes + pos, n))
                self._count("read", n)
                _check_job(self._engine, res, rec.key, rec.offset_bytes + pos, self.path)
                crc = op.crc32c(staging, n, crc)
                f.write(view[:n].data)
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        if rec.crc32c is not None and crc != rec.crc32c:
            raise ChecksumError(
                f"checksum mismatch exporting tensor '{rec.key}' at device offset {rec.offset_bytes} of {self.path}",
                key=rec.key,
                offset_bytes=rec.offset_bytes,
                expected_crc32c=rec.crc32c,
                actual_crc32c=crc,
            )
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
    # The manifest is the export's completion marker: written last, after every tensor file is
    # on the device, atomically (a temporary file renamed into place), then the folder fsynced.
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
    self: TensorStore, folder: str | os.PathLike, *, chunk_bytes: int = EXPORT_CHUNK_BYTES
) -> list[str]:
    """Load tensors exported by :meth:`export_files` (replacing keys that exist).

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
    ]
    return _import_entries(self, entries, chunk_bytes)


def import_swap_files(
    self: TensorStore, files: dict[str, str | os.PathLike], *, chunk_bytes: int = EXPORT_CHUNK_BYTES
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
    return _import_entries(self, entries, chunk_bytes)


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


def _import_entries(self: TensorStore, entries: list[tuple], chunk_bytes: int) -> list[str]:
    """Stream ``(key, file, nbytes, dtype, shape, expected crc32c or None)`` into the store."""
    op = _op.load()
    chunk = max(self.align_bytes, chunk_bytes // self.align_bytes * self.align_bytes)
    staging = op.aligned_empty(chunk)
    view = staging.numpy()
    keys = []
    for key, file, nbytes, dtype, shape, expected_crc in entries:
        if not file.is_file() or file.stat().st_size != nbytes:
            raise IntegrityError(f"checkpoint file {file} of tensor '{key}' is missing or not {nbytes} bytes")
        with self._lock:
            self._check_open()
            if key in self._writes or self._reads.get(key):
                raise ValueError(f"tensor '{key}' has a transfer in flight")
            old = self._records.get(key)
            offset = self._allocate(key, nbytes, old) if nbytes else 0
            self._writes.add(key)
        crc = 0
        try:
            with open(file, "rb") as f:
                for pos in range(0, nbytes, chunk):
                    n = f.readinto(view[: min(chunk, nbytes - pos)].data)
                    crc = op.crc32c(staging, n, crc)
                    res = self._engine.wait(self._engine.submit_write(staging, offset + pos, n))
                    self._count("write", n)
                    _check_job(self._engine, res, key, offset + pos, self.path, op="write")
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            if expected_crc is not None and crc != expected_crc:
                raise ChecksumError(
                    f"checksum mismatch importing tensor '{key}' from {file}: the checkpoint file is corrupt",
                    key=key,
                    offset_bytes=offset,
                    expected_crc32c=expected_crc,
                    actual_crc32c=crc,
                )
        except BaseException:
            with self._lock:
                self._writes.discard(key)
                if nbytes:
                    self._alloc.free(Extent(offset, self._alloc.aligned_size(nbytes)))
            raise
        rec = ExtentRecord(
            key=key,
            offset_bytes=offset,
            nbytes=nbytes,
            alloc_bytes=self._alloc.aligned_size(nbytes) if nbytes else 0,
            crc32c=crc if self.enable_crc or nbytes == 0 else None,
            dtype=dtype,
            shape=tuple(shape),
        )
        with self._lock:
            self._writes.discard(key)
            self._records[key] = rec
        keys.append(key)
    return keys
