"""The renderers of the ``speed`` matrix's generated blocks (:mod:`tools.readme`): the committed
``baselines/<profile>/speed/results.json`` and ``speed/<rows>/results.json`` (rows run on their own),
memascend against stock ZeRO-Infinity in the same run at the default host-memory budget and with a
budget spent as a DRAM cache, and ``speed/compute-floor.json`` (``python3 -m benchmarks.compute_floor``:
stock with everything in DRAM against stock with NVMe offload: what host memory buys stock itself). Times
are seconds per step (medians of alternating pairs), ratios memascend / stock."""

from __future__ import annotations

import statistics

from memascend.regress.output import _md
from tools.readme_blocks import Baselines, gib

RESULTS = "speed/results.json"
"""The matrix's first run; rows run on their own lie in ``speed/<folder>/results.json``."""
FLOOR = "speed/compute-floor.json"
HEADERS = ["row", "memascend budget", "step s (stock / memascend)", "time ratio", "forward / backward / step ratio",
           "peak RSS GiB (ratio)", "swap MiB per step (ratio)", "losses"]


def _budget(r) -> str:
    return str(dict(r.config.memascend_settings).get("host_memory_budget", "default (lean)"))


def _phase_ratios(r) -> str:
    b, m = r.baseline.median_phase_s, r.memascend.median_phase_s
    return " / ".join(f"{m[p] / b[p]:.2f}" if b[p] else "-" for p in ("forward_s", "backward_s", "optimizer_step_s"))


def _results(b: Baselines) -> list:
    """Every committed speed result: :data:`RESULTS`, then ``speed/*/results.json`` by folder name; a
    row measured again in a later folder replaces the earlier one in place."""
    folders = sorted(p.parent.name for p in (b.root / "speed").glob("*/results.json"))  # "r2" before "r2-overlap"
    extra = [f"speed/{folder}/results.json" for folder in folders]
    rows: dict[str, object] = {}
    for rel in (RESULTS, *extra):
        for r in b.results(rel):
            rows[r.config.name] = r
    return list(rows.values())


def speed_table(b: Baselines) -> str:
    """One row per configuration: step times and ratio, phase ratios, peak RSS, swap bytes, losses."""
    rows = []
    for r in _results(b):
        base, mine = r.baseline, r.memascend
        bb, mb = base.swap_bytes_per_step, mine.swap_bytes_per_step
        rows.append([r.config.name, _budget(r), f"{base.median_step_s:.2f} / {mine.median_step_s:.2f}",
                     f"{mine.median_step_s / base.median_step_s:.3f}", _phase_ratios(r),
                     f"{gib(base.peak_rss_bytes)} / {gib(mine.peak_rss_bytes)} "
                     f"({mine.peak_rss_bytes / base.peak_rss_bytes:.2f})",
                     f"{bb / 2**20:,.0f} / {mb / 2**20:,.0f} ({mb / bb:.2f})" if bb else "-",
                     "bit-identical" if r.check("losses").ok else "differ"])
    return _md(HEADERS, rows)


def speed_notes(b: Baselines) -> str:
    """The targets each row was held to and whether it met them, and what bounds the budget row."""
    lines = []
    for r in _results(b):
        failed = [c for c in r.checks if not c.ok and not c.name.startswith("golden.")]
        passed = [c for c in r.checks if c.ok and c.limit is not None and c.measured is not None]
        status = "; ".join(f"{c.name} {c.measured:.3f} over its limit {c.limit:.2f}" for c in failed) or "every check met"
        met = ", ".join(f"{c.name} {c.measured:.3f} (limit {c.limit:.2f})" for c in passed)
        lines.append(f"- {r.config.name}: {status}" + (f"; met: {met}" if met else "") + ".")
        mine, base = r.memascend.median_phase_s, r.baseline
        compute = mine["forward_s"] + mine["backward_s"]
        if r.memascend.swap_bytes_per_step == 0:
            lines.append(f"  With no swap bytes left its step is forward and backward compute ({compute:.2f} s, "
                         f"{compute / base.median_step_s:.2f}x stock's whole step) plus an optimizer step of "
                         f"{mine['optimizer_step_s']:.2f} s ({mine['optimizer_step_s'] / base.median_phase_s['optimizer_step_s']:.2f}x "
                         "stock's): with no NVMe traffic left, the computation is what remains of the step.")
    return "\n".join(lines)


def floor_note(b: Baselines) -> str:
    """The compute floor of the default job on this host, from :data:`FLOOR`."""
    f = b.json(FLOOR)
    dram, nvme = f["dram_phase_s"], f["nvme_phase_s"]
    return (f"Stock DeepSpeed with everything in DRAM (`--offload-param cpu --offload-optimizer cpu`: every "
            f"parameter, gradient and optimizer state in host memory, the same CPU Adam, no swap) against "
            f"stock with NVMe offload on `{f['config']}`, {f['repeats']} alternating "
            f"runs each (`python3 -m benchmarks.compute_floor`): {statistics.median(f['dram_step_s']):.2f} / "
            f"{statistics.median(f['nvme_step_s']):.2f} s per step = {f['floor_ratio']:.3f}, what host memory buys "
            f"stock itself on this host, the fastest stock runs this job here (forward "
            f"{dram['forward_s']:.2f} / {nvme['forward_s']:.2f} s, backward {dram['backward_s']:.2f} / "
            f"{nvme['backward_s']:.2f} s, optimizer step {dram['optimizer_step_s']:.2f} / "
            f"{nvme['optimizer_step_s']:.2f} s; losses {'bit-identical' if f['losses_equal'] else 'differ'}).")
