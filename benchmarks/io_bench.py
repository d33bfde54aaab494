"""I/O benchmark of the direct NVMe engine against fio and DeepSpeed's aio handle, same run.

For every (pattern, block size, queue depth) it measures, on the same device:

* ``engine``: ``csrc/nvme_io`` (io_uring, O_DIRECT) on a preallocated file or a raw block device,
  without CRC32C (``--no-crc``, the speed-run setting) and/or with it (the store's default);
* ``fio``: ``fio --direct=1 --ioengine=io_uring`` at the same block size, queue depth and offsets;
* ``deepspeed``: DeepSpeed 0.19.8's ``AsyncIOBuilder().load().aio_handle`` writing and reading the
  same tensors as one file each in a folder on a filesystem of the device (what stock
  ZeRO-Infinity swapping does). Measured for the sequential pattern only: a file per tensor has
  no stride;
* ``engine_fs`` and ``fio_fs`` (with ``deepspeed``): the engine and fio on one preallocated file in
  that same filesystem, so that engine and DeepSpeed are also compared through the same kernel path
  (a filesystem's direct I/O and a raw block device's differ, by 10-20 % on a loop device).

Patterns: ``seq`` (back-to-back requests) and ``strided`` (a gap of one block after each request,
fio's ``rw=write:<gap>``), both over a region of ``--region-mib`` (default: ``--total-mib``) that
the ``--total-mib`` moved per measurement wrap around. The region is written once before anything
is timed (reading a never-written extent would not touch the device; the first write of a
preallocated extent converts it). The tools are interleaved: every repeat runs each tool once per
op, in an order rotated from repeat to repeat, so that a change of the machine's load hits all of
them alike. Reported: the median bandwidth (MiB/s) of each tool and, per ratio, the median and
the quartiles of the repeat-by-repeat ratios (the two runs of a pair are seconds apart, so a slow
drift of the load cancels).

``--ram-loop-mib N`` runs everything on a loop device backed by an N MiB file in a private tmpfs
(:mod:`benchmarks.ram_loop`): a raw partition for the engine and fio, ext4 for DeepSpeed,
all removed afterwards. Its service time is a memory copy, so the numbers compare the software
paths, not NVMe media.

Usage::

    python -m benchmarks.io_bench --target /var/tmp/bench.bin --total-mib 64 \\
        --block-kib 1024,16384 --queue-depth 8,32 --deepspeed-folder /var/tmp/ds_swap
    python -m benchmarks.io_bench --ram-loop-mib 1200 --total-mib 4096 --region-mib 256 \\
        --repeats 11 --crc both --json io.json        # root

Measure a few GiB per measurement: on a fast device a few hundred MiB take a tenth of a second,
and the repeat-by-repeat ratios then spread by tens of percent (docs/results.md, io-bench section).

Source: MemAscend (arXiv 2505.23254), direct NVMe engine: "at least 0.95x fio and at least
DeepSpeed's aio handle".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from memascend.errors import UserError
from memascend.io.device import preallocate_file, probe_info
from memascend.ops import nvme_io

MiB = 1 << 20
#: Tools in the order of the first repeat (later repeats rotate it).
TOOLS = ("engine", "engine_crc", "fio", "deepspeed", "engine_fs", "fio_fs")
#: The ratios reported per row: (JSON key, label, numerator tool, denominator tool).
RATIOS = (
    ("ratio_fio", "engine/fio", "engine", "fio"),
    ("ratio_crc_fio", "engine+CRC/fio", "engine_crc", "fio"),
    ("ratio_deepspeed", "engine/DeepSpeed", "engine", "deepspeed"),
    ("ratio_crc_deepspeed", "engine+CRC/DeepSpeed", "engine_crc", "deepspeed"),
    ("ratio_fs_fio", "FS: engine/fio", "engine_fs", "fio_fs"),
    ("ratio_fs_deepspeed", "FS: engine/DeepSpeed", "engine_fs", "deepspeed"),
)
#: The file the ``engine_fs`` and ``fio_fs`` tools use, next to DeepSpeed's per-tensor files.
FS_STORE_NAME = "engine_store.bin"


@dataclass(frozen=True, kw_only=True)
class Case:
    """One benchmark point."""

    pattern: str  # "seq" or "strided"
    op: str  # "write" or "read"
    block_bytes: int
    queue_depth: int
    total_bytes: int
    """Bytes moved by the measurement."""
    region_bytes: int = 0
    """Bytes of data in the region the requests cycle over (0: ``total_bytes``, no wrap)."""

    @property
    def data_bytes(self) -> int:
        return self.region_bytes or self.total_bytes

    @property
    def n_requests(self) -> int:
        return self.total_bytes // self.block_bytes

    @property
    def n_blocks(self) -> int:
        """Distinct blocks (offsets, DeepSpeed files) of the region."""
        return max(1, self.data_bytes // self.block_bytes)

    @property
    def n_buffers(self) -> int:
        """Host buffers a tool gets: one per request in flight (fio allocates ``iodepth`` buffers;
        stock and memascend swappers never have two transfers of one buffer in flight), even when
        the region has fewer distinct blocks than the queue depth (16 MiB at depth 32 over 256 MiB).
        With 16 buffers shared by 32 requests the engine's 16 MiB depth-32 writes were at
        0.90-0.94x of fio, with one buffer per request 0.98-1.04x (docs/results.md, io-bench records)."""
        return min(self.queue_depth, self.n_requests)

    def offsets(self) -> list[int]:
        step = self.block_bytes * (2 if self.pattern == "strided" else 1)
        return [(i % self.n_blocks) * step for i in range(self.n_requests)]

    @property
    def span_bytes(self) -> int:
        """Bytes of the device the offsets lie in (twice the data when strided)."""
        return self.data_bytes * (2 if self.pattern == "strided" else 1)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


@dataclass(frozen=True, kw_only=True)
class Row:
    """Median bandwidths of one case (MiB/s; ``None``: not measured) and the ratios.

    A ratio is the median, over the repeats, of the two tools' bandwidths in the same repeat.
    """

    pattern: str
    op: str
    block_bytes: int
    queue_depth: int
    total_bytes: int
    engine_mib_s: float | None
    fio_mib_s: float | None
    deepspeed_mib_s: float | None
    engine_crc_mib_s: float | None = None
    engine_fs_mib_s: float | None = None
    """The engine on a preallocated file in DeepSpeed's filesystem."""
    fio_fs_mib_s: float | None = None
    """fio on that file."""
    region_bytes: int = 0
    samples: dict[str, list[float]] = field(default_factory=dict, compare=False)
    """Every repeat's bandwidth per tool, in repeat order."""
    cpu_ms_per_gib: dict[str, float] = field(default_factory=dict, compare=False)
    """Median CPU time (user + system, milliseconds) per GiB moved, per tool: every thread of the
    tool (the engine's and DeepSpeed's in this process; the fio process's, less its start-up), io_uring
    workers included, not the device's service time (a loop device's kernel worker)."""

    def ratios(self, num: str, den: str) -> list[float]:
        """``num / den`` bandwidth of each repeat where both were measured."""
        a, b = self.samples.get(num, []), self.samples.get(den, [])
        return [x / y for x, y in zip(a, b, strict=False) if y > 0]

    def ratio(self, num: str, den: str) -> float | None:
        """Median of the paired repeat ratios ``num / den``; without samples, the ratio of the two
        tools' medians (``<tool>_mib_s``); ``None`` where either was not measured."""
        paired = self.ratios(num, den)
        if paired:
            return statistics.median(paired)
        num_median, den_median = getattr(self, f"{num}_mib_s"), getattr(self, f"{den}_mib_s")
        return num_median / den_median if num_median and den_median else None

    def to_json(self) -> dict:
        return asdict(self) | {key: self.ratio(num, den) for key, _, num, den in RATIOS}


