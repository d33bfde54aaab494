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
