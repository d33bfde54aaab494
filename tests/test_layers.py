"""Import layering of memascend: no import cycle between its subpackages (beyond the known
ones listed here: none) nor between its modules, ``io/`` and ``memory/`` never import DeepSpeed, only
``integrations/deepspeed`` reaches into DeepSpeed's internals, and the package never imports the
repository's ``benchmarks/``.

Imports are read from the source (AST), function-level (lazy) imports included: a cycle through a
lazy import is still a cycle between layers, and between modules (a lazy import does not fail at
import time, but the two modules still need each other: the forwarder ``train/runner.run_finetune``
-> ``recipe`` -> ``runner`` was such a cycle, invisible to module-level imports alone).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "memascend"

KNOWN_CYCLES: set[frozenset[str]] = set()
"""Strongly connected groups of subpackages that exist today; any other group, or one of these
grown by a member, fails :func:`test_no_new_import_cycle_between_subpackages`."""

DEEPSPEED_PUBLIC = {"deepspeed", "deepspeed.accelerator"}
"""DeepSpeed modules any layer may import (the public entry points)."""

KNOWN_DEEPSPEED_INTERNALS: set[tuple[str, str]] = set()
"""``(file, DeepSpeed module)`` imports of DeepSpeed internals outside the seam that exist today."""


def _module_name(path: Path, repo: Path) -> str:
    parts = list(path.relative_to(repo).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _subpackage(path: Path, package: Path) -> str:
    """``memascend/io/store.py`` -> ``io``; a top-level module ``memascend/units.py`` -> ``units``."""
    return path.relative_to(package).parts[0].removesuffix(".py")


def imports(path: Path, repo: Path = REPO) -> set[str]:
    """Every module ``path`` (a file under ``repo``) imports (absolute names; relative imports resolved)."""
    mod = _module_name(path, repo)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found |= {f"{name}.{a.name}" for a in node.names if name in ("memascend", "benchmarks", "tools")}
    return found


def package_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Subpackage -> the other subpackages of memascend (the folder ``package``) it imports."""
    graph: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        src = _subpackage(path, package)
        graph.setdefault(src, set())
        for name in imports(path, package.parent):
            parts = name.split(".")
            if parts[0] == "memascend" and len(parts) > 1 and parts[1] != src:
                graph[src].add(parts[1])
    return graph


def _resolved_import_names(node: ast.Import | ast.ImportFrom, mod: str, is_package: bool) -> list[list[str]]:
    """The candidate modules one import statement names, each as its list of candidates (most
    specific first): ``import a.b.c`` -> ``[a.b.c, a.b, a]``; ``from a.b import c, d`` ->
    ``[a.b.c, a.b]`` and ``[a.b.d, a.b]`` (``c`` may be a submodule or a name in ``a.b``)."""
    if isinstance(node, ast.Import):
        return [[".".join(a.name.split(".")[:i]) for i in range(a.name.count(".") + 1, 0, -1)] for a in node.names]
    if node.level:
        base = mod.split(".") if is_package else mod.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    return [[f"{name}.{a.name}", name] for a in node.names]