def _ratio_property(num: str, den: str, label: str) -> property:
    prop = property(lambda row: row.ratio(num, den))
    prop.__doc__ = f"{label}: :meth:`Row.ratio` of ``{num}`` over ``{den}``."
    return prop


# Row.ratio_fio, .ratio_crc_fio, ... one per RATIOS entry (the JSON key), so the table is the only list.
for _key, _label, _num, _den in RATIOS:
    setattr(Row, _key, _ratio_property(_num, _den, _label))
del _key, _label, _num, _den


def engine_buffers(case: Case) -> list[torch.Tensor]:
    """One 4 KiB-aligned buffer of one block per request in flight, at most one per distinct block
    of the region (they are reused round robin), filled with random bytes."""
    op = nvme_io.load()
    bufs = [op.aligned_empty(case.block_bytes) for _ in range(case.n_buffers)]
    for b in bufs:
        b.random_(0, 256)
    return bufs


def engine_mib_s(
    target: str,
    case: Case,
    *,
    enable_crc: bool = False,
    backend: str = "auto",
    bufs: list[torch.Tensor] | None = None,
) -> float:
    """Bandwidth of the engine: one job per block at ``case.offsets()``, ``queue_depth`` in flight,
    from the buffers (default: :func:`engine_buffers`) reused round robin (as fio does)."""
    op = nvme_io.load()
    bufs = bufs or engine_buffers(case)
    e = op.Engine(target, queue_depth=case.queue_depth, request_bytes=case.block_bytes, backend=backend)
    try:
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


