"""Opening a run's swap target: the swap folder's run lock and private run folder, or the raw store.

``--nvme-path`` names a folder (stock DeepSpeed's ``.swp`` files in a private run folder under it,
:mod:`memascend.train.swapdir`) or raw stores (a block device or ``.store`` file per rank,
:mod:`memascend.train.store_target`; the store itself is
:mod:`memascend.integrations.deepspeed.raw_store`). :func:`open_swap_target` opens the one the run's
config names and records in the run's :class:`~memascend.train.cleanup.Cleanup` ledger what to undo,
and in the run-state file what a supervising parent removes after a hard death.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from memascend.config import OffloadConfig
from memascend.errors import UserError
from memascend.io.runlock import TargetBusyError
from memascend.train.cleanup import Cleanup
from memascend.train.dist import DistInfo
from memascend.train.preflight import check_aio_for_swap_folder
from memascend.train.store_target import resolve_store_target, store_file_bytes
from memascend.train.supervisor import record_run_state
from memascend.train.swapdir import lock_swap_folder, prepare_swap_dir
from memascend.units import format_bytes


def open_swap_target(offload: OffloadConfig, info: DistInfo, need_bytes: int, run_id: str, ledger: Cleanup, *,
                     lock_handle_buffers: bool = False):
    """This rank's swap target: the raw store (:func:`open_raw_store`), or the locked private swap
    folder ``<nvme_path>/memascend-<run_id>`` (every rank checks: ranks may have different NVMe paths
    via the environment; the run id is rank 0's, so all ranks of one launch use one run folder).

    Args:
        need_bytes: NVMe bytes this rank's run requires.
        ledger: gets the raw store, or the swap folder and its lock.
        lock_handle_buffers: see :func:`open_raw_store`.

    Returns:
        ``(swap_dir, raw_store)``: the folder DeepSpeed swaps to (the raw store's key folder with a
        raw store) and the raw store's handle (``None`` with a swap folder).

    Raises:
        UserError: as :func:`open_raw_store`, :func:`lock_swap_folder_for_run`,
            :func:`~memascend.train.swapdir.prepare_swap_dir` and
            :func:`~memascend.train.preflight.check_aio_for_swap_folder`.
    """
    if offload.swap_target.is_raw_store:
        raw_store = open_raw_store(offload, info, need_bytes, lock_handle_buffers=lock_handle_buffers)
        ledger.raw_store = raw_store
        record_run_state(info.rank, key_root=str(raw_store.key_root),
                         store_file=str(raw_store.target) if raw_store.created_file else None)
        return raw_store.key_root, raw_store
    check_aio_for_swap_folder()
    ledger.swap_lock = lock_swap_folder_for_run(offload.nvme_path, info, run_id)
    swap_dir = prepare_swap_dir(offload.nvme_path, need_bytes, run_id)
    ledger.swap_dir = swap_dir
    record_run_state(info.rank, swap_dir=str(swap_dir), nvme_path=str(swap_dir.parent))
    return swap_dir, None


def lock_swap_folder_for_run(nvme_path: str, info: DistInfo, run_id: str):
    """Take the swap folder's run lock (one rank per host and folder holds it for the launch) and
    remove the run folders of runs that died there; every rank fails with one line if another run
    holds it.

    Returns:
        The lock this rank holds, or ``None`` (another rank of this host holds it).

    Raises:
        TargetBusyError: another live run uses the folder.
    """
    import socket

    import torch.distributed as tdist

    key = (socket.gethostname(), os.path.realpath(os.path.expanduser(nvme_path)))
    keys = [key]
    if tdist.is_initialized() and info.world_size > 1:
        keys = [None] * info.world_size
        tdist.all_gather_object(keys, key)
    lock, error = None, None
    if keys.index(key) == info.rank:
        try:
            lock, removed = lock_swap_folder(nvme_path, run_id)
        except UserError as exc:
            error = exc
        else:
            for folder, size_bytes in removed:
                print(f"memascend: note: removed {folder} ({format_bytes(size_bytes)}), the swap folder of an "
                      "earlier run that did not finish", file=sys.stderr, flush=True)
    errors = [error]
    if tdist.is_initialized() and info.world_size > 1:
        errors = [None] * info.world_size
        tdist.all_gather_object(errors, None if error is None else str(error))
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        if lock is not None:
            lock.release()
        raise error if error is not None else TargetBusyError(str(first))
    return lock


def open_raw_store(offload: OffloadConfig, info: DistInfo, need_bytes: int, *, lock_handle_buffers: bool = False):
    """Create this rank's raw store and route DeepSpeed's swappers to it
    (:func:`memascend.integrations.deepspeed.apply_raw_store`; the seam's ``revert`` closes it).

    The target is this node's (:func:`memascend.train.store_target.resolve_store_target` with the
    local rank); the store's key folder and checkpoint exports use the global rank.

    Args:
        need_bytes: NVMe bytes this rank's run requires (the store file's size comes from it).
        lock_handle_buffers: page-lock the swap handles' buffers as stock's aio handle does (the
            baseline engine: stock on a raw target then locks what stock on a swap folder locks).

    Raises:
        UserError: bad target list, refused target (filesystem, partition table, other store, a
            non-empty file that is not a store, mounted) without ``--nvme-overwrite``, a target
            another run holds, or a device smaller than the run needs (checked before the store
            header is written: a refused target is left as it was).
    """
    from memascend.integrations import deepspeed as seam

    # --nvme-path names this node's NVMe: its list (or PATH.rank<N>) is indexed by the local rank
    target: Path = resolve_store_target(offload.nvme_path, info.local_rank, info.ranks_on_node)
    return seam.apply_raw_store(
        target,
        world_rank=info.rank,
        allow_overwrite=offload.nvme_overwrite,
        enable_crc=offload.enable_crc,
        size_bytes=store_file_bytes(need_bytes),
        min_capacity_bytes=need_bytes,
        lock_handle_buffers=lock_handle_buffers,
    )


def meter_swap_io(cfg, raw_store, swap_dir, ds_config: dict, announce) -> dict | None:
    """Probe the swap folder's bandwidth (a short sequential write and read at the run's aio settings;
    a swap folder only: not the raw store, not without NVMe offload), announce it as one line, and
    install the swap I/O meter (per-phase bytes and waits, both engines:
    :mod:`memascend.integrations.deepspeed.io_meter`).

    Args:
        cfg: the :class:`~memascend.config.RunConfig`.
        raw_store: the open raw store, or ``None``.
        swap_dir: the run's swap folder, or ``None``.
        ds_config: the resolved DeepSpeed config (its aio settings).
        announce: called with the bandwidth line.

    Returns:
        The measured bandwidth (``SwapBandwidth.to_dict()``: bytes per second each way), or ``None``.
    """
    from memascend.integrations import deepspeed as seam
    from memascend.integrations.deepspeed import io_meter

    bandwidth = None
    if cfg.offload.uses_nvme and raw_store is None and swap_dir is not None:
        bandwidth = io_meter.probe_folder_bandwidth(swap_dir, ds_config)
    if bandwidth is not None:
        announce(f"swap target: read {bandwidth.read_bytes_per_s / 1e9:.2f} GB/s, write "
                 f"{bandwidth.write_bytes_per_s / 1e9:.2f} GB/s (probe of {format_bytes(bandwidth.probe_bytes)}, "
                 f"{bandwidth.probe_s:.1f}s)")
    seam.install_io_meter()
    return bandwidth.to_dict() if bandwidth is not None else None
