"""Records of the device store: where a tensor lives (:class:`ExtentRecord`), bytes moved
(:class:`IOCounters`), a transfer in flight (:class:`Ticket`) and an extent reserved for a
streamed write (:class:`Reservation`).

Source: MemAscend (arXiv 2505.23254), direct NVMe engine; an :class:`ExtentRecord` stands for one
of DeepSpeed's swap files (``{swap_folder}/{id}_param.tensor.swp``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class ExtentRecord:
    """Where one tensor lives on the device."""

    key: str
    offset_bytes: int
    """Device byte offset of the extent (a multiple of the store's ``align_bytes``)."""
    nbytes: int
    """Bytes of the tensor (``numel * element_size``)."""
    alloc_bytes: int
    """Bytes of the extent (``nbytes`` rounded up to ``align_bytes``; 0 for an empty tensor)."""
    crc32c: int | None
    """CRC32C of the tensor's bytes, or ``None`` when written with checksums off."""
    dtype: str
    """``str(tensor.dtype)`` at write time, e.g. ``"torch.float32"``."""
    shape: tuple[int, ...]

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.removeprefix("torch."))

    def to_json(self) -> dict:
        return {
            "o": self.offset_bytes,
            "n": self.nbytes,
            "a": self.alloc_bytes,
            "c": self.crc32c,
            "d": self.dtype,
            "s": list(self.shape),
        }

    @classmethod
    def from_json(cls, key: str, d: dict) -> ExtentRecord:
        return cls(
            key=key,
            offset_bytes=d["o"],
            nbytes=d["n"],
            alloc_bytes=d["a"],
            crc32c=d["c"],
            dtype=d["d"],
            shape=tuple(d["s"]),
        )


@dataclass(frozen=True)
class IOCounters:
    """Bytes a store has moved since it was constructed (every transfer submitted: tensors, header,
    extent table, checkpoint export/import; not the header and table reads inside
    :meth:`~memascend.io.store.TensorStore.open`). Subtract two snapshots for a window.

    ``read_bytes``/``write_bytes`` are device bytes (each request rounded up to ``align_bytes``
    under O_DIRECT, as the kernel sees them); ``payload_*`` are the tensor bytes asked for.
    """

    read_bytes: int = 0
    write_bytes: int = 0
    payload_read_bytes: int = 0
    payload_write_bytes: int = 0

    def __sub__(self, other: IOCounters) -> IOCounters:
        return IOCounters(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(eq=False)
class Ticket:
    """An in-flight transfer returned by :meth:`~memascend.io.store.TensorStore.submit_write` /
    ``submit_read``; pass it to :meth:`~memascend.io.store.TensorStore.wait`. Holds a reference to
    the tensor until then."""

    key: str
    op: str
    job_id: int | None
    record: ExtentRecord
    tensor: torch.Tensor


@dataclass(frozen=True)
class Reservation:
    """An extent reserved for a streamed write of ``key`` by
    :meth:`~memascend.io.store.TensorStore.reserve`; finished by ``commit`` or ``release``."""

    key: str
    offset_bytes: int
    """Device byte offset of the new extent (0 for an empty tensor, which has none)."""
    nbytes: int
    """Bytes that will be written (``alloc_bytes`` of the record is this rounded up to the alignment)."""
