"""On-disk layout of a device store: header at offset 0, two extent-table slots, data region.

::

    [0, align)                      header (one block): magic, format version, owner UUID, layout
    [align, align + slot)           extent table slot 0 (zlib-compressed JSON)
    [align + slot, align + 2 slot)  extent table slot 1
    [data_offset, device end)       extents of tensors

The table is written to the slot the header does not point at, then the header is rewritten to
point at it (higher generation), so a crash between the two leaves the previous table intact.
The header carries a CRC32C of itself and of the active table.

Source: MemAscend (arXiv 2505.23254), direct NVMe engine ("a header so a store is recognised").
"""

from __future__ import annotations

import json
import struct
import uuid
import zlib
from dataclasses import dataclass

from memascend.io.errors import StoreFormatError

STORE_MAGIC = b"MEMASCND"
FORMAT_VERSION = 1
# magic, version, header_bytes, owner uuid, device_bytes, align_bytes, table_slot_bytes,
# data_offset, generation, active_slot, table_length, table_crc32c
_FMT = "<8sII16sQQQQQIQI"
_FIXED_BYTES = struct.calcsize(_FMT)
_CRC = struct.Struct("<I")


@dataclass(frozen=True, kw_only=True)
class StoreHeader:
    """The store header (offset 0). All sizes and offsets in bytes."""

    owner_uuid: uuid.UUID
    """Identifies the store's owner (a run, a rank): a store with another owner is refused."""
    device_bytes: int
    """Capacity of the target when the store was created."""
    align_bytes: int
    """Alignment of every offset and extent: max(logical block, 4096)."""
    table_slot_bytes: int
    """Size of each of the two extent-table slots."""
    generation: int = 0
    """Incremented on every table flush."""
    active_slot: int = 0
    """Slot (0/1) holding the current table."""
    table_length: int = 0
    """Bytes of the compressed table in the active slot (0: empty store)."""
    table_crc32c: int = 0
    """CRC32C of those bytes."""
    version: int = FORMAT_VERSION

    @property
    def header_bytes(self) -> int:
        return self.align_bytes

    def slot_offset(self, slot: int) -> int:
        """Device byte offset of table slot ``slot``."""
        return self.align_bytes + slot * self.table_slot_bytes

    @property
    def data_offset(self) -> int:
        """First byte of the data region."""
        return self.align_bytes + 2 * self.table_slot_bytes

    def pack(self, crc32c) -> bytes:
        """The header block (``align_bytes`` long); ``crc32c(bytes) -> int`` is the checksum."""
        fixed = struct.pack(
            _FMT,
            STORE_MAGIC,
            self.version,
            self.header_bytes,
            self.owner_uuid.bytes,
            self.device_bytes,
            self.align_bytes,
            self.table_slot_bytes,
            self.data_offset,
            self.generation,
            self.active_slot,
            self.table_length,
            self.table_crc32c,
        )
        block = fixed + _CRC.pack(crc32c(fixed))
        return block + b"\0" * (self.align_bytes - len(block))

    @classmethod
    def unpack(cls, block: bytes, crc32c) -> StoreHeader:
        """Parse a header block.

        Raises:
            StoreFormatError: no store magic, a damaged header, or an unknown format version.
        """
        if len(block) < _FIXED_BYTES + _CRC.size or block[:8] != STORE_MAGIC:
            raise StoreFormatError("no memascend store header at offset 0")
        fixed = block[:_FIXED_BYTES]
        (stored_crc,) = _CRC.unpack_from(block, _FIXED_BYTES)
        if crc32c(fixed) != stored_crc:
            raise StoreFormatError("the store header at offset 0 is damaged (checksum mismatch)")
        (_, version, header_bytes, owner, device_bytes, align, slot, data_offset, gen, active, tlen, tcrc) = (
            struct.unpack(_FMT, fixed)
        )
        if version != FORMAT_VERSION:
            raise StoreFormatError(
                f"store format version {version} is not supported (this build reads {FORMAT_VERSION})"
            )
        hdr = cls(
            owner_uuid=uuid.UUID(bytes=owner),
            device_bytes=device_bytes,
            align_bytes=align,
            table_slot_bytes=slot,
            generation=gen,
            active_slot=active,
            table_length=tlen,
            table_crc32c=tcrc,
            version=version,
        )
        if header_bytes != align or data_offset != hdr.data_offset or active not in (0, 1) or tlen > slot:
            raise StoreFormatError("the store header at offset 0 is inconsistent")
        return hdr


def encode_table(records: dict[str, dict]) -> bytes:
    """Compressed extent table: ``{key: record fields}`` as zlib-compressed JSON."""
    return zlib.compress(json.dumps(records, separators=(",", ":"), sort_keys=True).encode(), 6)


def decode_table(data: bytes) -> dict[str, dict]:
    """Inverse of :func:`encode_table`.

    Raises:
        StoreFormatError: the bytes are not a table.
    """
    if not data:
        return {}
    try:
        return json.loads(zlib.decompress(data))
    except (zlib.error, ValueError) as exc:
        raise StoreFormatError(f"the store's extent table is damaged: {exc}") from exc
