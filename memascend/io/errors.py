"""Errors of the device store. The CLI prints each as one line naming the device, the tensor key and
the byte offset, and exits with the code of its kind (:mod:`memascend.errors`): a refused target is
bad input (2), a failed or short transfer and a full store are device failures (3), a checksum
mismatch and a damaged header or table are integrity failures (4).
"""

from __future__ import annotations

from memascend.errors import DeviceError, IntegrityError, MemascendError, UserError


class StoreError(MemascendError):
    """Base class of every device-store error."""


class DeviceRefusedError(StoreError, UserError):
    """The device or file is unsafe to overwrite: it is mounted or held, or carries a filesystem,
    a partition table or another store's header. The message names what was found and the fix."""


class StoreFullError(StoreError, DeviceError):
    """No free extent is large enough for a tensor; names the key, the bytes asked for, the free
    bytes and the largest free extent."""


class StoreIOError(StoreError, DeviceError):
    """A request failed (EIO, ...) or came back short; names the key, the device offset and errno.

    Attributes:
        key: tensor key of the failed transfer.
        offset_bytes: device byte offset of the first failed request.
        errno: the OS error number, or ``None`` for a short transfer.
    """

    def __init__(self, message: str, *, key: str, offset_bytes: int, errno: int | None) -> None:
        super().__init__(message)
        self.key = key
        self.offset_bytes = offset_bytes
        self.errno = errno


class ChecksumError(StoreError, IntegrityError):
    """The CRC32C of the bytes read differs from the one recorded when the extent was written.

    Attributes:
        key: tensor key.
        offset_bytes: device byte offset of the extent.
        expected_crc32c: the CRC recorded at write time.
        actual_crc32c: the CRC of the bytes read.
    """

    def __init__(
        self, message: str, *, key: str, offset_bytes: int, expected_crc32c: int, actual_crc32c: int
    ) -> None:
        super().__init__(message)
        self.key = key
        self.offset_bytes = offset_bytes
        self.expected_crc32c = expected_crc32c
        self.actual_crc32c = actual_crc32c


class StoreFormatError(StoreError, IntegrityError):
    """The header or extent table on the device is damaged or of an unknown format version."""
