"""Compare two ``memascend regress`` results.json files run by run: per-step losses bit for bit
(float hex) and the memory peaks, for "no behaviour change" checks of a refactor.

``python3 -m tools.compare_results NEW/results.json baselines/cpu-2c-24g/smoke/results.json``
prints one line per config and engine and exits 1 when any loss differs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _name(config: dict) -> str:
    cfg = config["config"]
    return cfg["name"] if isinstance(cfg, dict) else str(cfg)


def compare(new: dict, old: dict) -> tuple[list[str], bool]:
    """(lines, all losses bit-identical) for the configs present in both results."""
    old_by_name = {_name(c): c for c in old["configs"]}
    lines, same = [], True
    for c in new["configs"]:
        o = old_by_name.get(_name(c))
        if o is None:
            lines.append(f"{_name(c)}: not in the old results")
            continue
        for engine in ("baseline", "memascend"):
            got = [float.hex(x) for x in c[engine]["losses"]]
            want = [float.hex(x) for x in o[engine]["losses"]]
            same &= got == want
            rss = (o[engine]["peak_rss_bytes"] / 2**30, c[engine]["peak_rss_bytes"] / 2**30)
            locked = (o[engine]["peak_locked_bytes"] / 2**30, c[engine]["peak_locked_bytes"] / 2**30)
            verdict = "losses bit-identical" if got == want else f"losses DIFFER: {got} vs {want}"
            lines.append(f"{_name(c)} {engine}: {verdict}; peak RSS {rss[0]:.3f} -> {rss[1]:.3f} GiB "
                         f"({rss[1] / rss[0] - 1:+.1%}), locked {locked[0]:.3f} -> {locked[1]:.3f} GiB")
    return lines, same


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python3 -m tools.compare_results NEW_RESULTS_JSON OLD_RESULTS_JSON", file=sys.stderr)
        return 2
    new, old = (json.loads(Path(p).read_text()) for p in argv)
    for path, data in zip(argv, (new, old)):
        if not isinstance(data.get("configs"), list):
            # A golden file (baselines/<profile>/<matrix>.json) keys its configs by name and keeps no losses.
            print(f"compare_results: error: {path} is not a regress results.json (a golden file?); compare the "
                  "runs' results.json files, e.g. baselines/cpu-2c-24g/smoke/results.json", file=sys.stderr)
            return 2
    lines, same = compare(new, old)
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
