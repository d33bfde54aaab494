"""DeepSpeed's compiled ops on this host, as ``ds_report`` lists them: for ``memascend doctor``.

Lives behind the seam because it reads DeepSpeed's ``op_builder`` (a DeepSpeed internal). Source:
DeepSpeed 0.19.8 ``deepspeed/env_report.py`` (``op_report``: ``ALL_OPS``, ``is_compatible``,
``git_version_info.installed_ops``) and ``OpBuilder.jit_load`` (a JIT-built op lands in
``$TORCH_EXTENSIONS_DIR/<op>/<op>.so``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

RUN_OPS = ("async_io", "pin_memory", "cpu_adam", "deepspeed_shm_comm")
"""The ops a memascend run loads (NVMe swapping, the CPU Adam, the CPU shared-memory collectives)."""


@dataclass(frozen=True)
class DeepSpeedOp:
    """One op of the accelerator's ``op_builder``.

    Attributes:
        name: DeepSpeed's op name (``async_io``).
        compatible: whether it can be built here (``OpBuilder.is_compatible``).
        installed: prebuilt into the DeepSpeed wheel (``DS_BUILD_OPS``) for the accelerator in use.
        cached: JIT-built already, under ``$TORCH_EXTENSIONS_DIR``.
        used_by_run: whether a memascend run loads it (:data:`RUN_OPS`).
    """

    name: str
    compatible: bool
    installed: bool
    cached: bool
    used_by_run: bool


def prebuilt_for_other_accelerator() -> tuple[str, str] | None:
    """``(built_for, running_on)`` when the DeepSpeed wheel's prebuilt ops were compiled for another
    accelerator than the one DeepSpeed picked here (the CUDA image on a host without a GPU: DeepSpeed
    falls back to its CPU accelerator), else None. DeepSpeed 0.19.8 loads a prebuilt op only when
    ``git_version_info.accelerator_name`` is the current accelerator's name (``OpBuilder.load``) and
    JIT-builds it otherwise.

    Raises:
        ImportError: DeepSpeed is not importable.
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    running_on = get_accelerator()._name
    if accelerator_name == running_on or not any(installed_ops.get(name) for name in RUN_OPS):
        return None
    return accelerator_name, running_on


def deepspeed_ops() -> list[DeepSpeedOp]:
    """Every op the accelerator's ``op_builder`` knows, with its state.

    Uses this environment's build folders (:func:`memascend.ops.build.configure_builds`), where
    ``install.sh`` built the ops.

    Raises:
        ImportError: DeepSpeed is not importable.
    """
    import contextlib
    import io

    from memascend.ops.build import configure_builds

    jit_root = configure_builds()  # the folder torch's JIT builds of DeepSpeed's ops go to
    # DeepSpeed prints while it looks for compilers; its compile probe (OpBuilder.has_function) dups
    # sys.stderr's file descriptor, which a captured stderr (click's test runner) does not have.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(sys.__stderr__ or sys.stderr):
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder.all_ops import ALL_OPS

        # Ops prebuilt for another accelerator are not loaded here: DeepSpeed JIT-builds them.
        usable_prebuilt = prebuilt_for_other_accelerator() is None

        out = []
        for name, builder in sorted(ALL_OPS.items()):
            if builder is None or name == "deepspeed_not_implemented":
                continue
            try:
                compatible = bool(builder.is_compatible(verbose=False))
            except Exception:  # noqa: BLE001 - a builder that cannot even check is not compatible
                compatible = False
            cached = any((jit_root / name).glob(f"{name}*.so"))
            out.append(DeepSpeedOp(name, compatible, usable_prebuilt and bool(installed_ops.get(name)), cached,
                                   name in RUN_OPS))
    return out
