"""Which raw store a rank swaps to, when ``--nvme-path`` names one instead of a folder.

``--nvme-path`` selects the swap backend:

* a folder (the default ``./memascend-swap``): stock DeepSpeed's folder of ``.swp`` files
  (:mod:`memascend.train.swapdir`);
* a block device (``/dev/nvme0n1p3``, ``/dev/loop0``) or a file whose name ends in ``.store``: the
  direct NVMe store (:mod:`memascend.integrations.deepspeed.raw_store`). One target per rank:
  several ranks on a host give a comma-separated list with one device (or file) per rank
  (``/dev/nvme0n1p3,/dev/nvme1n1p3``), or a single ``.store`` file path, which becomes
  ``PATH.rank<N>`` for rank N (when more than one rank runs on the host).

``--nvme-path`` names the NVMe of the node each rank runs on: on several nodes (torchrun
``--nnodes``, the deepspeed launcher's hostfile) every node uses the same list for its own ranks,
indexed by the LOCAL rank (``LOCAL_RANK``; the list has one entry per rank of the node), and a
``.store`` path becomes ``PATH.rank<local rank>`` on each node. On one node local and global ranks
are the same.
"""

from __future__ import annotations

from pathlib import Path

from memascend.config import STORE_FILE_SUFFIX, SwapTarget, is_block_device
from memascend.errors import UserError

#: Room a store file gets beyond the estimated tensor bytes: header, two extent-table slots,
#: 4 KiB rounding of every extent and the staging of DeepSpeed's padded swap buffers.
STORE_FILE_OVERHEAD_BYTES = 64 << 20


def is_store_target(nvme_path: str) -> bool:
    """Whether ``--nvme-path`` names raw stores (block devices or ``*.store`` files, possibly a
    comma-separated list) rather than a folder for swap files: ``SwapTarget.is_raw_store``
    (a run's config has it as ``cfg.offload.swap_target``)."""
    return SwapTarget.of(nvme_path).is_raw_store


def resolve_store_target(nvme_path: str, local_rank: int, local_world_size: int) -> Path:
    """This rank's store target on its node.

    Args:
        nvme_path: ``--nvme-path`` (a device, a ``.store`` path, or a comma-separated list).
        local_rank: the rank's index on its node (``LOCAL_RANK``; the global rank on one node).
        local_world_size: ranks on the node (the world size on one node).

    Raises:
        UserError: a list whose length is not the number of ranks on the node, one block device
            for several ranks, an entry that is neither a block device nor a ``.store`` file path,
            or a ``.store`` path that is a folder.
    """
    parts = [p.strip() for p in nvme_path.split(",")]
    if any(not p for p in parts):
        raise UserError(f"--nvme-path has an empty entry: '{nvme_path}'")
    if len(parts) > 1:
        if len(parts) != local_world_size:
            raise UserError(
                f"--nvme-path lists {len(parts)} stores for {local_world_size} rank(s) on this node: give one "
                "device or file per rank of the node (each node's list is indexed by its local rank)"
            )
        chosen = parts[local_rank]
    else:
        chosen = parts[0]
        if local_world_size > 1:
            if is_block_device(chosen):
                raise UserError(
                    f"--nvme-path {chosen} is one block device for {local_world_size} ranks on this node: give "
                    "one device per rank of the node as a comma-separated list"
                )
            chosen = f"{chosen}.rank{local_rank}"
    path = Path(chosen).expanduser()
    if is_block_device(str(path)):
        return path
    if not str(parts[local_rank if len(parts) > 1 else 0]).endswith(STORE_FILE_SUFFIX):
        raise UserError(
            f"--nvme-path entry {chosen} is neither a block device nor a file ending in {STORE_FILE_SUFFIX}"
        )
    if path.exists() and not path.is_file():
        raise UserError(f"--nvme-path {chosen} exists and is not a regular file")
    if not path.parent.is_dir():
        raise UserError(f"--nvme-path {chosen}: folder {path.parent} does not exist")
    return path


def store_file_bytes(need_bytes: int) -> int:
    """Size to preallocate for a store file holding about ``need_bytes`` of swapped tensors."""
    return int(need_bytes) + STORE_FILE_OVERHEAD_BYTES
