"""The renderers of the generated blocks of the README and docs/ (:mod:`tools.readme`): each reads one
profile's committed baselines and returns markdown. Sizes are GiB (2^30 bytes), times seconds,
ratios memascend / stock of the same run unless a block says otherwise."""

from __future__ import annotations

import json
import statistics
from functools import cached_property
from pathlib import Path

from memascend.regress.compare import ConfigResult
from memascend.regress.output import (
    ScalingPoint,
    _md,
    format_params,
    markdown_table,
    plot_scaling,
    table_rows,
)
from memascend.regress.replot import read_results
from memascend.units import GIB

LLAMA_1B = "llama-1b-bf16-256x1-sub-group-1e8"
SMOLLM2 = "smollm2-shakespeare-bf16-256x4"


class Baselines:
    """One profile's folder under ``baselines/`` (e.g. ``baselines/cpu-2c-24g``), read lazily."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def json(self, rel: str) -> dict:
        return json.loads((self.root / rel).read_text())

    def results(self, rel: str) -> list[ConfigResult]:
        return read_results(self.root / rel)

    def result(self, rel: str, name: str) -> ConfigResult:
        return next(r for r in self.results(rel) if r.config.name == name)

    def report(self, rel: str) -> dict:
        return self.json(rel)

    @cached_property
    def cpu_full(self) -> list[ConfigResult]:
        """cpu-full's rows as the README shows them: SmolLM2 bf16 from its 4-repeat run, the rows
        measured again from ``results-remeasured.json``, the rest from the full run."""
        newer = {r.config.name: r for r in self.results("cpu-full/results-remeasured.json")}
        newer.update({r.config.name: r for r in self.results("cpu-full/results-smollm2-bf16-repeats4.json")})
        return [newer.get(r.config.name, r) for r in self.results("cpu-full/results.json")]

    @cached_property
    def remeasured(self) -> set[str]:
        """Names of cpu-full rows measured with the host block cache and parked optimizer buffers."""
        return ({r.config.name for r in self.results("cpu-full/results-remeasured.json")}
                | {r.config.name for r in self.results("cpu-full/results-smollm2-bf16-repeats4.json")})

    @cached_property
    def plan_errors(self) -> list[dict]:
        from memascend.plan.recorded import recorded_errors

        return recorded_errors(sorted(self.root.glob("**/reports/*.json")))


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _span(xs, fmt: str = "{:.2f}", sep: str = "-") -> str:
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else fmt.format(lo) + sep + fmt.format(hi)


def _pct_span(xs) -> str:
    return _span([x * 100 for x in xs], "{:.0f}") + " %"


def _ratio(r: ConfigResult, name: str) -> float:
    return r.check(name).measured


def _kfaults(n: float) -> str:
    return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.0f} k"


def _phases(r: ConfigResult) -> str:
    b, m = r.baseline.median_phase_s, r.memascend.median_phase_s
    return ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {b[k]:.2f} / {m[k]:.2f}" for k in b)


# --- regression tables -------------------------------------------------------------------------


def smoke_table(b: Baselines) -> str:
    return markdown_table(b.results("smoke/results.json"))


def _losses_word(results: list[ConfigResult]) -> str:
    differ = [r.config.name for r in results if not r.check("losses").ok]
    if not differ:
        return "bit-identical" if len(results) == 1 else "bit-identical in every row"
    return "different in " + ", ".join(differ)


def smoke_notes(b: Baselines) -> str:
    rs = b.results("smoke/results.json")
    passed = sum(r.ok for r in rs)
    return (f"{passed} of {len(rs)} rows pass. Losses {_losses_word(rs)}; peak RSS "
            f"{_pct_span([_ratio(r, 'peak_rss_ratio') for r in rs])} of stock's, locked memory "
            f"{_pct_span([_ratio(r, 'peak_locked_ratio') for r in rs])}, step time "
            f"{_span([_ratio(r, 'step_time_ratio') for r in rs])}x (single runs on a noisy 2-core VM).")


def cpu_full_table(b: Baselines) -> str:
    return markdown_table(b.cpu_full)


def cpu_full_notes(b: Baselines) -> str:
    rs, newer = b.cpu_full, b.remeasured
    one_rank = [r for r in rs if r.config.nproc == 1]
    fails = [f"{r.config.name} ({c.name} {c.measured:.3f}, limit {c.limit:.2f})" for r in rs for c in r.checks
             if not c.ok and not c.name.startswith("golden.")]
    lines = [f"- Losses {_losses_word(rs)}.",
             f"- One rank: peak RSS {_pct_span([_ratio(r, 'peak_rss_ratio') for r in one_rank])} of stock's, locked "
             f"{_pct_span([_ratio(r, 'peak_locked_ratio') for r in one_rank])}.",
             "- Step time, rows measured with the host block cache and parked optimizer buffers: "
             f"{_span([_ratio(r, 'step_time_ratio') for r in rs if r.config.name in newer])}x; the earlier run's "
             f"rows, without them: {_span([_ratio(r, 'step_time_ratio') for r in rs if r.config.name not in newer])}x.",
             "- Over the thresholds: " + ("; ".join(fails) if fails else "none") + "."]
    gold = json.loads((b.root / "cpu-full.json").read_text())["configs"]
    for r in rs:
        for c in r.checks:
            if c.name.startswith("golden.") and not c.ok and r.memascend and r.config.name in gold:
                was = gold[r.config.name]["memascend"]["peak_rss_bytes"]
                lines.append(f"- {r.config.name}: memascend's peak RSS {gib(r.memascend.peak_rss_bytes)} GiB is "
                             f"{(r.memascend.peak_rss_bytes / was - 1) * 100:.0f} % above its golden entry "
                             f"({gib(was)} GiB).")
                break
    return "\n".join(lines)


def smollm2_repeats(b: Baselines) -> str:
    r = b.result("cpu-full/results-smollm2-bf16-repeats4.json", SMOLLM2)
    base, mine = r.baseline, r.memascend
    reps = {e: r.runs[e]["repeats"] for e in ("baseline", "memascend")}
    pairs = ", ".join(f"{m:.2f} / {s:.2f}" for m, s in zip(reps["memascend"]["median_step_s"],
                                                           reps["baseline"]["median_step_s"], strict=True))
    faster = sum(m < s for m, s in zip(reps["memascend"]["median_step_s"], reps["baseline"]["median_step_s"],
                                       strict=True))
    rep = b.report("cpu-full/reports/smollm2-shakespeare-bf16-256x4-memascend.json")
    locked = rep["memory_breakdown"]["locked"]
    sub = rep["memascend_settings"]["optimizer_sub_group_numel"]
    return "\n".join([
        f"- {reps['memascend']['n']} alternating pairs, medians: peak RSS {gib(mine.peak_rss_bytes)} against "
        f"{gib(base.peak_rss_bytes)} GiB ({_ratio(r, 'peak_rss_ratio'):.3f}), locked {gib(mine.peak_locked_bytes)} "
        f"against {gib(base.peak_locked_bytes)} GiB ({_ratio(r, 'peak_locked_ratio'):.3f}), median step "
        f"{mine.median_step_s:.2f} against {base.median_step_s:.2f} s ({_ratio(r, 'step_time_ratio'):.3f}); "
        f"losses {_losses_word([r])}; page faults per step {_kfaults(mine.median_minor_faults)} against "
        f"{_kfaults(base.median_minor_faults)}.",
        f"- Each pair's median step (memascend / stock, s): {pairs}; memascend was faster in {faster} of "
        f"{len(reps['memascend']['median_step_s'])}.",
        f"- Per phase (median s per step, stock / memascend): {_phases(r)}.",
        f"- memascend's optimizer sub-groups hold {sub / 1e6:.1f} M fp32 elements, so its "
        f"{locked['optimizer_swap_buffers']} optimizer swap buffers lock {gib(locked['optimizer_swap_buffers_bytes'])}"
        f" GiB; stock runs one sub-group of all {mine.param_numel / 1e6:.0f} M parameters.",
    ])


# --- ablation -----------------------------------------------------------------------------------


def _variant(r: ConfigResult) -> str:
    s = r.config.memascend_settings
    return "defaults (`{}`)" if not s else "`" + json.dumps(dict(s)) + "`"


def ablation_table(b: Baselines) -> str:
    rows = []
    for r in b.results("ablation/results.json"):
        base, mine = r.baseline, r.memascend
        rows.append([_variant(r), gib(mine.peak_rss_bytes), f"{_ratio(r, 'peak_rss_ratio'):.3f}",
                     f"{_ratio(r, 'peak_locked_ratio'):.3f}", f"{mine.median_step_s:.2f} ({base.median_step_s:.2f})",
                     f"{mine.median_step_s / base.median_step_s:.3f}",
                     f"{mine.median_phase_s['optimizer_step_s']:.2f} ({base.median_phase_s['optimizer_step_s']:.2f})",
                     f"{mine.median_minor_faults:,.0f} ({base.median_minor_faults:,.0f})"])
    return _md(["memascend variant (`\"memascend\"` section)", "peak RSS GiB", "RSS / stock", "locked / stock",
                "s/step (stock)", "time / stock", "optimizer step s (stock)", "page faults / step (stock)"], rows)


def ablation_notes(b: Baselines) -> str:
    rs = b.results("ablation/results.json")
    by = {r.config.name.rsplit("256x4-", 1)[-1]: r for r in rs}
    d, keep = by["defaults"], by["keep-optimizer-buffers"]
    return "\n".join([
        f"- Stock peaked at {_span([r.baseline.peak_rss_bytes / GIB for r in rs])} GiB RSS and "
        f"{_span([r.baseline.peak_locked_bytes / GIB for r in rs])} GiB locked; per-step losses {_losses_word(rs)} "
        f"({2 * len(rs)} runs, {b.json('ablation/results.json')['wall_s'] / 60:.0f} minutes).",
        f"- Page faults per step: {_kfaults(by['no-host-block-cache'].memascend.median_minor_faults)} without the "
        f"host block cache, {_kfaults(d.memascend.median_minor_faults)} with it; "
        f"{_kfaults(by['no-torch-thp'].memascend.median_minor_faults)} without transparent huge pages for torch "
        f"(optimizer step {by['no-torch-thp'].memascend.median_phase_s['optimizer_step_s']:.2f} s).",
        f"- Keeping the optimizer buffers locked between steps costs "
        f"{(keep.memascend.peak_rss_bytes - d.memascend.peak_rss_bytes) / GIB:.2f} GiB of RSS "
        f"({_ratio(keep, 'peak_rss_ratio'):.3f} of stock, limit {keep.check('peak_rss_ratio').limit:.2f}); without "
        f"the malloc policy RSS rises by "
        f"{(by['no-malloc-policy'].memascend.peak_rss_bytes - d.memascend.peak_rss_bytes) / GIB:.2f} GiB.",
    ])


# --- llama-1b -----------------------------------------------------------------------------------


def llama_1b_table(b: Baselines) -> str:
    r = b.result("cpu-full/results-remeasured.json", LLAMA_1B)
    return _md(["config", "base RSS GiB", "ma RSS GiB", "RSS ratio", "base locked GiB", "ma locked GiB",
                "locked ratio", "base s/step", "ma s/step", "time ratio", "losses"],
               [row[:11] for row in table_rows([r])])


def _stock_default_1b_plan_bytes() -> int:
    """Stock's planned peak for the scaling shape of llama-1b with DeepSpeed's default sub-groups."""
    from memascend.config import build_run_config
    from memascend.plan import plan_run

    cfg = build_run_config({"model": {"from_scratch": "llama-1b"}, "data": {"seq_len": 256},
                            "train": {"micro_batch": 1, "steps": 4, "activation_checkpointing": True}}, {})
    return plan_run(cfg)["baseline"].peak_rss_bytes


def llama_1b_plan(b: Baselines) -> str:
    return (f"`memascend plan --from-scratch llama-1b --micro-batch 1 --seq-len 256 --activation-checkpointing` "
            f"puts stock's defaults at {_stock_default_1b_plan_bytes() / GIB:.1f} GiB peak RSS on this "
            f"{b.root.name.rsplit('-', 1)[-1].upper().replace('G', '')} GiB host.")


def llama_1b_notes(b: Baselines) -> str:
    r = b.result("cpu-full/results-remeasured.json", LLAMA_1B)
    rep = b.report(f"cpu-full/reports/{LLAMA_1B}-memascend.json")
    locked = rep["memory_breakdown"]["locked"]
    rss = r.check("peak_rss_ratio")
    return "\n".join([
        f"- Losses {_losses_word([r])}: {', '.join(f'{x:.4f}' for x in r.memascend.losses)}.",
        f"- Peak RSS {rss.measured:.3f} of stock's (limit {rss.limit:.2f}, the ~1B target) at "
        f"{_ratio(r, 'step_time_ratio'):.3f}x stock's step time.",
        f"- Per phase (median s per step, stock / memascend): {_phases(r)}; page faults per step "
        f"{_kfaults(r.baseline.median_minor_faults)} / {_kfaults(r.memascend.median_minor_faults)}.",
        f"- memascend's locked memory: the optimizer's {locked['optimizer_swap_buffers']} fp32 sub-group buffers "
        f"({gib(locked['optimizer_swap_buffers_bytes'])} GiB), the parameter pool "
        f"({gib(locked['param_swap_buffers_bytes'])} GiB) and the write-back buffer "
        f"({gib(locked['param_writeback_buffer_bytes'])} GiB).",
    ])


# --- planner ------------------------------------------------------------------------------------


def plan_accuracy(b: Baselines) -> str:
    rows = b.plan_errors
    worst = {}
    for key in ("rss", "locked", "nvme"):
        row = max((r for r in rows if r[key][2] is not None), key=lambda r: abs(r[key][2]))
        worst[key] = (abs(row[key][2]) * 100, Path(row["name"]).stem)
    by = {Path(r["name"]).relative_to(b.root).as_posix(): r for r in rows}
    one_b = by[f"cpu-full/reports/{LLAMA_1B}-baseline.json"]["rss"]
    sb, sm = (by[f"cpu-full/reports/{SMOLLM2}-{e}.json"]["rss"] for e in ("baseline", "memascend"))
    return "\n".join([
        f"- {len(rows)} recorded reports (`baselines/{b.root.name}/**/reports/*.json`): worst error of peak RSS "
        f"{worst['rss'][0]:.1f} % ({worst['rss'][1]}), locked {worst['locked'][0]:.1f} %, NVMe "
        f"{worst['nvme'][0]:.1f} %.",
        f"- Stock's tuned llama-1b pair: planned {gib(one_b[0])} GiB, measured {gib(one_b[1])} GiB.",
        f"- SmolLM2 4 x 256 (bf16): planned {gib(sb[0])} vs {gib(sm[0])} GiB RSS (stock vs memascend), measured "
        f"{gib(sb[1])} vs {gib(sm[1])} GiB.",
        _plan_families(b, by),
    ])


def _plan_families(b: Baselines, by: dict[str, dict]) -> str:
    """Planned against measured peak RSS / locked memory of memascend's runs of every family."""
    rows = sorted((k, r) for k, r in by.items() if k.startswith("planner/reports/"))
    parts = [f"{Path(k).stem.removesuffix('-memascend')} {r['rss'][2] * 100:+.1f} % / {r['locked'][2] * 100:+.1f} %"
             for k, r in rows]
    worst = [max(abs(r[key][2]) for _, r in rows) * 100 for key in ("rss", "locked")]
    return (f"- memascend on every family (`baselines/{b.root.name}/planner/reports`, planned against measured "
            f"peak RSS / locked): {'; '.join(parts)} (worst {worst[0]:.1f} % RSS, {worst[1]:.1f} % locked; "
            f"`tests/plan/test_plan_families.py` holds them to 10 %).")


