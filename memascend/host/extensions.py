"""Doctor check: are memascend's C++/CUDA extensions built and importable?

An op ``X`` (``memascend/ops/X.py`` + ``csrc/X/``) is usable without a compiler when its module
``memascend_X`` is prebuilt (on ``sys.path`` or in ``$MEMASCEND_PREBUILT_DIR``, as in the
container image) or already JIT-built in this environment's cache
(:func:`memascend.ops.build.ext_cache_dir`). The check imports what is there and never starts a
build (a build takes minutes). :func:`check_build_locks` reports build lock files left by killed
builds (every later build of that op would otherwise wait on them forever).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from memascend.host.result import CheckResult, Status
from memascend.ops.build import ext_cache_dir, find_build_locks, torch_extensions_dir
from memascend.ops.build import op_names as op_names  # the ops the doctor checks (re-exported)


def _find_built(mod_name: str, cache_dir: Path) -> tuple[str, str | None]:
    """(where, shared-object path) of an already-built module, or ("", None)."""
    prebuilt = os.environ.get("MEMASCEND_PREBUILT_DIR")
    search = ([prebuilt] if prebuilt else []) + sys.path
    spec = importlib.machinery.PathFinder.find_spec(mod_name, search)
    if spec is not None and spec.origin:
        return "prebuilt", spec.origin
    # build folders are named <module>[_cuda]-<sources digest> (memascend.ops.build.load_op): the newest build
    builds = [build_dir / f"{mod_name}{suffix}" for pattern in (f"{mod_name}-*", f"{mod_name}_cuda-*")
              for build_dir in cache_dir.glob(pattern) for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    built = [b for b in builds if b.is_file()]
    if built:
        return "JIT cache", str(max(built, key=lambda b: b.stat().st_mtime_ns))
    return "", None


def _import_from(mod_name: str, so_path: str) -> None:
    import torch  # noqa: F401 - the extension links against libtorch/libc10, loaded by this import

    spec = importlib.util.spec_from_file_location(mod_name, so_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no loader for {so_path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def check_extension(name: str, *, cache_dir: Path | None = None) -> CheckResult:
    """Import the built extension of one op, if any.

    Args:
        name: op name (module ``memascend_<name>``).
        cache_dir: JIT cache root; default :func:`memascend.ops.build.ext_cache_dir`
            (``$MEMASCEND_EXT_DIR`` or ``~/.cache/memascend/ext/<environment key>``).

    Returns:
        PASS when built and importable; WARN "not built" when it would be JIT-built on first use
        (a C++ compiler is present); FAIL when not built and no compiler can build it, or when
        the built module does not import.
    """
    mod_name = f"memascend_{name}"
    cache = cache_dir or ext_cache_dir(create=False)
    where, so_path = _find_built(mod_name, cache)
    label = f"op {name}"
    if so_path is None:
        compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
        if compiler:
            return CheckResult(
                name=label,
                status=Status.WARN,
                detail=f"not built; will be JIT-built with {compiler} on first use",
                fix=f"build it now: python -c 'import memascend.ops.{name} as m; m.load()'",
            )
        return CheckResult(
            name=label,
            status=Status.FAIL,
            detail="not built and no C++ compiler to build it",
            fix="use the memascend image (ops prebuilt in MEMASCEND_PREBUILT_DIR) or install g++ and ninja",
        )
    try:
        _import_from(mod_name, so_path)
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding
        return CheckResult(
            name=label,
            status=Status.FAIL,
            detail=f"{where} {so_path} does not import: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
            fix=f"rebuild: remove {so_path} and run python -c 'import memascend.ops.{name} as m; m.load()'",
        )
    return CheckResult(name=label, status=Status.PASS, detail=f"{where}: {so_path}")


def build_lock_roots() -> list[Path]:
    """Build folders whose lock files :func:`check_build_locks` inspects: this environment's
    memascend ops and torch extensions folders, memascend's cache roots above them (every
    environment's folders, and the unkeyed op folders of memascend before 2026-11-25), and torch's
    default root (plain DeepSpeed and older memascend versions build there)."""
    cache = Path.home() / ".cache" / "memascend"
    roots = [ext_cache_dir(create=False), torch_extensions_dir(), cache / "ext", cache / "torch_extensions"]
    try:
        from torch.utils.cpp_extension import get_default_build_root

        roots.append(Path(get_default_build_root()))
    except ImportError:
        pass
    return list(dict.fromkeys(roots))


def check_build_locks(roots: list[Path] | None = None) -> CheckResult:
    """Report JIT build lock files: left by a killed build (stale) or held by a running build.

    Args:
        roots: build roots to search (default :func:`build_lock_roots`); each lock is
            ``<root>/<op>/lock`` or ``<root>/py<XY>_<accel>/<op>/lock`` (torch's layout).

    Returns:
        PASS when there is none; WARN naming every stale lock (memascend removes one itself
        before it builds that op; any other program that loads the op waits on it forever) with
        the ``rm`` that clears them, or naming the pid of a build in progress. Never blocks a run.
    """
    states = find_build_locks(roots if roots is not None else build_lock_roots())
    stale = [s for s in states if s.stale]
    live = [s for s in states if not s.stale]
    if not states:
        return CheckResult(name="build locks", status=Status.PASS, detail="no JIT build lock files", required=False)
    parts = [f"stale (build killed {s.age_s:.0f} s ago or earlier): {s.lock_path}" for s in stale]
    parts += [
        f"build in progress by pid {s.owner_pid or s.live_pids[0]}: {s.lock_path}" for s in live
    ]
    fix = ""
    if stale:
        fix = "rm " + " ".join(str(s.lock_path) for s in stale) + " (memascend removes them itself before building)"
    return CheckResult(name="build locks", status=Status.WARN, detail="; ".join(parts), fix=fix, required=False)
