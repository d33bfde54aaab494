"""Build-or-load of the C++/CUDA extensions in ``csrc/``.

An op is looked up in this order:
1. a prebuilt module ``memascend_<op>`` importable from ``sys.path`` or from
   ``$MEMASCEND_PREBUILT_DIR`` (the container image builds these ahead of time);
2. a JIT build with :func:`torch.utils.cpp_extension.load` (ninja), cached under
   ``$MEMASCEND_EXT_DIR`` (default ``~/.cache/memascend/ext``) so later processes reuse it.

CUDA sources (``*.cu``) are compiled only when torch was built with CUDA and ``nvcc`` is found;
the C++ part of an op must therefore work on its own (CPU-only hosts).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

CSRC_DIR = Path(__file__).resolve().parent.parent.parent / "csrc"


class OpBuildError(RuntimeError):
    """Raised when an op can be neither imported prebuilt nor built."""


def ext_cache_dir() -> Path:
    """Folder holding JIT-built extensions (created on demand)."""
    root = Path(os.environ.get("MEMASCEND_EXT_DIR", Path.home() / ".cache" / "memascend" / "ext"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def cuda_build_available() -> bool:
    """True when torch has CUDA and an nvcc is present, so ``.cu`` sources can be compiled."""
    import torch
    from torch.utils import cpp_extension

    return bool(torch.version.cuda) and cpp_extension.CUDA_HOME is not None


@functools.cache
def load_op(
    name: str,
    sources: tuple[str, ...],
    cuda_sources: tuple[str, ...] = (),
    extra_ldflags: tuple[str, ...] = (),
    extra_cflags: tuple[str, ...] = (),
) -> ModuleType:
    """Import the prebuilt extension ``memascend_<name>`` or JIT-build it.

    Args:
        name: op name; the module is ``memascend_<name>``.
        sources: C++ sources relative to ``csrc/``.
        cuda_sources: ``.cu`` sources relative to ``csrc/``, added only when
            :func:`cuda_build_available`; the build then defines ``MEMASCEND_WITH_CUDA``.
        extra_ldflags: linker flags (e.g. ``-laio``).
        extra_cflags: extra compiler flags.

    Returns:
        The loaded extension module.

    Raises:
        OpBuildError: the compiler or a library is missing; the message names the op.
    """
    mod_name = f"memascend_{name}"
    prebuilt = os.environ.get("MEMASCEND_PREBUILT_DIR")
    if prebuilt and prebuilt not in sys.path:
        sys.path.insert(0, prebuilt)
    try:
        return importlib.import_module(mod_name)
    except ImportError:
        pass

    from torch.utils import cpp_extension

    srcs = [str(CSRC_DIR / s) for s in sources]
    cflags = ["-O3", "-std=c++17", "-fvisibility=hidden", *extra_cflags]
    with_cuda = bool(cuda_sources) and cuda_build_available()
    if with_cuda:
        srcs += [str(CSRC_DIR / s) for s in cuda_sources]
        cflags.append("-DMEMASCEND_WITH_CUDA")
    build_dir = ext_cache_dir() / (mod_name + ("_cuda" if with_cuda else ""))
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name=mod_name,
            sources=srcs,
            extra_cflags=cflags,
            extra_cuda_cflags=["-O3", "-DMEMASCEND_WITH_CUDA"] if with_cuda else None,
            extra_ldflags=list(extra_ldflags),
            build_directory=str(build_dir),
            verbose=os.environ.get("MEMASCEND_VERBOSE_BUILD") == "1",
        )
    except Exception as exc:  # noqa: BLE001 - surfaced as one clear error
        raise OpBuildError(f"cannot build op '{name}': {str(exc).strip().splitlines()[-1]}") from exc


def build_all(*, deepspeed_ops: bool = True) -> list[tuple[str, bool, str]]:
    """Build (or find prebuilt) every memascend op and, with ``deepspeed_ops``, DeepSpeed's JIT ops.

    ``install.sh`` runs this so that no training process compiles on first use. A first-use
    compile holds torch's build lock (``<build dir>/lock``) for a minute or more, and a process
    killed meanwhile (a memory cgroup's OOM kill, a timeout, Ctrl-C) leaves the lock behind:
    every later process that loads the op then waits on it forever.

    Args:
        deepspeed_ops: also build DeepSpeed's ``async_io`` (and ``pin_memory``, which it loads
            first; ZeRO-Infinity's NVMe swappers), and the accelerator's ``CPUAdamBuilder`` and
            ``ShareMemCommBuilder`` ops where it has them; an op DeepSpeed says is not compatible
            here (``async_io`` without libaio headers) is skipped.

    Returns:
        ``(name, ok, detail)`` per op; ``ok`` is false only for an op that failed to build
        (``detail`` says why); a DeepSpeed op that cannot apply here is ok with a reason.
    """
    from memascend.host.extensions import op_names

    results: list[tuple[str, bool, str]] = []
    for name in op_names():
        try:
            module = importlib.import_module(f"memascend.ops.{name}").load()
            results.append((f"memascend_{name}", True, str(getattr(module, "__file__", ""))))
        except OpBuildError as exc:
            results.append((f"memascend_{name}", False, str(exc)))
    if not deepspeed_ops:
        return results
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError as exc:
        return [*results, ("deepspeed ops", False, f"deepspeed is not importable: {exc}")]
    # async_io: the NVMe swappers' aio handle; the accelerator's Adam (cpu_adam on the CPU) and,
    # on the CPU accelerator, its shared-memory collectives: built by the first training otherwise.
    builders = [("deepspeed async_io", AsyncIOBuilder())]
    for name, label in (("CPUAdamBuilder", "deepspeed cpu_adam"), ("ShareMemCommBuilder", "deepspeed shm_comm")):
        builder = get_accelerator().create_op_builder(name)
        if builder is not None:
            builders.append((label, builder))
    for label, builder in builders:
        if not builder.is_compatible(verbose=False):
            results.append((label, True, "skipped: not compatible here"))
            continue
        try:
            builder.load(verbose=False)
            results.append((label, True, "built"))
        except Exception as exc:  # noqa: BLE001 - reported per op, one line
            results.append((label, False, (str(exc).strip().splitlines() or [repr(exc)])[-1]))
    return results


def main(argv: list[str] | None = None) -> int:
    """``python3 -m memascend.ops.build [--no-deepspeed]``: build every op; exit 1 if one failed."""
    args = sys.argv[1:] if argv is None else argv
    if any(a != "--no-deepspeed" for a in args):
        print("usage: python3 -m memascend.ops.build [--no-deepspeed]", file=sys.stderr)
        return 2
    failed = 0
    for name, ok, detail in build_all(deepspeed_ops="--no-deepspeed" not in args):
        print(f"{name}: {'ok' if ok else 'FAILED'} {detail}".rstrip(), file=sys.stderr)
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