def fio_command(target: str, case: Case) -> list[str]:
    """``fio --ioengine=io_uring --direct=1`` with the case's offsets, block and depth (``size``:
    the span, ``io_size``: the bytes moved; fio wraps around the span as the engine does)."""
    rw = case.op if case.pattern == "seq" else f"{case.op}:{case.block_bytes}"
    return [
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


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's waited-for children so far (all their threads)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _run_fio(cmd: list[str]) -> tuple[dict, float]:
    """Run fio; its JSON job and the CPU seconds of the whole fio process (every thread, io_uring's
    io-wq workers included; fio's own ``usr_cpu``/``sys_cpu`` count only the job thread)."""
    cpu0 = _children_cpu_s()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    cpu_s = _children_cpu_s() - cpu0
    return json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0], cpu_s


def fio_result(target: str, case: Case) -> tuple[float, float]:
    """fio at the case's offsets, block size and queue depth: (MiB/s, CPU seconds of the transfer).

    The CPU seconds are those of the fio process minus those of the same command moving a single
    block (fio's start-up and exit, which the in-process tools do not pay per measurement).
    """
    cmd = fio_command(target, case)
    job, cpu_s = _run_fio(cmd)
    io = job[case.op]
    if io["io_bytes"] != case.total_bytes:
        raise RuntimeError(f"fio moved {io['io_bytes']} bytes, expected {case.total_bytes}")
    one_block = [a for a in cmd if not a.startswith("--io_size=")] + [f"--io_size={case.block_bytes}"]
    _, startup_s = _run_fio(one_block)
    return io["bw_bytes"] / MiB, max(0.0, cpu_s - startup_s)


def fio_mib_s(target: str, case: Case) -> float:
    """Bandwidth of fio at the case's offsets, block size and queue depth."""
    return fio_result(target, case)[0]


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _ds_file(folder: Path, i: int) -> str:
    return str(folder / f"{i}.tensor.swp")


def deepspeed_buffers(case: Case, handle) -> list[torch.Tensor]:
    """``case.n_buffers`` page-locked buffers of one block from DeepSpeed's handle, random bytes;
    release with :func:`free_deepspeed_buffers`."""
    bufs = [
        handle.new_cpu_locked_tensor(case.block_bytes, torch.empty(0, dtype=torch.uint8))
        for _ in range(case.n_buffers)
    ]
    for b in bufs:
        b.random_(0, 256)
    return bufs


def free_deepspeed_buffers(handle, bufs: list[torch.Tensor]) -> None:
    for b in bufs:
        handle.free_cpu_locked_tensor(b)
    bufs.clear()


