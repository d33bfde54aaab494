"""The direct I/O engine under a device store (the C++ op ``csrc/nvme_io``): opening it on a
target, checking a finished job, CRC32C of bytes, reading the store header and extent table.

Source: MemAscend (arXiv 2505.23254), direct NVMe engine (io_uring + O_DIRECT); replaces
DeepSpeed's ``aio_handle`` (``deepspeed/ops/csrc/aio``) behind the swappers.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from memascend.errors import UserError
from memascend.io.errors import ChecksumError, DeviceRefusedError, StoreIOError
from memascend.io.header import StoreHeader, decode_table
from memascend.io.records import ExtentRecord
from memascend.ops import nvme_io as _op
from memascend.units import format_bytes


def crc_bytes(data: bytes) -> int:
    """CRC32C of ``data`` (the header's and extent table's checksum)."""
    return _op.load().crc32c_bytes(bytes(data))


def open_engine(path: Path, queue_depth: int, request_bytes: int, enable_direct: bool, backend: str = "auto"):
    """A ``memascend_nvme_io.Engine`` on ``path``.

    Args:
        queue_depth: requests in flight at most; request_bytes: largest single request;
        enable_direct: O_DIRECT; backend: ``"auto"``, ``"io_uring"`` or ``"libaio"``.

    Raises:
        DeviceRefusedError: EBUSY (a mounted or claimed block device, or a file another store locks).
        UserError: any other OS error opening it.
    """
    try:
        return _op.load().Engine(
            str(path),
            queue_depth=queue_depth,
            request_bytes=request_bytes,
            enable_direct=enable_direct,
            backend=backend,
        )
    except OSError as exc:
        if exc.errno == 16:  # EBUSY: mounted/claimed block device (O_EXCL), or a file another store locks
            raise DeviceRefusedError(
                f"nvme path {exc.strerror}: one store per device or file (one per rank)"
            ) from exc
        raise UserError(f"nvme path {path}: {exc.strerror or exc}") from exc


def check_job(result, key: str, offset_bytes: int, path, *, op: str = "read") -> None:
    """Raise for a failed or short engine job (``result`` of ``Engine.wait``; ``None`` passes).

    Args:
        key: the tensor (or ``"<store header>"``...) the job moved, for the message.
        offset_bytes: device offset of its extent; path: the target; op: ``"read"``/``"write"``.

    Raises:
        StoreIOError: an errno (EIO, ...) or a short transfer; names key and device offset.
    """
    if result is None or (result.error == 0 and not result.short_transfer):
        return
    where = result.error_offset or offset_bytes
    if result.short_transfer:
        raise StoreIOError(
            f"short {op} of tensor '{key}' at device offset {where} of {path} (extent at {offset_bytes}): end of device reached",
            key=key,
            offset_bytes=where,
            errno=None,
        )
    raise StoreIOError(
        f"{op} of tensor '{key}' failed at device offset {where} of {path} (extent at {offset_bytes}): "
        f"{os.strerror(result.error)} (errno {result.error})",
        key=key,
        offset_bytes=where,
        errno=result.error,
    )


def new_header(engine, path: Path, *, owner_uuid: uuid.UUID, table_slot_bytes: int) -> StoreHeader:
    """The header of a new, empty store on ``engine``'s target ``path`` (not written yet).

    Args:
        owner_uuid: the store's owner; table_slot_bytes: room for one extent-table slot,
            rounded up to the engine's alignment.

    Raises:
        UserError: the target has no room for a data region after the header and table slots.
    """
    align = engine.align_bytes
    slot = -(-table_slot_bytes // align) * align
    header = StoreHeader(owner_uuid=owner_uuid, device_bytes=engine.size_bytes, align_bytes=align, table_slot_bytes=slot)
    if header.data_offset + align > engine.size_bytes:
        raise UserError(
            f"nvme path {path} holds {format_bytes(engine.size_bytes)}: too small for a store "
            f"(needs more than {format_bytes(header.data_offset + align)})"
        )
    return header


def read_header(engine, path: Path) -> StoreHeader:
    """The store header at offset 0 of ``engine``'s target ``path``.

    Raises:
        StoreIOError: the read failed. StoreFormatError: no store header, or a damaged one.
    """
    block = _op.load().aligned_empty(engine.align_bytes)
    check_job(engine.wait(engine.submit_read(block, 0)), "<store header>", 0, path)
    return StoreHeader.unpack(block.numpy().tobytes(), crc_bytes)


def read_table(engine, header: StoreHeader, path: Path) -> dict[str, ExtentRecord]:
    """The records of the extent table in ``header``'s active slot (empty for an empty store).

    Raises:
        StoreIOError: the read failed. ChecksumError: the table is damaged.
    """
    if not header.table_length:
        return {}
    off = header.slot_offset(header.active_slot)
    buf = _op.load().aligned_empty(header.table_length)
    check_job(engine.wait(engine.submit_read(buf, off)), "<extent table>", off, path)
    data = buf.numpy().tobytes()
    if crc_bytes(data) != header.table_crc32c:
        raise ChecksumError(
            f"extent table of {path} at offset {off} is damaged (checksum mismatch)",
            key="<extent table>",
            offset_bytes=off,
            expected_crc32c=header.table_crc32c,
            actual_crc32c=crc_bytes(data),
        )
    return {k: ExtentRecord.from_json(k, v) for k, v in decode_table(data).items()}