# --- scaling ------------------------------------------------------------------------------------


def _single(b: Baselines) -> list[dict]:
    return [b.report(p.relative_to(b.root).as_posix())
            for p in sorted(b.root.glob("single/reports/*-memascend.json"))]


def scaling_notes(b: Baselines) -> str:
    doc = b.json("cpu-full/results.json")
    fit = doc["scaling_fit"]
    series = [r for r in b.cpu_full if r.config.scaling]
    one_b = b.result("cpu-full/results-remeasured.json", LLAMA_1B)
    cap = 16 * GIB
    under = {e: (cap - f["intercept_bytes"]) / f["bytes_per_param"] for e, f in fit.items()}
    lines = [
        "- Peak RSS ratio by size: " + ", ".join(
            f"{_ratio(r, 'peak_rss_ratio'):.2f} ({format_params(r.memascend.param_numel)}: "
            f"{gib(r.memascend.peak_rss_bytes)} vs {gib(r.baseline.peak_rss_bytes)} GiB)" for r in series)
        + f"; locked {_span([_ratio(r, 'peak_locked_ratio') for r in series])}; losses {_losses_word(series)}.",
        "- Straight-line fits of peak RSS against parameters: " + ", ".join(
            f"{'stock' if e == 'baseline' else e} {f['bytes_per_param']:.1f} bytes/param + "
            f"{f['intercept_bytes'] / GIB:.2f} GiB" for e, f in fit.items())
        + f". By them the largest model under 16 GiB is about {under['baseline'] / 1e9:.2f} B parameters for stock "
        f"and {under['memascend'] / 1e9:.1f} B for memascend; stock would need "
        f"{(fit['baseline']['bytes_per_param'] * one_b.baseline.param_numel + fit['baseline']['intercept_bytes']) / GIB:.1f}"
        f" GiB for llama-1b.",
        f"- llama-1b with both engines at `sub_group_size` 1e8 (the pair above): {gib(one_b.memascend.peak_rss_bytes)} "
        f"GiB against stock's {gib(one_b.baseline.peak_rss_bytes)}.",
    ]
    for rep in _single(b):
        mem, numel = rep["memory"], rep["model"]["param_numel"]
        key = f"{_preset_of(rep)}-bf16-256x1-memascend.json"
        plan = next((r for r in b.plan_errors if r["name"].endswith("single/reports/" + key)), None)
        copy = (rep.get("memory_breakdown") or {}).get("param_dram_copy", {}).get("allocated_bytes")
        lines.append(
            f"- `single/reports/{key}` ({format_params(numel)}): {gib(mem['peak_rss_bytes'])} GiB RSS, "
            f"{gib(mem['peak_locked_bytes'])} GiB locked, {rep['median_step_s']:.1f} s/step"
            + (f" (plan: {gib(plan['rss'][0])} / {gib(plan['locked'][0])} GiB)" if plan else "")
            + ("; recorded with a DRAM copy of the parameters" if copy else "") + ".")
    return "\n".join(lines)


