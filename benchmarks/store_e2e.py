"""End-to-end fine-tune through the raw store against the folder of swap files, same device.

The end-to-end target: the SmolLM2-135M NVMe fine-tune (``cpu-full``'s
``smollm2-shakespeare-bf16-256x4``: bf16, micro-batch 4 x 256, parameters and optimizer state
offloaded) with ``--nvme-path`` on a raw partition (memascend's store: O_DIRECT extents with
CRC32C, :mod:`memascend.integrations.deepspeed.raw_store`) must take at most the step time of the
same run with ``--nvme-path`` on a folder of a filesystem of the same device (stock
ZeRO-Infinity's one file per tensor), with identical per-step losses.

Both run on one RAM-backed loop device (:mod:`benchmarks.ram_loop`: a raw partition and an
ext4 one), in alternating order (folder first, then store first, ...), and the medians of each
run's median step time are compared. Needs root, ``losetup``, ``mkfs.ext4`` and ``parted``.

``python3 -m benchmarks.store_e2e --output DIR [--repeats N] [--engine memascend|baseline]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from memascend.errors import UserError

CONFIG_NAME = "smollm2-shakespeare-bf16-256x4"
#: MiB of the raw partition and of the swap files on ext4: the run swaps 2.40 GB (2,287 MiB,
#: ``swap_folder_bytes`` of its reports), with room for the store's alignment and header.
RAW_MIB = 3072
FS_DATA_MIB = 2900


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Store against folder over the repeats of one engine.

    Attributes:
        folder_step_s: each folder run's median step time (s).
        store_step_s: each store run's median step time (s), same order.
        losses_equal: every run's per-step losses equal the first folder run's, bit for bit.
        folder_peak_rss_bytes: median of the folder runs' peak RSS.
        store_peak_rss_bytes: median of the store runs' peak RSS.
    """

    folder_step_s: list[float]
    store_step_s: list[float]
    losses_equal: bool
    folder_peak_rss_bytes: int
    store_peak_rss_bytes: int

    @property
    def step_time_ratio(self) -> float:
        """Median store step time / median folder step time."""
        return statistics.median(self.store_step_s) / statistics.median(self.folder_step_s)

    @property
    def ok(self) -> bool:
        """The end-to-end target: step time at most the folder's, identical losses."""
        return self.losses_equal and self.step_time_ratio <= 1.0

    def to_dict(self) -> dict:
        return {"folder_step_s": self.folder_step_s, "store_step_s": self.store_step_s,
                "step_time_ratio": self.step_time_ratio, "losses_equal": self.losses_equal,
                "folder_peak_rss_bytes": self.folder_peak_rss_bytes,
                "store_peak_rss_bytes": self.store_peak_rss_bytes, "ok": self.ok}


def compare(folder_reports: list[dict], store_reports: list[dict]) -> Comparison:
    """Compare ``report.json`` documents of folder runs and store runs.

    Raises:
        UserError: no reports, or different numbers of folder and store runs.
    """
    if not folder_reports or len(folder_reports) != len(store_reports):
        raise UserError(f"need as many store runs as folder runs (got {len(folder_reports)} and "
                        f"{len(store_reports)})")
    reference = [s["loss"] for s in folder_reports[0]["steps"]]
    losses_equal = all([s["loss"] for s in r["steps"]] == reference for r in folder_reports + store_reports)
    return Comparison(
        folder_step_s=[float(r["median_step_s"]) for r in folder_reports],
        store_step_s=[float(r["median_step_s"]) for r in store_reports],
        losses_equal=losses_equal,
        folder_peak_rss_bytes=int(statistics.median(r["memory"]["peak_rss_bytes"] for r in folder_reports)),
        store_peak_rss_bytes=int(statistics.median(r["memory"]["peak_rss_bytes"] for r in store_reports)),
    )


def run(output: Path, *, repeats: int, engine: str, timeout_s: float) -> Comparison:
    """Run the comparison on a RAM loop device; runs land under ``output/<config>/``.

    Raises:
        UserError: no root or tools for the loop device, a run that failed.
    """
    from benchmarks import ram_loop
    from memascend.regress.matrix import get_matrix
    from memascend.regress.runner import run_one

    cfg = next(c for c in get_matrix("cpu-full").configs if c.name == CONFIG_NAME)
    size_mib = ram_loop.size_mib_needed(RAW_MIB, FS_DATA_MIB)
    folders, stores = [], []
    with ram_loop.terminate_as_exit(), ram_loop.ram_loop_device(size_mib, RAW_MIB) as dev:
        print(f"store_e2e: {dev.describe()}", file=sys.stderr)
        for r in range(repeats):
            order = ("folder", "store") if r % 2 == 0 else ("store", "folder")
            for kind in order:
                target = dev.fs_mount if kind == "folder" else dev.raw_partition
                print(f"store_e2e: {engine} on the {kind} (repeat {r + 1}/{repeats}) ...", file=sys.stderr, flush=True)
                outcome = run_one(cfg, engine, output, Path(target), timeout_s, tag=f"-{kind}-r{r + 1}")
                (folders if kind == "folder" else stores).append(outcome.required_report())
    return compare(folders, stores)


def main(argv: list[str] | None = None) -> int:
    """Command line; exit 0 when the target is met, 1 when not, 2 on bad input."""
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.store_e2e", description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, type=Path, help="folder for the runs and results.json")
    p.add_argument("--repeats", type=int, default=2, help="runs of each (alternating order; default 2)")
    p.add_argument("--engine", choices=("memascend", "baseline"), default="memascend")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run (default 1800)")
    a = p.parse_args(argv)
    try:
        if a.repeats < 1:
            raise UserError(f"--repeats must be at least 1, got {a.repeats}")
        a.output.mkdir(parents=True, exist_ok=True)
        result = run(a.output, repeats=a.repeats, engine=a.engine, timeout_s=a.timeout_s)
    except UserError as exc:
        print(f"memascend store_e2e: error: {exc}", file=sys.stderr)
        return 2
    doc = {"config": CONFIG_NAME, "engine": a.engine, "repeats": a.repeats, **result.to_dict()}
    (a.output / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    gib = 2**30
    print(f"{CONFIG_NAME} ({a.engine}), {a.repeats} runs each: median step store "
          f"{statistics.median(result.store_step_s):.2f} s / folder {statistics.median(result.folder_step_s):.2f} s "
          f"= {result.step_time_ratio:.3f} (target <= 1.0); runs store {result.store_step_s}, folder "
          f"{result.folder_step_s}; losses {'equal' if result.losses_equal else 'DIFFER'}; peak RSS store "
          f"{result.store_peak_rss_bytes / gib:.2f} / folder {result.folder_peak_rss_bytes / gib:.2f} GiB; "
          f"{'PASS' if result.ok else 'FAIL'}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
