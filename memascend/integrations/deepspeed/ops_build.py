"""Build DeepSpeed's JIT ops ahead of first use, with memascend's own: what ``install.sh`` runs.

``python3 -m memascend.integrations.deepspeed.ops_build`` builds every memascend op
(:func:`memascend.ops.build.build_all`) and then DeepSpeed's ops a run loads
(:func:`build_deepspeed_ops`), in this environment's guarded build folders
(:func:`memascend.ops.build.configure_builds`), so that no training process compiles on first use,
and then copies DeepSpeed's built ops into torch's default build folder for this Python and torch
(:func:`publish_to_stock_root`), where a stock DeepSpeed script, which knows nothing of memascend's
folders, looks for them: its first run then loads them instead of compiling for minutes.
It lives behind the seam because it calls DeepSpeed's ``op_builder`` (a DeepSpeed internal);
``python3 -m memascend.ops.build`` builds memascend's ops alone (the container image's build step).

Source: DeepSpeed 0.19.8 ``deepspeed/ops/op_builder`` (``OpBuilder.load`` JIT-builds an op not
prebuilt into the wheel, ``DS_BUILD_OPS``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from memascend.ops.build import build_all, configure_builds, report, torch_extensions_dir

_BUILD_STATE = ("lock", "memascend-build.pid")
"""Files of a build folder that belong to a build in progress, not to the built op (not copied)."""


def build_deepspeed_ops() -> list[tuple[str, bool, str]]:
    """Build DeepSpeed's ``async_io`` (and ``pin_memory``, which it loads first; ZeRO-Infinity's
    NVMe swappers) and the accelerator's ``CPUAdamBuilder`` and ``ShareMemCommBuilder`` ops where
    it has them (the accelerator's Adam: ``cpu_adam`` on the CPU; the CPU accelerator's
    shared-memory collectives), each built by the first training otherwise. An op DeepSpeed says
    is not compatible here (``async_io`` without libaio headers) is skipped.

    Returns:
        ``(label, ok, detail)`` per op, e.g. ``("deepspeed async_io", True, "built")``; ``ok`` is
        false only for an op that failed to build (``detail``: the last line of its error) or when
        DeepSpeed is not importable (one entry, ``"deepspeed ops"``); an op that cannot apply here
        is ok with a reason.
    """
    configure_builds()
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError as exc:
        return [("deepspeed ops", False, f"deepspeed is not importable: {exc}")]
    builders = [("deepspeed async_io", AsyncIOBuilder())]
    for name, label in (("CPUAdamBuilder", "deepspeed cpu_adam"), ("ShareMemCommBuilder", "deepspeed shm_comm")):
        builder = get_accelerator().create_op_builder(name)
        if builder is not None:
            builders.append((label, builder))
    results: list[tuple[str, bool, str]] = []
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


def stock_build_root() -> Path:
    """torch's default JIT build root for this Python and torch: where a stock DeepSpeed script run
    without ``TORCH_EXTENSIONS_DIR`` builds and looks for its ops,
    ``<user cache>/torch_extensions/py<XY>_<cpu|cuXYZ|rocmXY>`` (mirrors
    ``torch.utils.cpp_extension._get_build_directory``, without creating anything)."""
    import torch
    from torch.utils import cpp_extension

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(cpp_extension.get_default_build_root()) / f"{python}_{accelerator}"


def publish_to_stock_root(built_root: Path | None = None, stock_root: Path | None = None) -> list[tuple[str, bool, str]]:
    """Copy every op built in ``built_root`` (DeepSpeed's, in this environment's key folder) into
    ``stock_root`` (torch's default build root), so that a stock DeepSpeed script in this environment
    loads it instead of compiling it (torch then finds the same ``build.ninja`` and up-to-date
    outputs: ninja has nothing to do).

    Copies, not links: the default root is shared by every environment of this Python on the
    account, and another environment's build there must never write into this environment's
    folder. An op folder already in ``stock_root`` (built there, or copied by an earlier install) is
    left as it is; a copy goes to a temporary name first and is renamed into place, so a reader
    never sees half an op.

    Args:
        built_root: default :func:`memascend.ops.build.torch_extensions_dir`.
        stock_root: default :func:`stock_build_root`.

    Returns:
        ``(label, ok, detail)`` per op folder, e.g. ``("stock async_io", True, "copied to ...")``;
        nothing when both roots are one folder.
    """
    built_root = Path(built_root or torch_extensions_dir())
    stock_root = Path(stock_root or stock_build_root())
    if not built_root.is_dir() or built_root.resolve() == stock_root.resolve():
        return []
    results: list[tuple[str, bool, str]] = []
    for src in sorted(p for p in built_root.iterdir() if (p / f"{p.name}.so").is_file() and (p / "build.ninja").is_file()):
        label, dest = f"stock DeepSpeed {src.name}", stock_root / src.name
        if dest.exists():
            results.append((label, True, f"kept {dest} (already there)"))
            continue
        tmp = stock_root / f".{src.name}.memascend-copy-{os.getpid()}"
        try:
            stock_root.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(*_BUILD_STATE))
            os.rename(tmp, dest)
            results.append((label, True, f"copied to {dest}"))
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if dest.exists():  # another install published it meanwhile
                results.append((label, True, f"kept {dest} (already there)"))
            else:
                results.append((label, False, f"cannot copy to {dest}: {exc.strerror or exc}"))
    return results


def main(argv: list[str] | None = None) -> int:
    """``python3 -m memascend.integrations.deepspeed.ops_build``: build memascend's ops, then
    DeepSpeed's, and copy DeepSpeed's where a stock DeepSpeed script finds them (one line each on
    stderr); exit 1 if one failed, 2 on a usage error."""
    args = sys.argv[1:] if argv is None else argv
    if args:
        print("usage: python3 -m memascend.integrations.deepspeed.ops_build", file=sys.stderr)
        return 2
    built = build_all() + build_deepspeed_ops()
    return report(built + publish_to_stock_root())


if __name__ == "__main__":
    raise SystemExit(main())