def deepspeed_mib_s(folder: Path, case: Case, handle, bufs: list[torch.Tensor] | None = None) -> float:
    """Bandwidth of DeepSpeed's aio handle writing/reading ``total/block`` tensors of ``block``
    bytes, one file each (``{folder}/{i}.tensor.swp``, as the stock swappers name them; the
    ``region/block`` files are reused round robin when the total wraps)."""
    n = case.n_requests
    own = bufs is None
    bufs = deepspeed_buffers(case, handle) if own else bufs
    try:
        call = handle.async_pwrite if case.op == "write" else handle.async_pread
        t0 = time.perf_counter()
        for i in range(n):
            call(bufs[i % len(bufs)], _ds_file(folder, i % case.n_blocks), 0)
        done = handle.wait()
        dt = time.perf_counter() - t0
        if done != n:
            raise OSError(f"deepspeed aio completed {done} of {n} requests")
    finally:
        if own:
            free_deepspeed_buffers(handle, bufs)
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
        buf.random_(0, 256)
        for j in [
            e.submit_write(buf, off, min(8 * MiB, span_bytes - off)) for off in range(0, span_bytes, 8 * MiB)
        ]:
            e.wait(j)
    finally:
        e.close()


def engine_ring(target: str, backend: str) -> str:
    """How the engine drives ``target`` with ``backend``: ``"io_uring, single issuer"`` (the worker
    thread is the ring's only submitter, SINGLE_ISSUER | DEFER_TASKRUN), ``"io_uring"`` (a kernel
    before 6.1) or ``"libaio"``; recorded in the JSON's meta."""
    e = nvme_io.load().Engine(target, queue_depth=1, backend=backend)
    try:
        return e.backend + (", single issuer" if e.single_issuer else "")
    finally:
        e.close()


def engine_tools(crc: str) -> list[str]:
    """The engine columns measured for ``--crc`` ``off``, ``on`` or ``both``."""
    if crc not in ("off", "on", "both"):
        raise ValueError(f"crc must be off, on or both, got {crc!r}")
    return {"off": ["engine"], "on": ["engine_crc"], "both": ["engine", "engine_crc"]}[crc]


