"""Store header and extent table encoding."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memascend.io.errors import StoreFormatError
from memascend.io.header import STORE_MAGIC, StoreHeader, decode_table, encode_table
from memascend.ops import nvme_io


def crc(data: bytes) -> int:
    return nvme_io.load().crc32c_bytes(data)


@settings(max_examples=50, deadline=None)
@given(
    align=st.sampled_from([4096, 8192]),
    slot=st.integers(1, 64),
    gen=st.integers(0, 2**40),
    active=st.integers(0, 1),
    tlen=st.integers(0, 4096),
)
def test_header_round_trip(align, slot, gen, active, tlen):
    h = StoreHeader(
        owner_uuid=uuid.uuid4(),
        device_bytes=1 << 30,
        align_bytes=align,
        table_slot_bytes=slot * align,
        generation=gen,
        active_slot=active,
        table_length=tlen,
        table_crc32c=12345,
    )
    block = h.pack(crc)
    assert len(block) == align and block[:8] == STORE_MAGIC
    assert StoreHeader.unpack(block, crc) == h
    assert h.data_offset == align + 2 * slot * align


def test_damaged_header_is_refused():
    h = StoreHeader(owner_uuid=uuid.uuid4(), device_bytes=1 << 30, align_bytes=4096, table_slot_bytes=4096)
    block = bytearray(h.pack(crc))
    block[30] ^= 1
    with pytest.raises(StoreFormatError, match="damaged"):
        StoreHeader.unpack(bytes(block), crc)
    with pytest.raises(StoreFormatError, match="no memascend store header"):
        StoreHeader.unpack(b"\0" * 4096, crc)


def test_table_round_trip_and_damage():
    table = {
        f"layer{i}.weight": {"o": i * 4096, "n": 100, "a": 4096, "c": i, "d": "torch.bfloat16", "s": [10, 5]}
        for i in range(300)
    }
    data = encode_table(table)
    assert decode_table(data) == table
    assert len(data) < 300 * 40  # compressed
    with pytest.raises(StoreFormatError):
        decode_table(b"garbage")
