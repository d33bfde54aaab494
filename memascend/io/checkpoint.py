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

from memascend.errors import UserError
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
    staging buffer of ``chunk_bytes``. Every tensor is verified against its CRC32C.

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
                _check_job(self._engine, res, rec.key, rec.offset_bytes + pos, self.path)
                crc = op.crc32c(staging, n, crc)
                f.write(view[:n].data)
            f.flush()
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
    path = out / MANIFEST_NAME
    path.write_text(json.dumps({"format": 1, "tensors": manifest}, indent=1))
    return path


def import_files(
    self: TensorStore, folder: str | os.PathLike, *, chunk_bytes: int = EXPORT_CHUNK_BYTES
) -> list[str]:
    """Load tensors exported by :meth:`export_files` (replacing keys that exist).

    Returns:
        The keys imported.

    Raises:
        UserError: no manifest, or a file of the wrong size.
        ChecksumError: a file's CRC32C differs from the manifest's (names the key and file).
        StoreFullError: no room.
    """
    src = Path(folder)
    try:
        manifest = json.loads((src / MANIFEST_NAME).read_text())["tensors"]
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"no readable {MANIFEST_NAME} in {src}: {exc}") from exc
    op = _op.load()
    chunk = max(self.align_bytes, chunk_bytes // self.align_bytes * self.align_bytes)
    staging = op.aligned_empty(chunk)
    view = staging.numpy()
    keys = []
    for entry in manifest:
        key, nbytes, file = entry["key"], int(entry["nbytes"]), src / entry["file"]
        if not file.is_file() or file.stat().st_size != nbytes:
            raise UserError(f"checkpoint file {file} of tensor '{key}' is missing or not {nbytes} bytes")
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
                    _check_job(self._engine, res, key, offset + pos, self.path, op="write")
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            if entry.get("crc32c") is not None and crc != entry["crc32c"]:
                raise ChecksumError(
                    f"checksum mismatch importing tensor '{key}' from {file}: the checkpoint file is corrupt",
                    key=key,
                    offset_bytes=offset,
                    expected_crc32c=entry["crc32c"],
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
            dtype=entry["dtype"],
            shape=tuple(entry["shape"]),
        )
        with self._lock:
            self._writes.discard(key)
            self._records[key] = rec
        keys.append(key)
    return keys