def run(
    target: str,
    *,
    total_bytes: int,
    block_sizes: list[int],
    queue_depths: list[int],
    patterns: list[str],
    deepspeed_folder: Path | None,
    repeats: int = 5,
    region_bytes: int = 0,
    crc: str = "off",
    backend: str = "auto",
    log=None,
) -> list[Row]:
    """Measure every case on ``target`` (a file is created and preallocated when missing),
    ``repeats`` times, the tools interleaved; medians per tool.

    Raises:
        ValueError: sizes that do not fit the target or each other.
        subprocess.CalledProcessError: fio failed.
    """
    data = region_bytes or total_bytes
    for bs in block_sizes:
        if total_bytes % bs or data % bs:
            raise ValueError(
                f"total ({total_bytes}) and region ({data}) must be multiples of the block ({bs})"
            )
    if region_bytes and region_bytes > total_bytes:
        raise ValueError(f"region ({region_bytes}) exceeds the total moved ({total_bytes})")
    span = data * (2 if "strided" in patterns else 1)
    if not os.path.exists(target) or not probe_info(target).is_block_device:
        preallocate_file(target, span + MiB)  # creates, or grows a smaller file
    size = probe_info(target).size_bytes
    if size < span:
        raise ValueError(f"target {target} holds {size} bytes, the patterns need {span}")
    warm_up(target, span)
    tools = engine_tools(crc)
    have_fio = shutil.which("fio") is not None
    if have_fio:
        tools.append("fio")
    fs_store = None
    if deepspeed_folder is not None and "seq" in patterns:
        deepspeed_folder.mkdir(parents=True, exist_ok=True)
        fs_store = str(deepspeed_folder / FS_STORE_NAME)
        preallocate_file(fs_store, data + MiB)
        warm_up(fs_store, data)
    rows = []
    for pattern in patterns:
        for bs in block_sizes:
            for qd in queue_depths:
                case_tools = list(tools)
                handle = None
                if deepspeed_folder is not None and pattern == "seq":
                    handle = load_deepspeed_handle(bs, qd)
                if fs_store is not None and pattern == "seq":
                    case_tools += ["engine_fs"] + (["fio_fs"] if have_fio else [])
                cases = {
                    op: Case(
                        pattern=pattern,
                        op=op,
                        block_bytes=bs,
                        queue_depth=qd,
                        total_bytes=total_bytes,
                        region_bytes=region_bytes,
                    )
                    for op in ("write", "read")
                }
                # One set of buffers per tool and case, filled once (untimed), as fio fills its own.
                eng_bufs = engine_buffers(cases["write"])
                ds_bufs: list[torch.Tensor] = []
                try:
                    if handle is not None:
                        case_tools.append("deepspeed")
                        deepspeed_folder.mkdir(parents=True, exist_ok=True)
                        ds_bufs = deepspeed_buffers(cases["write"], handle)
                        # The files exist (written once, untimed) before anything is measured, as
                        # the engine's region does: reads find data, writes rewrite allocated blocks.
                        deepspeed_mib_s(
                            deepspeed_folder,
                            Case(
                                pattern=pattern, op="write", block_bytes=bs, queue_depth=qd, total_bytes=data
                            ),
                            handle,
                            ds_bufs,
                        )
                    samples: dict[tuple[str, str], list[float]] = {}
                    cpu: dict[tuple[str, str], list[float]] = {}
                    for rep in range(repeats):
                        k = rep % len(case_tools)
                        order = case_tools[k:] + case_tools[:k]
                        for op, case in cases.items():
                            for tool in order:
                                cpu0 = _cpu_s()
                                fio_cpu_s = None
                                if tool in ("engine", "engine_crc", "engine_fs"):
                                    v = engine_mib_s(
                                        fs_store if tool == "engine_fs" else target,
                                        case,
                                        enable_crc=tool == "engine_crc" or (tool == "engine_fs" and crc == "on"),
                                        backend=backend,
                                        bufs=eng_bufs,
                                    )
                                elif tool in ("fio", "fio_fs"):
                                    v, fio_cpu_s = fio_result(fs_store if tool == "fio_fs" else target, case)
                                else:
                                    v = deepspeed_mib_s(deepspeed_folder, case, handle, ds_bufs)
                                used_s = fio_cpu_s if fio_cpu_s is not None else _cpu_s() - cpu0
                                samples.setdefault((tool, op), []).append(v)
                                cpu.setdefault((tool, op), []).append(used_s * 1000 / (case.total_bytes / (1 << 30)))
                finally:
                    eng_bufs.clear()
                    if handle is not None:
                        free_deepspeed_buffers(handle, ds_bufs)
                for op in ("write", "read"):
                    per_tool = {t: samples[(t, op)] for t in case_tools}
                    row = Row(
                        pattern=pattern,
                        op=op,
                        block_bytes=bs,
                        queue_depth=qd,
                        total_bytes=total_bytes,
                        region_bytes=region_bytes,
                        engine_mib_s=_median(per_tool.get("engine", [])),
                        engine_crc_mib_s=_median(per_tool.get("engine_crc", [])),
                        fio_mib_s=_median(per_tool.get("fio", [])),
                        deepspeed_mib_s=_median(per_tool.get("deepspeed", [])),
                        engine_fs_mib_s=_median(per_tool.get("engine_fs", [])),
                        fio_fs_mib_s=_median(per_tool.get("fio_fs", [])),
                        samples=per_tool,
                        cpu_ms_per_gib={t: statistics.median(cpu[(t, op)]) for t in case_tools},
                    )
                    rows.append(row)
                    if log is not None:
                        log(format_table([row], header=False))
                if deepspeed_folder is not None:
                    for f in deepspeed_folder.glob("*.tensor.swp"):
                        f.unlink()
    if fs_store is not None:
        os.unlink(fs_store)
    return rows


