"""Golden regression results per hardware profile: ``baselines/<profile>/<matrix>.json``.

A hardware profile names the kind of machine the numbers were measured on (memory peaks and step
times are only comparable on the same kind): ``cpu-<cores>c-<GiB>g`` on a CPU-only host,
``<gpu name>-x<count>`` where CUDA devices are visible. ``MEMASCEND_HW_PROFILE`` overrides it.

Within one profile the CPU's instruction set still decides the bits of a CPU run's losses: torch's
bf16 matmuls dispatch to AMX, AVX-512-BF16, AVX-512 or AVX2 kernels, which round differently (the
same code and seed give a different step-1 loss under each ``ONEDNN_MAX_CPU_ISA``). Every golden
entry therefore records :func:`cpu_isa`, and its losses are compared only on a host with the same one.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import psutil

GOLDEN_VERSION = 1
PROFILE_ENV = "MEMASCEND_HW_PROFILE"


def hardware_profile() -> str:
    """The profile name of this host (see module docstring)."""
    env = os.environ.get(PROFILE_ENV)
    if env:
        return env
    gpu = _gpu_profile()
    if gpu:
        return gpu
    mem_gib = round(psutil.virtual_memory().total / 2**30)
    return f"cpu-{psutil.cpu_count()}c-{mem_gib}g"


def cpu_isa() -> str:
    """The CPU kernel level torch dispatches to on this host: ``torch.backends.cpu.get_cpu_capability()``
    lower-cased (``avx512``, ``avx2``, ...), with ``+amx`` where the CPU has AMX-BF16 tiles (oneDNN's
    bf16 matmuls use them). ``unknown`` when torch cannot say."""
    try:
        import torch

        isa = torch.backends.cpu.get_cpu_capability().lower()
    except Exception:  # noqa: BLE001 - an old torch without the query
        return "unknown"
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        flags = []
    return isa + ("+amx" if "amx_bf16" in flags else "")


def _gpu_profile() -> str | None:
    try:
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return None
        name = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - no usable CUDA: a CPU profile
        return None
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"{slug}-x{torch.cuda.device_count()}"


def golden_path(baselines_dir: Path, profile: str, matrix: str) -> Path:
    return Path(baselines_dir) / profile / f"{matrix}.json"


def golden_key(config_name: str, report: dict | None) -> str:
    """The key of a configuration's golden entry for the swap target its run used.

    Memory and step time differ between a swap folder and memascend's raw store (a store file or a
    block device: its own extents and I/O path), so each kind has its own entry: ``<config>`` for a
    swap folder (and reports that do not record the kind), ``<config>@store_file`` or
    ``<config>@block_device`` otherwise. The kind is read from the report's
    ``memory.ranks[].swap_kind`` (:func:`memascend.train.report.rank_record`).
    """
    ranks = ((report or {}).get("memory") or {}).get("ranks") or []
    kinds = sorted({r.get("swap_kind") for r in ranks} - {None, "folder"})
    return f"{config_name}@{kinds[0]}" if kinds else config_name


def load_golden(path: Path) -> dict[str, dict]:
    """``{config name: golden entry}`` from a golden file; empty when the file does not exist."""
    path = Path(path)
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return dict(data.get("configs", {}))


def save_golden(path: Path, profile: str, matrix: str, entries: dict[str, dict], commands: dict[str, dict]) -> None:
    """Merge ``entries`` into the golden file (configs not rerun keep their old entry)."""
    path = Path(path)
    old = json.loads(path.read_text()) if path.is_file() else {}
    configs = dict(old.get("configs", {}))
    configs.update(entries)
    cmds = dict(old.get("commands", {}))
    cmds.update(commands)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"golden_version": GOLDEN_VERSION, "profile": profile, "matrix": matrix,
                                "configs": configs, "commands": cmds}, indent=2, sort_keys=True) + "\n")