def _preset_of(rep: dict) -> str:
    """``llama-2b`` from a report of a from-scratch preset run (its output folder's stem is not kept)."""
    from memascend.config import FROM_SCRATCH_PRESETS

    numel = rep["model"]["param_numel"]
    best = min(FROM_SCRATCH_PRESETS.items(), key=lambda kv: abs(kv[1].param_numel - numel))
    return best[0]


def capped_table(b: Baselines) -> str:
    rows = []
    caps = {p.stem: json.loads(p.read_text()) for p in sorted((b.root / "capped-16g").glob("*-llama-*.json"))
            if not p.name.startswith("report-")}
    for engine, label in (("baseline", "stock (`--engine baseline`)"), ("memascend", "memascend")):
        mine = {k.split("-", 1)[1]: v for k, v in caps.items() if k.startswith(engine + "-")}
        fit = [k for k, v in mine.items() if v["fit"]]
        killed = [k for k, v in mine.items() if v["oom_killed"]]
        best = max(fit, key=lambda k: b.report(f"capped-16g/report-{engine}-{k}.json")["model"]["param_numel"])
        rep = b.report(f"capped-16g/report-{engine}-{best}.json")
        nxt = (f"{killed[0]}: OOM-killed after {mine[killed[0]]['wall_s']:.0f} s" if killed else "-")
        rows.append([label, f"{best} ({format_params(rep['model']['param_numel'])} params)",
                     gib(mine[best]["peak_bytes"]), gib(rep["memory"]["peak_rss_bytes"]), nxt])
    return _md(["engine", "largest preset that trained 3 steps under 16 GiB", "cgroup peak GiB (RSS + page cache)",
                "own peak RSS GiB", "next preset"], rows)


