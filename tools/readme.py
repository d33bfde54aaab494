"""The measured numbers of the README and docs/, rendered from the committed baselines (never typed by hand).

Every table and number sentence about a measurement in ``README.md`` and ``docs/*.md`` sits between
``<!-- generated: NAME -->`` and ``<!-- end generated -->``; :data:`BLOCKS` renders each NAME from
files under ``baselines/<profile>/`` (regress ``results.json`` and ``report.json`` files, golden
files, capped-run outcomes, io-bench and store-e2e JSON, framework pairs) and from :func:`memascend.plan.plan_run`.
Each block lives in whichever of those files holds its text (most in ``docs/results.md``); a block
may appear in more than one (the README repeats the cap table), and every copy is rewritten.

``python3 -m tools.readme --write`` rewrites the blocks (and draws the profile's
``cpu-full/scaling.png`` and ``caps/scaling.png`` from every measured size); ``--check`` (the
default) exits 1 and names each block that differs from what the baselines give
(``tests/tools/test_readme.py`` runs it).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from tools import config_reference
from tools import readme_blocks as rb
from tools import readme_caps as rc
from tools import readme_frameworks as rf
from tools import readme_speed as rs

REPO = Path(__file__).resolve().parents[1]
PROFILE = "cpu-2c-24g"
BEGIN = "<!-- generated: {name} -->"
END = "<!-- end generated -->"
_BLOCK_RE = re.compile(r"<!-- generated: ([\w.-]+) -->\n(.*?)" + re.escape(END), re.S)

BLOCKS: dict[str, Callable[[rb.Baselines], str]] = {
    "ablation-table": rb.ablation_table,
    "ablation-notes": rb.ablation_notes,
    "smollm2-repeats": rb.smollm2_repeats,
    "smoke-table": rb.smoke_table,
    "smoke-notes": rb.smoke_notes,
    "cpu-full-table": rb.cpu_full_table,
    "cpu-full-notes": rb.cpu_full_notes,
    "llama-1b-plan": rb.llama_1b_plan,
    "llama-1b-table": rb.llama_1b_table,
    "llama-1b-notes": rb.llama_1b_notes,
    "plan-accuracy": rb.plan_accuracy,
    "scaling-notes": rb.scaling_notes,
    "capped-table": rb.capped_table,
    "capped-notes": rb.capped_notes,
    "io-bench-table": rb.io_bench_table,
    "io-bench-notes": rb.io_bench_notes,
    "store-e2e-table": rb.store_e2e_table,
    "store-e2e-notes": rb.store_e2e_notes,
    "gpu-golden-table": rb.gpu_golden_table,
    "families-table": rb.families_table,
    "families-notes": rb.families_notes,
    "caps-table": rc.caps_table,
    "caps-notes": rc.caps_notes,
    "budget-3b-notes": rc.budget_notes,
    "chunking-table": rc.chunking_table,
    "chunking-notes": rc.chunking_notes,
    "caps-plan-notes": rc.caps_plan_notes,
    "context-table": rc.context_table,
    "frameworks-table": rf.frameworks_table,
    "frameworks-notes": rf.frameworks_notes,
    "speed-table": rs.speed_table,
    "speed-notes": rs.speed_notes,
    "speed-floor": rs.floor_note,
    "memascend-settings": config_reference.settings_reference,
    "run-settings": config_reference.run_settings_reference,
}
"""Block name -> renderer (a function of the profile's baselines, returning markdown)."""


def render_all(baselines: rb.Baselines) -> dict[str, str]:
    """Every block's markdown (each ends with one newline)."""
    return {name: fn(baselines).rstrip("\n") + "\n" for name, fn in BLOCKS.items()}


def doc_files(repo: Path = REPO) -> list[Path]:
    """The files that may hold generated blocks: ``README.md`` and ``docs/*.md``."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """The generated blocks of one markdown text, in order: (name, content between its markers)."""
    return [(m.group(1), m.group(2)) for m in _BLOCK_RE.finditer(text)]


def rewrite(text: str, rendered: dict[str, str]) -> str:
    """``text`` with every block's content replaced by ``rendered[name]`` (unknown names kept)."""
    return _BLOCK_RE.sub(lambda m: BEGIN.format(name=m.group(1)) + "\n" + rendered.get(m.group(1), m.group(2)) + END,
                         text)


def differences(texts: dict[str, str] | str, rendered: dict[str, str]) -> list[str]:
    """One line per block that is in none of ``texts`` (file name -> markdown; a bare string is one
    file called README), unknown to :data:`BLOCKS`, or differs from ``rendered`` (every copy checked)."""
    if isinstance(texts, str):
        texts = {"README": texts}
    found = {name: (file, content) for file, text in texts.items() for name, content in readme_blocks(text)}
    copies = [(file, name, content) for file, text in texts.items() for name, content in readme_blocks(text)]
    out = [f"{n}: no <!-- generated: {n} --> block in {', '.join(texts)}" for n in rendered if n not in found]
    out += [f"{n}: not a known block in {f} (tools/readme.py BLOCKS)" for f, n, _ in copies if n not in rendered]
    for file, name, content in copies:
        if name in rendered and content != rendered[name]:
            old, new = content.splitlines(), rendered[name].splitlines()
            first = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
            out.append(f"{name}: {file} line {first + 1} of the block differs from the baselines:\n"
                       f"  {file}: {old[first] if first < len(old) else '(missing)'}\n"
                       f"  baselines: {new[first] if first < len(new) else '(missing)'}")
    return out


def main(argv: list[str] | None = None) -> int:
    """``python3 -m tools.readme [--write | --check] [--baselines DIR] [FILE ...]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python3 -m tools.readme", description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the generated blocks and the scaling plots")
    ap.add_argument("--check", action="store_true", help="exit 1 when a block differs (the default)")
    ap.add_argument("--baselines", type=Path, default=REPO / "baselines" / PROFILE)
    ap.add_argument("files", type=Path, nargs="*", help="markdown files (default: README.md and docs/*.md)")
    args = ap.parse_args(argv)
    files = args.files or doc_files()
    baselines = rb.Baselines(args.baselines)
    rendered = render_all(baselines)
    texts = {str(f.relative_to(REPO) if f.is_absolute() and REPO in f.parents else f): f.read_text() for f in files}
    if args.write:
        for f, (name, text) in zip(files, texts.items(), strict=True):
            new = rewrite(text, rendered)
            if new != text:
                f.write_text(new)
                print(f"{name}: generated blocks rewritten")
        pngs = [rb.write_scaling_png(baselines), rc.write_caps_png(baselines)]
        print(f"{len(rendered)} blocks rendered; " + ", ".join(str(p) for p in pngs if p))
        return 0
    problems = differences(texts, rendered)
    for p in problems:
        print(p)
    if problems:
        print("numbers differ from baselines/: run python3 -m tools.readme --write")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
