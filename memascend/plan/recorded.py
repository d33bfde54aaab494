"""The planner against measured runs: planned vs recorded peak RSS, locked memory, NVMe space and NVMe
bytes per step of ``report.json`` files (``python -m memascend.plan [REPORT.json ...]``)."""

from __future__ import annotations

from memascend.plan.model import plan_for_report
from memascend.plan.placement import measured_step_bytes
from memascend.units import GIB


def recorded_errors(paths) -> list[dict]:
    """Planned vs measured for recorded ``report.json`` files (e.g. ``baselines/**/reports/*.json``).

    Returns:
        One dict per report: ``name``, and for ``rss``, ``locked``, ``nvme`` and ``step_io`` the
        planned and measured bytes (``memory.sum_rank_peak_rss_bytes``,
        ``memory.sum_rank_peak_locked_bytes``, ``nvme.swap_folder_bytes``, and the swap target's bytes
        read plus written in the median step of rank 0, ``swap_io.median_step``, against
        :attr:`EnginePlan.placement`) and the relative error (``None`` where nothing was measured).
    """
    import json
    from pathlib import Path

    rows = []
    for path in paths:
        report = json.loads(Path(path).read_text())
        plan = plan_for_report(report)
        mem = report["memory"]
        row = {"name": str(path)}
        for key, planned, measured in (("rss", plan.peak_rss_bytes, mem["sum_rank_peak_rss_bytes"]),
                                       ("locked", plan.peak_locked_bytes, mem["sum_rank_peak_locked_bytes"]),
                                       ("nvme", plan.nvme_bytes, report["nvme"]["swap_folder_bytes"])):
            row[key] = (planned, measured, (planned - measured) / measured if measured else None)
        step = measured_step_bytes(report)
        planned_io = plan.placement.nvme_step_bytes if plan.placement is not None else 0
        measured_io = sum(step) if step else 0
        row["step_io"] = (planned_io, measured_io, (planned_io - measured_io) / measured_io if measured_io else None)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m memascend.plan [REPORT.json ...]``: the planner's error on recorded runs
    (default: every ``baselines/**/reports/*.json`` of the repository)."""
    import sys
    from pathlib import Path

    args = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in args] or sorted(Path(__file__).resolve().parents[2].glob("baselines/**/reports/*.json"))
    if not paths:
        print("no recorded reports found (baselines/**/reports/*.json)")
        return 1
    rows = recorded_errors(paths)
    worst = {"rss": 0.0, "locked": 0.0, "nvme": 0.0, "step_io": 0.0}
    print(f"{'report':58} {'RSS GiB plan / meas':>19} {'RSS':>7} {'locked':>7} {'NVMe':>7} {'I/O/step':>8}")
    for row in rows:
        for key in worst:
            if row[key][2] is not None:
                worst[key] = max(worst[key], abs(row[key][2]))
        pct = {k: "-" if row[k][2] is None else f"{row[k][2] * 100:+.1f}%" for k in worst}
        where = Path(row["name"])
        name = ("/".join(where.parts[-3:-2] + (where.stem,)))[-58:]
        print(f"{name:58} {row['rss'][0] / GIB:8.2f} /{row['rss'][1] / GIB:8.2f} {pct['rss']:>7} "
              f"{pct['locked']:>7} {pct['nvme']:>7} {pct['step_io']:>8}")
    print(f"worst of {len(rows)} reports: RSS {worst['rss'] * 100:.1f} %, locked {worst['locked'] * 100:.1f} %, "
          f"NVMe {worst['nvme'] * 100:.1f} %, NVMe bytes per step {worst['step_io'] * 100:.1f} %")
    return 0