def capped_notes(b: Baselines) -> str:
    largest = {}
    for p in sorted((b.root / "capped-16g").glob("report-*.json")):
        rep = json.loads(p.read_text())
        largest[rep["engine"]] = max(largest.get(rep["engine"], 0), rep["model"]["param_numel"])
    return (f"So under the same 16 GiB, memascend trains a model {largest['memascend'] / largest['baseline']:.1f}x "
            "larger than stock does.")


# --- I/O benchmarks -----------------------------------------------------------------------------


def _q(paired: list[float]) -> str:
    q1, _, q3 = statistics.quantiles(paired, n=4, method="inclusive")
    return f"{statistics.median(paired):.2f} [{q1:.2f}-{q3:.2f}]"


def _paired(row: dict, num: str, den: str) -> list[float] | None:
    a, d = row["samples"].get(num) or [], row["samples"].get(den) or []
    xs = [x / y for x, y in zip(a, d, strict=False) if y > 0]
    return xs or None


def io_bench_table(b: Baselines) -> str:
    main, long = b.json("io-bench/ram-loop.json")["rows"], b.json("io-bench/ram-loop-fio-25.json")["rows"]
    rows = []
    for r, r25 in zip(main, long, strict=True):
        bw = [f"{r[k]:.0f}" if r.get(k) else "-" for k in ("engine_mib_s", "engine_crc_mib_s", "fio_mib_s",
                                                             "deepspeed_mib_s", "engine_fs_mib_s")]
        ratios = [_paired(r, n, d) for n, d in (("engine", "fio"), ("engine_crc", "fio"), ("engine", "deepspeed"),
                                                 ("engine_fs", "deepspeed"))]
        rows.append([r["pattern"], r["op"], str(r["block_bytes"] >> 10), str(r["queue_depth"]), *bw,
                     *[_q(x) if x else "-" for x in ratios], _q(_paired(r25, "engine", "fio"))])
    return _md(["pattern", "op", "block KiB", "qd", "engine", "engine+CRC", "fio", "DeepSpeed", "engine (ext4 file)",
                "engine/fio", "engine+CRC/fio", "engine/DeepSpeed", "engine (ext4 file)/DeepSpeed",
                "engine/fio, 25 repeats"], rows)


