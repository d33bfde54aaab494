"""Stock's compute floor on a speed row: stock ZeRO-3 with everything in DRAM against stock ZeRO-Infinity.

The fastest stock DeepSpeed runs a job is with nothing on NVMe: every parameter, gradient and
optimizer state in host memory, no swap in/out. This benchmark measures that on this host for a row
of the ``speed`` matrix (:mod:`memascend.regress.matrix`): stock DeepSpeed (``--engine baseline``) on
the row's own configuration (parameters and optimizer on NVMe) and on the same configuration with
``--offload-param cpu --offload-optimizer cpu`` (ZeRO-Offload to host memory: the same
``DeepSpeedCPUAdam``, so the same losses; without offload DeepSpeed steps with another Adam whose
losses differ from the third step), in alternating order, ``--repeats`` runs each.

The ratio it prints, median step time in DRAM / median step time with NVMe offload, is what host
memory buys stock itself: the step-time ratio a budget row of the ``speed`` matrix
(memascend spending host memory as a DRAM cache) is set against. memascend's own forward, backward
and step can run faster than stock's in DRAM, so the ratio bounds stock, not memascend.

``python3 -m benchmarks.compute_floor --output DIR [--config smollm2-bf16-256x4-speed] [--repeats N]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from memascend.errors import UserError

PHASES = ("forward_s", "backward_s", "optimizer_step_s")
"""``report.json`` ``median_phase_s`` keys, in step order."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Floor:
    """Stock with everything in DRAM against stock with NVMe offload, over the repeats of one configuration.

    Attributes:
        nvme_step_s: each NVMe-offload run's median step time (s).
        dram_step_s: each DRAM (CPU offload) run's median step time (s), same order.
        nvme_phase_s: median over the NVMe runs of each phase's median time (s), keys :data:`PHASES`.
        dram_phase_s: the same for the DRAM runs.
        losses_equal: every run's per-step losses equal the first NVMe run's, bit for bit.
    """

    nvme_step_s: list[float]
    dram_step_s: list[float]
    nvme_phase_s: dict[str, float]
    dram_phase_s: dict[str, float]
    losses_equal: bool

    @property
    def floor_ratio(self) -> float:
        """Median DRAM step time / median NVMe step time: what keeping the whole state in host memory
        buys stock DeepSpeed itself on this host."""
        return statistics.median(self.dram_step_s) / statistics.median(self.nvme_step_s)

    def to_dict(self) -> dict:
        return {"nvme_step_s": self.nvme_step_s, "dram_step_s": self.dram_step_s,
                "nvme_phase_s": self.nvme_phase_s, "dram_phase_s": self.dram_phase_s,
                "floor_ratio": self.floor_ratio, "losses_equal": self.losses_equal}


def _phase_medians(reports: list[dict]) -> dict[str, float]:
    return {k: statistics.median(float(r["median_phase_s"][k]) for r in reports) for k in PHASES}


def compare(nvme_reports: list[dict], dram_reports: list[dict]) -> Floor:
    """The floor from ``report.json`` documents of NVMe-offload runs and DRAM runs.

    Raises:
        UserError: no reports, or different numbers of each.
    """
    if not nvme_reports or len(nvme_reports) != len(dram_reports):
        raise UserError(f"need as many DRAM runs as NVMe runs (got {len(dram_reports)} and {len(nvme_reports)})")
    reference = [s["loss"] for s in nvme_reports[0]["steps"]]
    return Floor(
        nvme_step_s=[float(r["median_step_s"]) for r in nvme_reports],
        dram_step_s=[float(r["median_step_s"]) for r in dram_reports],
        nvme_phase_s=_phase_medians(nvme_reports),
        dram_phase_s=_phase_medians(dram_reports),
        losses_equal=all([s["loss"] for s in r["steps"]] == reference for r in nvme_reports + dram_reports),
    )


def run(output: Path, nvme_path: Path, *, config: str, repeats: int, timeout_s: float) -> Floor:
    """Run the pairs; runs land under ``output/<config>/baseline-{nvme,dram}-r<k>``.

    Raises:
        UserError: ``config`` is not a row of the ``speed`` matrix, or a run failed.
    """
    from memascend.regress.matrix import get_matrix
    from memascend.regress.runner import run_one

    rows = {c.name: c for c in get_matrix("speed").configs}
    if config not in rows:
        raise UserError(f"--config {config!r} is not a row of the speed matrix ({', '.join(rows)})")
    cfg = rows[config]
    dram = dataclasses.replace(cfg, offload_param="cpu", offload_optimizer="cpu")
    runs: dict[str, list[dict]] = {"nvme": [], "dram": []}
    for r in range(repeats):
        for kind in (("nvme", "dram") if r % 2 == 0 else ("dram", "nvme")):
            print(f"compute_floor: {cfg.name} stock, {kind} (repeat {r + 1}/{repeats}) ...", file=sys.stderr, flush=True)
            outcome = run_one(cfg if kind == "nvme" else dram, "baseline", output, nvme_path, timeout_s,
                              tag=f"-{kind}-r{r + 1}")
            runs[kind].append(outcome.required_report())
    return compare(runs["nvme"], runs["dram"])


def main(argv: list[str] | None = None) -> int:
    """Command line; exit 0 after printing the floor, 2 on bad input or a failed run."""
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.compute_floor", description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True, type=Path, help="folder for the runs and results.json")
    p.add_argument("--nvme-path", type=Path, default=None, help="swap folder (default: <output>/swap)")
    p.add_argument("--config", default="smollm2-bf16-256x4-speed", help="a row of the speed matrix")
    p.add_argument("--repeats", type=int, default=2, help="runs of each (alternating order; default 2)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per run (default 3600)")
    a = p.parse_args(argv)
    try:
        if a.repeats < 1:
            raise UserError(f"--repeats must be at least 1, got {a.repeats}")
        a.output.mkdir(parents=True, exist_ok=True)
        nvme_path = a.nvme_path or a.output / "swap"
        nvme_path.mkdir(parents=True, exist_ok=True)
        floor = run(a.output, nvme_path, config=a.config, repeats=a.repeats, timeout_s=a.timeout_s)
    except UserError as exc:
        print(f"memascend compute_floor: error: {exc}", file=sys.stderr)
        return 2
    doc = {"config": a.config, "repeats": a.repeats, **floor.to_dict()}
    (a.output / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    phases = " ".join(f"{k.removesuffix('_s')} {floor.dram_phase_s[k]:.2f}/{floor.nvme_phase_s[k]:.2f}" for k in PHASES)
    print(f"{a.config}: stock with everything in DRAM {statistics.median(floor.dram_step_s):.2f} s / with NVMe offload "
          f"{statistics.median(floor.nvme_step_s):.2f} s per step = {floor.floor_ratio:.3f} (what host memory buys "
          f"stock itself here); per phase DRAM/NVMe s: {phases}; losses "
          f"{'equal' if floor.losses_equal else 'DIFFER'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
