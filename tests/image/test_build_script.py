"""images/build.sh checks its tools before it builds anything and leaves no debootstrap tree behind
when making the --local-base base fails (fake tools on a PATH of our own; nothing is built)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "images" / "build.sh"
# What build.sh itself calls besides the container tools.
BASE_TOOLS = ("bash", "dirname", "find", "sort", "xargs", "sha256sum", "cut", "awk", "rm", "mktemp", "tar", "cat")


def _bin(tmp_path: Path, fakes: dict[str, str]) -> Path:
    """A PATH folder with the real base tools linked in and the given fake scripts (name -> body)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in BASE_TOOLS:
        real = shutil.which(tool)
        if real is None:
            pytest.skip(f"needs {tool}")
        (bin_dir / tool).symlink_to(real)
    for name, body in fakes.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _build(bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(bin_dir), "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run([str(bin_dir / "bash"), str(BUILD), *args], capture_output=True, text=True, env=env,
                          timeout=60)


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_local_base_without_podman_names_it_and_exits_2(tmp_path, variant):
    """Both variants build on the local Debian base (the CUDA one takes torch and nvcc from PyPI)."""
    run = _build(_bin(tmp_path, {"buildah": "exit 0", "debootstrap": "exit 0"}), "--local-base", variant)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "build.sh: needs podman (--local-base keeps its base image in podman's storage: apt-get install podman)"
    ]


def test_local_base_without_debootstrap_when_the_base_is_missing(tmp_path):
    fakes = {"podman": "exit 1", "buildah": "exit 0"}  # `podman image exists` says no
    run = _build(_bin(tmp_path, fakes), "--local-base", "cpu")
    assert run.returncode == 2 and "build.sh: needs debootstrap" in run.stderr


def test_without_docker_or_buildah_names_buildah(tmp_path):
    run = _build(_bin(tmp_path, {}), "cpu")
    assert run.returncode == 2
    assert run.stderr.strip() == "build.sh: needs buildah (no running Docker engine; apt-get install buildah, or start Docker)"


def test_failed_debootstrap_leaves_no_rootfs_behind(tmp_path):
    seen = tmp_path / "rootfs-path"
    fakes = {
        "podman": "exit 1",
        "buildah": "echo buildah must not run >&2; exit 1",
        # debootstrap --variant=minbase bookworm ROOTFS MIRROR: half a tree, then a failure
        "debootstrap": f'echo "$3" > {seen}; mkdir -p "$3/usr/bin"; touch "$3/usr/bin/half"; exit 1',
    }
    run = _build(_bin(tmp_path, fakes), "--local-base", "cpu")
    assert run.returncode == 1, run.stderr
    rootfs = Path(seen.read_text().strip())
    assert rootfs.name.startswith("memascend-rootfs.") and rootfs.parent == Path("/var/tmp")
    assert not rootfs.exists(), f"{rootfs} left behind"
    assert "buildah must not run" not in run.stderr