def _med(row: dict, num: str, den: str) -> float | None:
    xs = _paired(row, num, den)
    return statistics.median(xs) if xs else None


def _cpu(rows: list[dict], tool: str) -> float:
    return statistics.median(r["cpu_ms_per_gib"][tool] for r in rows if tool in r.get("cpu_ms_per_gib", {}))


def io_bench_notes(b: Baselines) -> str:
    main, long = b.json("io-bench/ram-loop.json"), b.json("io-bench/ram-loop-fio-25.json")["rows"]
    shared = b.json("io-bench/ram-loop-fio-25-shared-buffers.json")["rows"]
    rows = main["rows"]
    fio = [_med(r, "engine", "fio") for r in rows + long]
    big = [_med(r, "engine", "fio") for r in rows + long if r["block_bytes"] >= 16 << 20]
    small = [_med(r, "engine", "fio") for r in rows + long if r["block_bytes"] < 16 << 20]
    ds = [x for x in (_med(r, "engine", "deepspeed") for r in rows) if x]
    fs_ds = [x for x in (_med(r, "engine_fs", "deepspeed") for r in rows) if x]
    crc = [_med(r, "engine_crc", "fio") for r in rows]
    shared_small = [_med(r, "engine", "fio") for r in shared if r["block_bytes"] < 16 << 20 and r["queue_depth"] == 32]
    long_small = [_med(r, "engine", "fio") for r in long if r["block_bytes"] < 16 << 20 and r["queue_depth"] == 32]
    return "\n".join([
        f"- Engine against fio: {_span(fio)}x over both runs; 16 MiB requests {_span(big)}x, 1 MiB requests "
        f"{_span(small)}x ({sum(x < 0.95 for x in small)} of {len(small)} measurements under 0.95x).",
        f"- 1 MiB depth-32 rows of the shared-buffer run (`ram-loop-fio-25-shared-buffers`): "
        f"{', '.join(f'{x:.2f}' for x in shared_small)}x, against {', '.join(f'{x:.2f}' for x in long_small)}x in "
        f"the 25-repeat run.",
        f"- Against DeepSpeed's aio on ext4: the engine on one preallocated ext4 file {_span(fs_ds)}x, on the raw "
        f"partition {_span(ds)}x.",
        f"- CPU per GiB moved (median over rows, ms): engine {_cpu(rows, 'engine'):.0f}, fio {_cpu(rows, 'fio'):.0f}, "
        f"DeepSpeed {_cpu(rows, 'deepspeed'):.0f}; on the ext4 file engine {_cpu(rows, 'engine_fs'):.0f}, fio "
        f"{_cpu(rows, 'fio_fs'):.0f}.",
        f"- CRC32C: {main['meta']['crc32c_gib_s']:.1f} GiB/s on one thread; with it on the engine is at "
        f"{_span(crc)}x of fio.",
    ])


