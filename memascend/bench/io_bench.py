"""I/O benchmark of the direct NVMe engine against fio and DeepSpeed's aio handle, same run.

For every (pattern, block size, queue depth) it measures, on the same target:

* ``engine``: ``csrc/nvme_io`` (io_uring, O_DIRECT) on a preallocated file or a raw block device;
* ``fio``: ``fio --direct=1 --ioengine=io_uring`` at the same block size, queue depth and offsets;
* ``deepspeed``: DeepSpeed 0.19.8's ``AsyncIOBuilder().load().aio_handle`` writing and reading the
  same tensors as one file each in a folder on the filesystem of the target (what stock
  ZeRO-Infinity swapping does). Measured for the sequential pattern only: a file per tensor has
  no stride.

Patterns: ``seq`` (back-to-back requests) and ``strided`` (a gap of one block after each request,
fio's ``rw=write:<gap>``). Writes run first, then reads of the data just written (reading a
never-written preallocated extent would not touch the disk). Each measurement is repeated and the
best run kept, for every tool alike. Reports bandwidth (MiB/s) and the ratios engine/fio and
engine/deepspeed.

Usage::

    python -m memascend.bench.io_bench --target /var/tmp/bench.bin --total-mib 64 \\
        --block-kib 1024,16384 --queue-depth 8,32 --deepspeed-folder /var/tmp/ds_swap

Source: MemAscend (arXiv 2505.23254), direct NVMe engine: "at least 0.95x fio and at least
DeepSpeed's aio handle".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from memascend.io.device import preallocate_file, probe_info
from memascend.ops import nvme_io

MiB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Case:
    """One benchmark point."""

    pattern: str  # "seq" or "strided"
    op: str  # "write" or "read"
    block_bytes: int
    queue_depth: int
    total_bytes: int

    def offsets(self) -> list[int]:
        step = self.block_bytes * (2 if self.pattern == "strided" else 1)
        return [i * step for i in range(self.total_bytes // self.block_bytes)]

    @property
    def span_bytes(self) -> int:
        return self.total_bytes * (2 if self.pattern == "strided" else 1)


@dataclass(frozen=True, kw_only=True)
class Row:
    """Bandwidths of one case (MiB/s; ``None``: not measured) and the ratios."""

    pattern: str
    op: str
    block_bytes: int
    queue_depth: int
    total_bytes: int
    engine_mib_s: float
    fio_mib_s: float | None
    deepspeed_mib_s: float | None

    @property
    def ratio_fio(self) -> float | None:
        return self.engine_mib_s / self.fio_mib_s if self.fio_mib_s else None

    @property
    def ratio_deepspeed(self) -> float | None:
        return self.engine_mib_s / self.deepspeed_mib_s if self.deepspeed_mib_s else None


def engine_mib_s(target: str, case: Case, *, enable_crc: bool = False, backend: str = "auto") -> float:
    """Bandwidth of the engine: one job per block at ``case.offsets()``, ``queue_depth`` in flight,
    from ``queue_depth`` 4 KiB-aligned buffers reused round robin (as fio does)."""
    op = nvme_io.load()
    e = op.Engine(target, queue_depth=case.queue_depth, request_bytes=case.block_bytes, backend=backend)
    try:
        bufs = [op.aligned_empty(case.block_bytes) for _ in range(case.queue_depth)]
        for b in bufs:
            b.random_(0, 256)
        submit = e.submit_write if case.op == "write" else e.submit_read
        t0 = time.perf_counter()
        jobs = [submit(bufs[i % len(bufs)], off, -1, enable_crc) for i, off in enumerate(case.offsets())]
        for j in jobs:
            r = e.wait(j)
            if r.error or r.short_transfer:
                raise OSError(r.error, f"engine {case.op} failed at offset {r.error_offset}")
        dt = time.perf_counter() - t0
    finally:
        e.close()
    return case.total_bytes / MiB / dt


def fio_mib_s(target: str, case: Case) -> float:
    """Bandwidth of ``fio --ioengine=io_uring --direct=1`` with the same offsets, block, depth."""
    rw = case.op if case.pattern == "seq" else f"{case.op}:{case.block_bytes}"
    cmd = [
        "fio",
        "--name=memascend",
        f"--filename={target}",
        f"--rw={rw}",
        f"--bs={case.block_bytes}",
        f"--iodepth={case.queue_depth}",
        "--direct=1",
        "--ioengine=io_uring",
        f"--size={case.span_bytes}",
        f"--io_size={case.total_bytes}",
        "--offset=0",
        "--thread",
        "--output-format=json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0][case.op]
    return job["bw_bytes"] / MiB


def deepspeed_mib_s(folder: Path, case: Case, handle) -> float:
    """Bandwidth of DeepSpeed's aio handle writing/reading ``total/block`` tensors of ``block``
    bytes, one file each (``{folder}/{i}.tensor.swp``, as the stock swappers name them)."""
    n = case.total_bytes // case.block_bytes
    bufs = [
        handle.new_cpu_locked_tensor(case.block_bytes, torch.empty(0, dtype=torch.uint8))
        for _ in range(min(n, case.queue_depth))
    ]
    try:
        for b in bufs:
            b.random_(0, 256)
        call = handle.async_pwrite if case.op == "write" else handle.async_pread
        t0 = time.perf_counter()
        for i in range(n):
            call(bufs[i % len(bufs)], str(folder / f"{i}.tensor.swp"), 0)
        done = handle.wait()
        dt = time.perf_counter() - t0
        if done != n:
            raise OSError(f"deepspeed aio completed {done} of {n} requests")
    finally:
        for b in bufs:
            handle.free_cpu_locked_tensor(b)
    return case.total_bytes / MiB / dt


def load_deepspeed_handle(block_bytes: int, queue_depth: int):
    """DeepSpeed's aio handle with the settings of its swappers' defaults (single_submit off,
    overlap_events on, one thread), or ``None`` when the op cannot be loaded."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        aio = AsyncIOBuilder().load(verbose=False)
    except Exception:  # noqa: BLE001 - reported as "not measured"
        return None
    return aio.aio_handle(block_bytes, queue_depth, False, True, 1)