HEADER = (
    "| pattern | op | block KiB | qd | engine MiB/s | engine+CRC MiB/s | fio MiB/s | DeepSpeed MiB/s "
    "| engine/fio | engine+CRC/fio | engine/DeepSpeed | engine+CRC/DeepSpeed "
    "| engine (FS file) MiB/s | fio (FS file) MiB/s | FS: engine/fio | FS: engine/DeepSpeed |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_table(rows: list[Row], *, header: bool = True) -> str:
    """Markdown table of the rows: medians, and each ratio as the median [first-third quartile] of
    the repeat-by-repeat ratios."""

    def bw(x):
        return "-" if x is None else f"{x:.0f}"

    def ratio(r: Row, num: str, den: str) -> str:
        median = r.ratio(num, den)
        if median is None:
            return "-"
        paired = r.ratios(num, den)
        if len(paired) < 4:
            return f"{median:.2f}"
        q1, _, q3 = statistics.quantiles(paired, n=4, method="inclusive")
        return f"{median:.2f} [{q1:.2f}-{q3:.2f}]"

    lines = [HEADER] if header else []
    for r in rows:
        lines.append(
            f"| {r.pattern} | {r.op} | {r.block_bytes >> 10} | {r.queue_depth} | {bw(r.engine_mib_s)} | "
            f"{bw(r.engine_crc_mib_s)} | {bw(r.fio_mib_s)} | {bw(r.deepspeed_mib_s)} | "
            f"{ratio(r, 'engine', 'fio')} | {ratio(r, 'engine_crc', 'fio')} | "
            f"{ratio(r, 'engine', 'deepspeed')} | {ratio(r, 'engine_crc', 'deepspeed')} | "
            f"{bw(r.engine_fs_mib_s)} | {bw(r.fio_fs_mib_s)} | "
            f"{ratio(r, 'engine_fs', 'fio_fs')} | {ratio(r, 'engine_fs', 'deepspeed')} |"
        )
    return "\n".join(lines)


def crc32c_gib_s(total_bytes: int = 64 * MiB, chunk_bytes: int = 1 * MiB, repeats: int = 3) -> float:
    """One thread's CRC32C throughput (GiB/s, best of ``repeats``) over ``total_bytes`` of random
    data in ``chunk_bytes`` pieces: the engine's checksum cost per byte."""
    op = nvme_io.load()
    buf = op.aligned_empty(total_bytes)
    buf.random_(0, 256)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for off in range(0, total_bytes, chunk_bytes):
            op.crc32c(buf[off : off + chunk_bytes])
        best = max(best, total_bytes / (1 << 30) / (time.perf_counter() - t0))
    return best


def fio_version() -> str | None:
    if shutil.which("fio") is None:
        return None
    return subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip() or None


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summary(rows: list[Row]) -> str:
    """Worst and geometric-mean ratios of the table (the targets: >= 0.95 and >= 1)."""
    parts = []
    for _, name, num, den in RATIOS:
        xs = [x for x in (r.ratio(num, den) for r in rows) if x]
        if xs:
            parts.append(f"{name}: min {min(xs):.2f}, geomean {_geomean(xs):.2f}")
    return "; ".join(parts)


def cpu_summary(rows: list[Row]) -> str:
    """Median over the rows of each tool's CPU milliseconds per GiB moved."""
    per_tool: dict[str, list[float]] = {}
    for r in rows:
        for tool, ms in r.cpu_ms_per_gib.items():
            per_tool.setdefault(tool, []).append(ms)
    if not per_tool:
        return ""
    parts = [f"{t} {statistics.median(v):.0f}" for t, v in sorted(per_tool.items(), key=lambda kv: TOOLS.index(kv[0]))]
    return "CPU ms per GiB moved (median over rows; the device's own service time excluded): " + ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--target", help="block device or file (created when missing); default: a file in --workdir"
    )
    p.add_argument(
        "--ram-loop-mib",
        type=int,
        default=None,
        help="run on a loop device over a file of this many MiB in a private tmpfs (root): raw "
        "partition for engine and fio, ext4 for DeepSpeed; removed afterwards",
    )
    p.add_argument(
        "--loop-direct-io", action="store_true", help="with --ram-loop-mib: losetup --direct-io=on"
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="folder for the default target and DeepSpeed's files (default: a temp dir)",
    )
    p.add_argument(
        "--total-mib",
        type=int,
        default=64,
        help="MiB moved per measurement (default 64, a smoke run; use a few GiB to compare tools)",
    )
    p.add_argument(
        "--region-mib",
        type=int,
        default=0,
        help="MiB of data the requests cycle over (default: --total-mib; strided spans twice that)",
    )
    p.add_argument(
        "--block-kib", default="1024,16384", help="request sizes in KiB, comma-separated (default 1024,16384)"
    )
    p.add_argument("--queue-depth", default="8,32", help="queue depths, comma-separated (default 8,32)")
    p.add_argument("--patterns", default="seq,strided", help="seq and/or strided (default both)")
    p.add_argument(
        "--deepspeed-folder",
        default=None,
        help="folder for DeepSpeed's per-tensor files (default: WORKDIR/ds_swap, or the RAM loop's "
        "ext4; 'none' skips)",
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="interleaved runs per measurement, median kept (default 5)"
    )
    p.add_argument(
        "--crc",
        nargs="?",
        const="on",
        default="off",
        choices=("off", "on", "both"),
        help="engine CRC32C per request: off (--no-crc, default), on (the store's default; bare --crc), or both",
    )
    p.add_argument(
        "--backend", default="auto", help="engine backend: auto, io_uring or libaio (default auto)"
    )
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    a = p.parse_args(argv)
    if a.ram_loop_mib is not None and a.target:
        p.error("--target and --ram-loop-mib exclude each other")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    kwargs = dict(
        total_bytes=a.total_mib * MiB,
        region_bytes=a.region_mib * MiB,
        block_sizes=[int(x) << 10 for x in a.block_kib.split(",")],
        queue_depths=[int(x) for x in a.queue_depth.split(",")],
        patterns=a.patterns.split(","),
        repeats=a.repeats,
        crc=a.crc,
        backend=a.backend,
        log=log,
    )
    data_mib = a.region_mib or a.total_mib
    span_mib = data_mib * (2 if "strided" in kwargs["patterns"] else 1)
    try:
        with contextlib.ExitStack() as stack:
            if a.ram_loop_mib is not None:
                from benchmarks import ram_loop

                stack.enter_context(ram_loop.terminate_as_exit())
                raw_mib = span_mib + 1
                # ext4 holds DeepSpeed's files and the engine_fs/fio_fs store file, one region each.
                fs_data_mib = 2 * data_mib + 1 if a.deepspeed_folder != "none" else 0
                need = ram_loop.size_mib_needed(raw_mib, fs_data_mib)
                if a.ram_loop_mib < need:
                    raise UserError(
                        f"--ram-loop-mib {a.ram_loop_mib} is too small: the patterns need {need} MiB"
                    )
                disk = stack.enter_context(
                    ram_loop.ram_loop_device(a.ram_loop_mib, raw_mib, direct_io=a.loop_direct_io)
                )
                target = str(disk.raw_partition)
                ds = (
                    None
                    if a.deepspeed_folder == "none"
                    else Path(a.deepspeed_folder or disk.fs_mount / "ds_swap")
                )
                device = disk.describe()
            else:
                work = Path(a.workdir or tempfile.mkdtemp(prefix="memascend_io_bench_", dir="/var/tmp"))
                work.mkdir(parents=True, exist_ok=True)
                if not a.target and not a.workdir:
                    stack.callback(shutil.rmtree, work, ignore_errors=True)
                target = a.target or str(work / "engine_target.bin")
                ds = None if a.deepspeed_folder == "none" else Path(a.deepspeed_folder or work / "ds_swap")
                device = f"target {target}, DeepSpeed folder {ds}"
            log(f"io_bench: {device}")
            rows = run(target, deepspeed_folder=ds, **kwargs)
            ring = engine_ring(target, a.backend)
    except UserError as exc:
        print(f"io_bench: error: {exc}", file=sys.stderr)
        return UserError.exit_code
    crc_gib_s = crc32c_gib_s() if a.crc != "off" else None
    meta = {
        "device": device,
        "crc32c_gib_s": crc_gib_s,
        "crc32c_hardware": bool(nvme_io.load().crc32c_hardware()),
        "kernel": platform.release(),
        "fio": fio_version(),
        "repeats": a.repeats,
        "total_mib": a.total_mib,
        "region_mib": data_mib,
        "crc": a.crc,
        "backend": a.backend,
        "engine_ring": ring,
        "command": "python -m benchmarks.io_bench "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(
        f"{device}; {a.total_mib} MiB per measurement over {data_mib} MiB, median of {a.repeats} interleaved repeats"
    )
    print(format_table(rows))
    print(summary(rows))
    if cpu_summary(rows):
        print(cpu_summary(rows))
    if crc_gib_s is not None:
        print(f"CRC32C on one thread: {crc_gib_s:.1f} GiB/s (1 MiB pieces of 64 MiB)")
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "rows": [r.to_json() for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