def _store(b: Baselines, engine: str) -> dict:
    return b.json(f"store-e2e/{engine}/results.json")


def store_e2e_table(b: Baselines) -> str:
    rows = []
    for engine, label in (("memascend", "memascend"), ("baseline", "baseline (stock memory management)")):
        d = _store(b, engine)
        st, fo = d["store_step_s"], d["folder_step_s"]
        rows.append([label, f"{statistics.median(st):.2f} / {statistics.median(fo):.2f}",
                     f"{d['step_time_ratio']:.3f}",
                     f"{', '.join(f'{x:.2f}' for x in st)}; {', '.join(f'{x:.2f}' for x in fo)}",
                     "equal" if d["losses_equal"] else "DIFFER",
                     f"{gib(d['store_peak_rss_bytes'])} / {gib(d['folder_peak_rss_bytes'])}"])
    return _md(["engine", "median step, store / folder (s)", "ratio", "runs (store; folder)", "losses",
                "peak RSS, store / folder (GiB)"], rows)


def store_e2e_notes(b: Baselines) -> str:
    d = _store(b, "memascend")
    pairs = list(zip(d["store_step_s"], d["folder_step_s"], strict=True))
    faster = sum(s < f * 0.99 for s, f in pairs)
    slower = [s / f - 1 for s, f in pairs if s > f * 1.01]
    base = _store(b, "baseline")
    delta = {e: (x["store_peak_rss_bytes"] - x["folder_peak_rss_bytes"]) / GIB for e, x in (("memascend", d),
                                                                                             ("baseline", base))}
    return (f"Pair by pair (memascend) the store was faster in {faster} of {len(pairs)} pairs and slower in "
            f"{len(slower)}" + (f" (by at most {max(slower) * 100:.0f} %)" if slower else "") + ". The store's "
            f"peak RSS is {abs(delta['memascend']):.2f} GiB {'above' if delta['memascend'] > 0 else 'below'} the "
            f"folder's with memascend's memory core, {abs(delta['baseline']):.2f} GiB "
            f"{'above' if delta['baseline'] > 0 else 'below'} with stock's.")