def warm_up(target: str, span_bytes: int) -> None:
    """Write the first ``span_bytes`` of the target once (untimed): on a preallocated file the
    first write of an extent also converts it from "unwritten", a cost no tool should pay alone."""
    op = nvme_io.load()
    e = op.Engine(target, queue_depth=8, request_bytes=8 * MiB)
    try:
        buf = op.aligned_empty(8 * MiB)
        buf.zero_()
        for j in [
            e.submit_write(buf, off, min(8 * MiB, span_bytes - off)) for off in range(0, span_bytes, 8 * MiB)
        ]:
            e.wait(j)
    finally:
        e.close()


def run(
    target: str,
    *,
    total_bytes: int,
    block_sizes: list[int],
    queue_depths: list[int],
    patterns: list[str],
    deepspeed_folder: Path | None,
    repeats: int = 3,
    enable_crc: bool = False,
    backend: str = "auto",
) -> list[Row]:
    """Measure every case on ``target`` (created and preallocated when missing); best of ``repeats``.

    Raises:
        memascend.errors.UserError: the target is unusable.
        subprocess.CalledProcessError: fio failed.
    """
    if not os.path.exists(target) or not probe_info(target).is_block_device:
        preallocate_file(target, 2 * total_bytes + MiB)  # creates, or grows a smaller file
    size = probe_info(target).size_bytes
    if size < 2 * total_bytes:
        raise ValueError(f"target {target} holds {size} bytes, the strided pattern needs {2 * total_bytes}")
    warm_up(target, 2 * total_bytes)
    have_fio = shutil.which("fio") is not None
    rows = []
    for pattern in patterns:
        for bs in block_sizes:
            for qd in queue_depths:
                handle = (
                    load_deepspeed_handle(bs, qd)
                    if deepspeed_folder is not None and pattern == "seq"
                    else None
                )
                best: dict[tuple[str, str], float] = {}
                for _ in range(repeats):
                    for op in ("write", "read"):
                        case = Case(
                            pattern=pattern, op=op, block_bytes=bs, queue_depth=qd, total_bytes=total_bytes
                        )
                        measures = {
                            "engine": lambda c=case: engine_mib_s(
                                target, c, enable_crc=enable_crc, backend=backend
                            )
                        }
                        if have_fio:
                            measures["fio"] = lambda c=case: fio_mib_s(target, c)
                        if handle is not None:
                            deepspeed_folder.mkdir(parents=True, exist_ok=True)
                            measures["deepspeed"] = lambda c=case, h=handle: deepspeed_mib_s(
                                deepspeed_folder, c, h
                            )
                        for tool, fn in measures.items():
                            best[(tool, op)] = max(best.get((tool, op), 0.0), fn())
                for op in ("write", "read"):
                    rows.append(
                        Row(
                            pattern=pattern,
                            op=op,
                            block_bytes=bs,
                            queue_depth=qd,
                            total_bytes=total_bytes,
                            engine_mib_s=best[("engine", op)],
                            fio_mib_s=best.get(("fio", op)),
                            deepspeed_mib_s=best.get(("deepspeed", op)),
                        )
                    )
                if deepspeed_folder is not None:
                    for f in deepspeed_folder.glob("*.tensor.swp"):
                        f.unlink()
    return rows


