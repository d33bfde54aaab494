"""Errors of the device store. All are :class:`memascend.errors.UserError`: the CLI prints them as
one line naming the device, the tensor key and the byte offset, and exits 2.
"""

from __future__ import annotations

from memascend.errors import UserError


class StoreError(UserError):
    """Base class of every device-store error."""


class DeviceRefusedError(StoreError):
    """The device or file is unsafe to overwrite: it is mounted or held, or carries a filesystem,
    a partition table or another store's header. The message names what was found and the fix."""


class StoreFullError(StoreError):
    """No free extent is large enough for a tensor; names the key, the bytes asked for, the free
    bytes and the largest free extent."""


class StoreIOError(StoreError):
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


class ChecksumError(StoreError):
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


class StoreFormatError(StoreError):
    """The header or extent table on the device is damaged or of an unknown format version."""