# --- the scaling figure -------------------------------------------------------------------------


def scaling_points(b: Baselines) -> list[ScalingPoint]:
    """Every measured size per engine: cpu-full's series, the tuned llama-1b pair, memascend's
    single runs of larger presets (one point per size: the first source wins) and the runs the 16 GiB
    cap OOM-killed."""
    pts: dict[tuple[str, int], ScalingPoint] = {}
    for r in [r for r in b.cpu_full if r.config.scaling] + [b.result("cpu-full/results-remeasured.json", LLAMA_1B)]:
        note = "" if r.config.scaling else "sub_group_size 1e8"
        for e in ("baseline", "memascend"):
            m = getattr(r, e)
            pts.setdefault((e, m.param_numel), ScalingPoint(e, m.param_numel, m.peak_rss_bytes, note))
    for rep in _single(b):
        n = rep["model"]["param_numel"]
        pts.setdefault(("memascend", n), ScalingPoint("memascend", n, rep["memory"]["peak_rss_bytes"], "single run"))
    for p in sorted((b.root / "capped-16g").glob("*-llama-*.json")):
        d = json.loads(p.read_text())
        if p.name.startswith("report-") or not d.get("oom_killed"):
            continue
        engine, preset = p.stem.split("-", 1)
        from memascend.config import FROM_SCRATCH_PRESETS

        pts[(engine, -1)] = ScalingPoint(engine, FROM_SCRATCH_PRESETS[preset].param_numel, None)
    return sorted(pts.values(), key=lambda p: (p.engine, p.param_numel))


