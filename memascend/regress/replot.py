"""Draw a regress folder again from what it recorded: ``results.json`` back into
:class:`~memascend.regress.compare.ConfigResult` objects, then ``results.md`` and the PNGs.

``memascend regress --replot DIR`` calls :func:`replot`; the docs' number generator
(``tools/readme.py``, outside the package) reads committed results through :func:`load_results`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from memascend.regress.compare import Check, ConfigResult, RunMetrics
from memascend.regress.matrix import BenchConfig
from memascend.regress.thresholds import Thresholds

_META_KEYS = ("matrix", "repeats", "profile", "golden_path", "golden_tolerances", "wall_s", "memory_cap",
              "capped_search")


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def bench_config(d: dict) -> BenchConfig:
    """A :class:`BenchConfig` from its ``to_dict`` form (keys a newer memascend added are ignored)."""
    known = {f.name for f in dataclasses.fields(BenchConfig)}
    kw = {k: _tuples(v) for k, v in d.items() if k in known and k != "thresholds"}
    if d.get("thresholds"):
        tf = {f.name for f in dataclasses.fields(Thresholds)}
        kw["thresholds"] = Thresholds(**{k: v for k, v in d["thresholds"].items() if k in tf})
    return BenchConfig(**kw)


def _metrics(d: dict | None) -> RunMetrics | None:
    if not d:
        return None
    known = {f.name for f in dataclasses.fields(RunMetrics)}
    return RunMetrics(**{k: tuple(v) if k == "losses" else v for k, v in d.items() if k in known})


def load_results(doc: dict) -> list[ConfigResult]:
    """The configurations of a ``results.json`` document, as ``write_outputs`` wrote them.

    Args:
        doc: the parsed ``results.json``.

    Returns:
        One :class:`ConfigResult` per entry of ``doc["configs"]``, in order; checks, errors,
        commands and run outcomes as recorded (nothing is compared again).
    """
    out = []
    for c in doc["configs"]:
        out.append(ConfigResult(config=bench_config(c["config"]), baseline=_metrics(c.get("baseline")),
                                memascend=_metrics(c.get("memascend")),
                                checks=[Check(**k) for k in c.get("checks", [])], errors=list(c.get("errors", [])),
                                commands=dict(c.get("commands", {})), runs=dict(c.get("runs", {})),
                                golden_key=c.get("golden_key")))
    return out


def read_results(path: str | Path) -> list[ConfigResult]:
    """:func:`load_results` of the ``results.json`` file at ``path``."""
    return load_results(json.loads(Path(path).read_text()))


def find_timelines(out_dir: Path, results: list[ConfigResult]) -> dict[str, dict[str, Path]]:
    """Each configuration's timeline CSV per engine: ``out_dir/timelines/<config>-<engine>.csv``
    (kept by ``write_plots``), else the run's own ``out_dir/<config>/<engine>/memory_timeline.csv``."""
    found: dict[str, dict[str, Path]] = {}
    for r in results:
        for engine in ("baseline", "memascend"):
            for path in (out_dir / "timelines" / f"{r.config.name}-{engine}.csv",
                         out_dir / r.config.name / engine / "memory_timeline.csv"):
                if path.is_file():
                    found.setdefault(r.config.name, {})[engine] = path
                    break
    return found


def replot(out_dir: str | Path) -> list[str]:
    """Draw ``out_dir``'s PNGs again from its ``results.json`` and timeline CSVs, with today's plot code.

    ``results.json`` and ``results.md`` are left as they are. A configuration without any timeline
    CSV keeps its old ``timeline-<config>.png``.

    Raises:
        UserError: ``out_dir`` has no ``results.json``.

    Returns:
        The PNG names written.
    """
    from memascend.errors import UserError
    from memascend.regress.output import write_plots

    out_dir = Path(out_dir)
    path = out_dir / "results.json"
    if not path.is_file():
        raise UserError(f"--replot {out_dir}: no results.json there (give a folder memascend regress wrote)")
    doc = json.loads(path.read_text())
    results = load_results(doc)
    meta = {k: doc[k] for k in _META_KEYS if k in doc}
    return write_plots(results, out_dir, meta, find_timelines(out_dir, results))
