"""The framework pairs' block of docs/usage.md (:mod:`tools.readme`), from ``frameworks/*.json``.

Each file is one pair's record as ``python3 -m tests.examples.pairs`` writes it: the same training
command (TRL's ``SFTTrainer``, ``llamafactory-cli train`` or axolotl's ``axolotl.cli.train`` under
torchrun, full fine-tune or LoRA) under
``memascend run`` and without it, both started at once, peaks in KiB over each process tree.
"""

from __future__ import annotations

from tools.readme_blocks import Baselines

ORDER = ("trl-full", "trl-lora", "llamafactory-full", "llamafactory-lora", "axolotl-full", "axolotl-lora")
"""Rows in this order; a record of another name follows them, sorted."""
_FRAMEWORK = {"trl": "TRL {trl} `SFTTrainer`", "llamafactory": "LLaMA-Factory {llamafactory}",
              "axolotl": "axolotl {axolotl}"}
_KIB_PER_GIB = 1 << 20
RSS_RATIO_TARGET = 0.40
"""The peak RSS ratio the slow tests hold full fine-tuning pairs to (tests/examples/pairs.py)."""


def _records(b: Baselines) -> list[dict]:
    names = sorted(p.stem for p in (b.root / "frameworks").glob("*.json"))
    names = [n for n in ORDER if n in names] + [n for n in names if n not in ORDER]
    return [b.json(f"frameworks/{n}.json") for n in names]


def _gib(kib: int) -> str:
    return f"{kib / _KIB_PER_GIB:.2f}"


def _losses(rec: dict) -> str:
    """Whether memascend's per-step losses equal stock's, or on two ranks ``baseline``'s (stock DeepSpeed
    with memascend's correctness fixes), and then from which step stock's differ."""
    engines = rec["engines"]
    ma, stock = engines["memascend"]["losses_hex"], engines["stock"]["losses_hex"]
    ref = engines.get("baseline", engines["stock"])["losses_hex"]
    text = "bit-equal" if ma == ref and ma else _within(engines["memascend"]["losses"],
                                                        engines.get("baseline", engines["stock"])["losses"])
    if "baseline" in engines:
        text += " to baseline"
        parted = [i for i, (a, b) in enumerate(zip(ma, stock)) if a != b]
        text += f", stock's from step {parted[0] + 1}" if parted else ", and to stock"
    return text


def frameworks_table(b: Baselines) -> str:
    """One row per pair: framework and version, method, peak RSS and locked memory of each engine
    (GiB), their ratios (memascend / stock) and whether the per-step losses are bit-equal."""
    rows = ["| framework | method | peak RSS memascend / stock (GiB) | ratio | locked memascend / stock (GiB) "
            "| ratio | per-step losses |", "|---|---|---|---|---|---|---|"]
    for rec in _records(b):
        ma, stock = rec["engines"]["memascend"], rec["engines"]["stock"]
        method = f"LoRA r{rec['lora_rank']}" if rec["lora_rank"] else "full"
        rows.append(f"| {_FRAMEWORK[rec['framework']].format(**rec['versions'])} | {method} "
                    f"| {_gib(ma['peak_rss_kib'])} / {_gib(stock['peak_rss_kib'])} | {rec['peak_rss_ratio']:.3f}x "
                    f"| {_gib(ma['peak_locked_kib'])} / {_gib(stock['peak_locked_kib'])} "
                    f"| {rec['peak_locked_ratio']:.3f}x | {_losses(rec)} ({len(ma['losses'])} steps) |")
    return "\n".join(rows) + "\n"


def frameworks_notes(b: Baselines) -> str:
    """The shape and the exact commands of each measured pair."""
    out = []
    for rec in _records(b):
        shape = rec["shape"]
        out.append(f"- `{rec['pair']}` ({rec['model']}, micro-batch {shape['micro_batch']} x "
                   f"{shape['seq_len']} tokens, {shape['steps']} steps, {_ranks(rec['ranks'])} on the CPU; "
                   f"transformers {rec['versions']['transformers']}, PEFT {rec['versions']['peft']}, "
                   f"DeepSpeed {rec['versions']['deepspeed']}; {_order(rec)}; "
                   f"losses {', '.join(f'{x:.4f}' for x in rec['engines']['memascend']['losses'])}):\n"
                   f"  `{rec['engines']['memascend']['command']}` against\n"
                   f"  `{rec['engines']['stock']['command']}`" + _baseline(rec))
    lora = [rec for rec in _records(b) if rec["lora_rank"] and rec["peak_rss_ratio"] > RSS_RATIO_TARGET]
    if lora:
        floors = "; ".join(f"{rec['pair']} {_gib(_unlocked(rec, 'memascend'))} / {_gib(_unlocked(rec, 'stock'))}"
                           for rec in lora)
        out.append(f"\nWith LoRA the frozen base has no optimizer state, and the stock run's extra host memory "
                   f"is mostly DeepSpeed's locked parameter swap buffers, which memascend shrinks. Peak RSS "
                   f"less peak locked memory (imports, the model load, activations), memascend / stock, GiB: "
                   f"{floors}; this part, close in both runs, keeps the peak RSS ratio above {RSS_RATIO_TARGET:.2f}.")
    return "\n".join(out) + "\n"


def _within(losses: list[float], reference: list[float]) -> str:
    if len(losses) != len(reference) or not losses or losses[0] != reference[0]:
        return "DIFFER"
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
    return f"first bit-equal, then within {worst:.1e} relative"


def _baseline(rec: dict) -> str:
    if "baseline" not in rec["engines"]:
        return ""
    losses = ", ".join(f"{x:.4f}" for x in rec["engines"]["stock"]["losses"])
    return (f" (stock's losses {losses}) and\n  `{rec['engines']['baseline']['command']}` with the section of "
            f"`MemAscendSettings.baseline()` in `$WORK/baseline-ds.json`")


def _order(rec: dict) -> str:
    if rec.get("one_at_a_time"):
        return f"one engine at a time, {rec['started_first']} first"
    return f"{rec['started_first']} started first"


def _ranks(ranks: int) -> str:
    return "1 rank" if ranks == 1 else f"{ranks} ranks (micro-batch per rank; peaks of the largest rank)"


def _unlocked(rec: dict, engine: str) -> int:
    run = rec["engines"][engine]
    return run["peak_rss_kib"] - run["peak_locked_kib"]