def write_scaling_png(b: Baselines) -> Path:
    """Draw ``cpu-full/scaling.png`` from every measured size (:func:`scaling_points`)."""
    out = b.root / "cpu-full" / "scaling.png"
    caps = [json.loads(p.read_text())["cap_bytes"] for p in (b.root / "capped-16g").glob("*-llama-*.json")
            if not p.name.startswith("report-")]
    plot_scaling(scaling_points(b), out, f"{b.root.name}: peak host RSS vs model size (every measured size)",
                 b.json("cpu-full/results.json")["scaling_fit"], max(caps) if caps else None)
    return out


def _fmt_or_dash(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def gpu_golden_table(b: Baselines) -> str:
    """The committed ``gpu`` golden results of every GPU profile (``baselines/*/gpu.json``, beside the
    CPU profile's folder): one row per profile and config, peaks and step times of both engines."""
    rows = []
    for path in sorted(b.root.parent.glob("*/gpu.json")):
        golden = json.loads(path.read_text())
        for name, c in sorted(golden["configs"].items()):
            ma = c["memascend"]
            base = c["baseline"] or {}  # None: stock stopped by a memory cap (memascend's numbers only)
            rows.append([golden["profile"], name, gib(base.get("peak_rss_bytes")), gib(ma["peak_rss_bytes"]),
                         _fmt_or_dash(c["peak_rss_ratio"], ".3f"), gib(base.get("peak_locked_bytes")),
                         gib(ma["peak_locked_bytes"]), _fmt_or_dash(c["peak_locked_ratio"], ".3f"),
                         _fmt_or_dash(base.get("median_step_s"), ".2f"), f"{ma['median_step_s']:.2f}",
                         _fmt_or_dash(ma["median_step_s"] / base["median_step_s"] if base else None, ".3f")])
    if not rows:
        return "No GPU profile has golden results yet.\n"
    header = ["profile", "config", "base RSS GiB", "ma RSS GiB", "RSS ratio", "base locked GiB", "ma locked GiB",
              "locked ratio", "base s/step", "ma s/step", "time ratio"]

    return _md(header, rows)


def families_table(b: Baselines) -> str:
    """cpu-full's model-family rows (untied Mistral, Qwen2, GPT-NeoX and Phi with dropout), from scratch."""
    return markdown_table(b.results("cpu-full/families/results.json"))


def families_notes(b: Baselines) -> str:
    rs = b.results("cpu-full/families/results.json")
    memory_ok = [r for r in rs if r.check("peak_rss_ratio").ok and r.check("peak_locked_ratio").ok]
    return (f"{len(memory_ok)} of {len(rs)} families meet both memory targets (RSS <= 0.40x, locked <= 0.25x); "
            f"{sum(r.ok for r in rs)} of {len(rs)} rows pass every check. Losses {_losses_word(rs)}; peak RSS "
            f"{_pct_span([_ratio(r, 'peak_rss_ratio') for r in rs])} of stock's, locked memory "
            f"{_pct_span([_ratio(r, 'peak_locked_ratio') for r in rs])}, step time "
            f"{_span([_ratio(r, 'step_time_ratio') for r in rs])}x (one run each on a loaded 2-core VM).")
