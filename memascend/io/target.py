"""Preparing the target of a new device store (a raw block device or a file), and undoing that
when :meth:`memascend.io.store.TensorStore.create` fails: nothing is lost, a refused or failed
create leaves the target as it was.

Source: MemAscend (arXiv 2505.23254), direct NVMe engine; DeepSpeed's swap folder needed no such
step (the filesystem created the ``.swp`` files).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from memascend.errors import UserError
from memascend.io import device as _device
from memascend.io.engine import crc_bytes
from memascend.io.errors import StoreError
from memascend.io.header import STORE_MAGIC, StoreHeader


@dataclass
class TargetChange:
    """What preparing ``path`` did to it, so that :meth:`undo` can put it back.

    Attributes:
        created: the file did not exist and was created.
        original_size_bytes: size of an existing file before it was grown (``None``: not grown).
    """

    path: Path
    created: bool = False
    original_size_bytes: int | None = None

    def prepare(self, *, size_bytes: int | None, owner_uuid: uuid.UUID, allow_overwrite: bool) -> None:
        """Create and preallocate a missing file, or check an existing target and grow a file.

        Args:
            size_bytes: file size (``posix_fallocate``); required for a file that does not
                exist, ignored for a block device.
            owner_uuid: a target whose store header carries it is this owner's old store (reused).
            allow_overwrite: accept a target that carries data.

        Raises:
            UserError: a missing file and no size. DeviceRefusedError: see
                :func:`memascend.io.device.check_target`. Whatever it did so far is recorded
                here first: call :meth:`undo` on any error.
        """
        p = self.path
        if not p.exists():
            if size_bytes is None:
                raise UserError(f"nvme path {p} does not exist: pass a size to create a store file there")
            self.created = True  # before preallocating: a failure half-way must remove the file
            _device.preallocate_file(p, size_bytes)
            return
        own = False
        head = _device.read_head(p, 4096)
        if head[:8] == STORE_MAGIC:
            try:
                own = StoreHeader.unpack(head, crc_bytes).owner_uuid == owner_uuid
            except StoreError:
                own = False
        _device.check_target(p, allow_overwrite=allow_overwrite, own_store=own)
        if size_bytes is not None and not _device.probe_info(p).is_block_device:
            self.original_size_bytes = p.stat().st_size
            _device.preallocate_file(p, size_bytes)

    def undo(self) -> None:
        """Remove a file that was created, truncate a grown one back (never raises)."""
        try:
            if self.created:
                self.path.unlink(missing_ok=True)
            elif (
                self.original_size_bytes is not None
                and self.path.is_file()
                and self.path.stat().st_size > self.original_size_bytes
            ):
                os.truncate(self.path, self.original_size_bytes)
        except OSError:
            pass
