"""Build DeepSpeed's JIT ops ahead of first use, with memascend's own: what ``install.sh`` runs.

``python3 -m memascend.integrations.deepspeed.ops_build`` builds every memascend op
(:func:`memascend.ops.build.build_all`) and then DeepSpeed's ops a run loads
(:func:`build_deepspeed_ops`), in this environment's guarded build folders
(:func:`memascend.ops.build.configure_builds`), so that no training process compiles on first use.
It lives behind the seam because it calls DeepSpeed's ``op_builder`` (a DeepSpeed internal);
``python3 -m memascend.ops.build`` builds memascend's ops alone (the container image's build step).

Source: DeepSpeed 0.19.8 ``deepspeed/ops/op_builder`` (``OpBuilder.load`` JIT-builds an op not
prebuilt into the wheel, ``DS_BUILD_OPS``).
"""

from __future__ import annotations

import sys

from memascend.ops.build import build_all, configure_builds, report


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


def main(argv: list[str] | None = None) -> int:
    """``python3 -m memascend.integrations.deepspeed.ops_build``: build memascend's ops, then
    DeepSpeed's (one line each on stderr); exit 1 if one failed, 2 on a usage error."""
    args = sys.argv[1:] if argv is None else argv
    if args:
        print("usage: python3 -m memascend.integrations.deepspeed.ops_build", file=sys.stderr)
        return 2
    return report(build_all() + build_deepspeed_ops())


if __name__ == "__main__":
    raise SystemExit(main())