def format_table(rows: list[Row]) -> str:
    """Markdown table of the rows."""

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = [
        "| pattern | op | block KiB | qd | engine MiB/s | fio MiB/s | DeepSpeed MiB/s | engine/fio | engine/DeepSpeed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.pattern} | {r.op} | {r.block_bytes >> 10} | {r.queue_depth} | {r.engine_mib_s:.0f} | "
            f"{f(r.fio_mib_s, '.0f')} | {f(r.deepspeed_mib_s, '.0f')} | {f(r.ratio_fio, '.3f')} | {f(r.ratio_deepspeed, '.3f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--target", help="block device or file (created when missing); default: a file in --workdir"
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="folder for the default target and DeepSpeed's files (default: a temp dir)",
    )
    p.add_argument("--total-mib", type=int, default=64, help="MiB moved per measurement (default 64)")
    p.add_argument(
        "--block-kib", default="1024,16384", help="request sizes in KiB, comma-separated (default 1024,16384)"
    )
    p.add_argument("--queue-depth", default="8,32", help="queue depths, comma-separated (default 8,32)")
    p.add_argument("--patterns", default="seq,strided", help="seq and/or strided (default both)")
    p.add_argument(
        "--deepspeed-folder",
        default=None,
        help="folder for DeepSpeed's per-tensor files (default: WORKDIR/ds_swap; 'none' skips)",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement, best kept (default 3)")
    p.add_argument(
        "--crc", action="store_true", help="have the engine compute CRC32C per request (the store's default)"
    )
    p.add_argument(
        "--backend", default="auto", help="engine backend: auto, io_uring or libaio (default auto)"
    )
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    a = p.parse_args(argv)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="memascend_io_bench_", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    target = a.target or str(work / "engine_target.bin")
    ds = None if a.deepspeed_folder == "none" else Path(a.deepspeed_folder or work / "ds_swap")
    rows = run(
        target,
        total_bytes=a.total_mib * MiB,
        block_sizes=[int(x) << 10 for x in a.block_kib.split(",")],
        queue_depths=[int(x) for x in a.queue_depth.split(",")],
        patterns=a.patterns.split(","),
        deepspeed_folder=ds,
        repeats=a.repeats,
        enable_crc=a.crc,
        backend=a.backend,
    )
    print(format_table(rows))
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                [asdict(r) | {"ratio_fio": r.ratio_fio, "ratio_deepspeed": r.ratio_deepspeed} for r in rows],
                indent=1,
            )
        )
    if not a.target and not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
