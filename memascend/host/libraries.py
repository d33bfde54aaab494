"""Doctor check: are the asynchronous I/O libraries (libaio, liburing) present?

The I/O engines submit O_DIRECT reads/writes through libaio (DeepSpeed's aio op, memascend's
device store) or io_uring. The shared library is needed at run time; the header only to build an
op from source (a prebuilt image has no compiler and needs no header).
"""

from __future__ import annotations

import ctypes.util
from collections.abc import Callable, Sequence
from pathlib import Path

from memascend.host.result import CheckResult, Status

INCLUDE_DIRS: tuple[Path, ...] = (Path("/usr/include"), Path("/usr/local/include"))
_PACKAGES = {"aio": ("libaio1", "libaio-dev"), "uring": ("liburing2", "liburing-dev")}


def check_library(
    lib: str,
    header: str,
    *,
    required: bool,
    find_library: Callable[[str], str | None] = ctypes.util.find_library,
    include_dirs: Sequence[Path] = INCLUDE_DIRS,
) -> CheckResult:
    """Look for ``lib<lib>.so`` (via the dynamic loader's search) and its header.

    Args:
        lib: library name without ``lib`` prefix, e.g. ``"aio"``.
        header: header file name, e.g. ``"libaio.h"``.
        required: whether a missing shared library fails the run.
        find_library: resolver (injectable for tests); default :func:`ctypes.util.find_library`.
        include_dirs: folders searched for the header.

    Returns:
        PASS with library and header; WARN when only the header is missing (prebuilt ops work,
        JIT builds do not); FAIL (or WARN when not required) without the library.
    """
    runtime_pkg, dev_pkg = _PACKAGES.get(lib, (f"lib{lib}", f"lib{lib}-dev"))
    found = find_library(lib)
    header_path = next((d / header for d in include_dirs if (d / header).is_file()), None)
    name = f"lib{lib}"
    if not found:
        return CheckResult(
            name=name,
            status=Status.FAIL if required else Status.WARN,
            detail="shared library not found by the dynamic loader",
            fix=f"apt-get install {runtime_pkg} {dev_pkg} (or run ./install.sh)",
            required=required,
        )
    if header_path is None:
        return CheckResult(
            name=name,
            status=Status.WARN,
            detail=f"{found}; header {header} missing (prebuilt ops only, no JIT build)",
            fix=f"apt-get install {dev_pkg} to build ops from source",
            required=required,
        )
    return CheckResult(name=name, status=Status.PASS, detail=f"{found}; {header_path}", required=required)