def module_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the other modules of memascend (the folder ``package``) it imports, at module level
    or inside a function.

    An import names the most specific module of the package it can: ``from memascend.train import
    checkpoints`` is an edge to ``memascend.train.checkpoints``, ``from memascend.units import
    format_bytes`` one to ``memascend.units``. The parent packages' ``__init__`` that Python runs
    before any submodule are not counted as edges (a package whose ``__init__`` re-exports its own
    modules would otherwise be in a cycle with each of them); ``from pkg import name`` of a name
    that is not a submodule is an edge to ``pkg``'s ``__init__``.
    """
    repo = package.parent
    paths = {_module_name(p, repo): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        graph[mod] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for candidates in _resolved_import_names(node, mod, path.name == "__init__.py"):
                    target = next((c for c in candidates if c in paths), None)
                    if target is not None and target != mod:
                        graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected groups of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.add(frozenset(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_new_cycle_and_ignores_a_chain():
    chain = {"cli": {"train"}, "train": {"io"}, "io": {"errors"}}
    assert cycles(chain) == set()
    assert cycles({**chain, "errors": {"cli"}}) == {frozenset({"cli", "train", "io", "errors"})}
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "a"}}) == {frozenset("ab"), frozenset("cd")}


@pytest.mark.parametrize(
    ("module", "target", "group"),
    [
        ("units.py", "memascend.cli", {"units", "cli"}),
        # a cycle through three layers: ops/build.py -> host (op names) -> io (devices) -> ops
        ("ops/build.py", "memascend.host.extensions", {"ops", "host", "io"}),
    ],
)
def test_a_new_cycle_in_the_package_is_found(tmp_path, module, target, group):
    """A lazy import added to a copy of the package (e.g. units -> cli -> ... -> units) is a cycle."""
    import shutil

    shutil.copytree(PACKAGE, tmp_path / "memascend", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    with open(tmp_path / "memascend" / module, "a") as f:
        f.write(f"\n\ndef _late():\n    import {target}\n")
    new = {c for c in cycles(package_graph(tmp_path / "memascend")) if c not in KNOWN_CYCLES}
    assert any(group <= c for c in new)


def test_no_new_import_cycle_between_subpackages():
    graph = package_graph()
    assert {"cli", "io", "memory", "integrations", "plan", "regress", "host"} <= set(graph)
    new = {c for c in cycles(graph) if c not in KNOWN_CYCLES}
    assert not new, f"import cycles between memascend's subpackages: {[sorted(c) for c in new]} ({graph})"


def test_no_import_cycle_between_modules():
    """No two modules of memascend need each other, directly or through others (lazy imports
    included; see :func:`module_graph`)."""
    graph = module_graph()
    assert {"memascend.train.recipe", "memascend.train.checkpoints.save", "memascend.cli.finetune"} <= set(graph)
    found = cycles(graph)
    assert not found, f"import cycles between memascend's modules: {[sorted(c) for c in found]}"


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "memascend"


def test_module_cycle_finder_finds_a_planted_cycle_on_a_synthetic_package(tmp_path):
    """A tiny package on disk: a chain of modules has no cycle; a lazy import back up the chain, or a
    ``from pkg import module`` back to the start, makes one of exactly the modules on it."""
    chain = {
        "memascend/__init__.py": "",
        "memascend/units.py": "X = 1\n",
        "memascend/train/__init__.py": "from memascend.train.recipe import run  # re-export: no cycle\n",
        "memascend/train/recipe.py": "from memascend.train import dist\nfrom memascend.units import X\n\ndef run():\n    pass\n",
        "memascend/train/dist.py": "import memascend.units\n",
        "memascend/cli.py": "from memascend.train.recipe import run\n",
    }
    graph = module_graph(_write_package(tmp_path / "chain", chain))
    assert graph["memascend.train.recipe"] == {"memascend.train.dist", "memascend.units"}
    assert graph["memascend.train"] == {"memascend.train.recipe"} and cycles(graph) == set()

    lazy = {**chain, "memascend/train/dist.py": "import memascend.units\n\ndef late():\n    from . import recipe\n"}
    assert cycles(module_graph(_write_package(tmp_path / "lazy", lazy))) == {
        frozenset({"memascend.train.recipe", "memascend.train.dist"})}

    through = {**chain, "memascend/units.py": "from memascend import cli\n"}
    assert cycles(module_graph(_write_package(tmp_path / "through", through))) == {
        frozenset({"memascend.cli", "memascend.train.recipe", "memascend.train.dist", "memascend.units"})}


@pytest.mark.parametrize("layer", ["io", "memory"])
def test_io_and_memory_do_not_import_deepspeed(layer):
    offenders = {str(p.relative_to(REPO)): sorted(n for n in imports(p) if n.split(".")[0] == "deepspeed")
                 for p in (PACKAGE / layer).rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}


def test_only_the_seam_imports_deepspeed_internals():
    seam = PACKAGE / "integrations" / "deepspeed"
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if seam in path.parents:
            continue
        found |= {(str(path.relative_to(REPO)), n) for n in imports(path)
                  if n.split(".")[0] == "deepspeed" and n not in DEEPSPEED_PUBLIC}
    assert found <= KNOWN_DEEPSPEED_INTERNALS, sorted(found - KNOWN_DEEPSPEED_INTERNALS)


@pytest.mark.parametrize("outside", ["benchmarks", "tools"])
def test_the_package_never_imports_benchmarks_or_tools(outside):
    """``benchmarks/`` and ``tools/`` (the docs' number generators) sit beside the package and are not
    installed: the wheel must not need them."""
    offenders = {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
                 if any(n.split(".")[0] == outside for n in imports(p))}
    assert not offenders
    assert (REPO / outside / "__init__.py").is_file() and not (PACKAGE / "bench").exists()


def test_imports_reads_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "memascend" / "io"
    pkg.mkdir(parents=True)
    mod = pkg / "x.py"
    mod.write_text("from . import store\nfrom ..ops import build\n\ndef f():\n    import deepspeed.runtime.zero\n")
    assert imports(mod, tmp_path) == {"memascend.io", "memascend.ops", "deepspeed.runtime.zero"}


def test_every_folder_of_the_package_is_a_regular_package():
    """setuptools' ``packages.find`` ships only folders with an ``__init__.py``: a folder without one
    imports from a checkout but is missing from an installed wheel."""
    folders = {p.parent for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert not sorted(str(f.relative_to(REPO)) for f in folders if not (f / "__init__.py").is_file())
