"""``memascend finetune --nvme-path FILE.store|/dev/X``: the raw store under DeepSpeed's swappers.

Tiny from-scratch model (llama-tiny: its 3.1M-element embedding is the one partition above
DeepSpeed's 1 MiB swap threshold, so parameters and the whole optimizer state go through the
store), 32-token sequences: each run takes ~20 s on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from memascend.train import checkpoints as ckpt
from tests.conftest import run_cli

TINY = ["--from-scratch", "llama-tiny", "--seq-len", "32", "--micro-batch", "2", "--eval-blocks", "2",
        "--no-save-model", "--dtype", "bf16"]


def _finetune(tmp: Path, name: str, nvme: str, *extra: str) -> dict:
    out = tmp / name
    proc = run_cli(["finetune", *TINY, "--output", str(out), "--nvme-path", nvme, *extra], tmp, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def _losses(rep: dict) -> dict[int, float]:
    return {s["step"]: s["loss"] for s in rep["steps"]}


def _refused(proc, match: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert len(lines) == 1 and match in lines[0], proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Uninterrupted 4 steps and 2 + resume 2, on the folder store and on a store file."""
    tmp = tmp_path_factory.mktemp("rawstore")
    folder, store = str(tmp / "swap"), str(tmp / "run.store")
    reps = {
        "folder4": _finetune(tmp, "folder4", folder, "--steps", "4"),
        "store4": _finetune(tmp, "store4", store, "--steps", "4"),
        "folder2": _finetune(tmp, "folder2", folder, "--steps", "2", "--save-checkpoint", str(tmp / "ck_folder")),
        "store2": _finetune(tmp, "store2", store, "--steps", "2", "--save-checkpoint", str(tmp / "ck_store")),
    }
    reps["folder_resumed"] = _finetune(tmp, "folder_r", folder, "--steps", "4", "--resume", str(tmp / "ck_folder"))
    reps["store_resumed"] = _finetune(tmp, "store_r", store, "--steps", "4", "--resume", str(tmp / "ck_store"))
    # across kinds: a folder run resumes the raw-store checkpoint, a raw-store run the folder one
    reps["folder_from_store"] = _finetune(tmp, "folder_fs", folder, "--steps", "4", "--resume", str(tmp / "ck_store"))
    reps["store_from_folder"] = _finetune(tmp, "store_sf", store, "--steps", "4", "--resume", str(tmp / "ck_folder"))
    reps["_tmp"] = {"path": str(tmp)}
    return reps


def test_store_file_losses_identical_to_folder(runs):
    folder, store = runs["folder4"], runs["store4"]
    assert _losses(store) == _losses(folder) and len(_losses(store)) == 4
    sect = store["nvme"]["store"]
    assert store["nvme"]["backend"] == "raw_store" and folder["nvme"]["backend"] == "folder"
    assert sect["kind"] == "file" and sect["enable_crc"] is True and sect["direct_io"] is True
    assert sect["backend"] in ("io_uring", "libaio")
    # fp32 master + 2 Adam moments + gradient of the 3.1M-element partition, bf16 embedding: > 40 MB
    assert sect["peak_used_bytes"] > 40e6 and sect["tensors"] >= 4
    assert not (Path(runs["_tmp"]["path"]) / "run.store").exists()  # file target deleted at exit
    # the store's own counters of the training window: O_DIRECT, so /proc/self/io sees at least
    # them; the swap payload is the folder run's (same buffers), device bytes add only the 4 KiB
    # padding of buffers that are 512- but not 4096-aligned (raw_store module doc)
    io = sect["train_io_bytes"]
    for op in ("read", "write"):
        payload, device = io[f"payload_{op}_bytes"], io[f"{op}_bytes"]
        assert 0 < payload <= device <= store["nvme"][f"{op}_bytes"]
        assert payload <= folder["nvme"][f"{op}_bytes"]
        assert (device - payload) % 512 == 0 and device - payload < 1e-3 * payload
    assert sect["io_bytes"]["write_bytes"] >= io["write_bytes"] + 4096  # + header and table


def test_resume_from_store_checkpoint(runs):
    tmp = Path(runs["_tmp"]["path"])
    export = tmp / "ck_store" / "global_step2" / "memascend_store" / "rank00"
    manifest = json.loads((export / "manifest.json").read_text())["tensors"]
    keys = sorted(e["key"] for e in manifest)
    # the same tensors stock's copytree puts into the folder-store checkpoint
    stock = tmp / "ck_folder" / "global_step2" / "offloaded_tensors" / "rank00"
    assert all(k.startswith("zero_stage_3/optimizer/rank0/") for k in keys)
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == sorted(p.name for p in stock.glob("*.swp")) != []
    assert runs["store2"]["nvme"]["store"]["checkpoint_exported_tensors"] == len(keys)
    resumed = runs["store_resumed"]
    assert resumed["checkpoint"]["start_step"] == 2 and sorted(_losses(resumed)) == [3, 4]
    assert resumed["nvme"]["store"]["checkpoint_imported_tensors"] == len(keys)
    # Stock 0.19.8 resume with the optimizer on NVMe: the raw store reproduces it exactly
    assert _losses(resumed) == _losses(runs["folder_resumed"])
    # ... and step 3 (before any post-resume update) equals the uninterrupted run's
    assert _losses(resumed)[3] == _losses(runs["store4"])[3]


def test_resume_across_folder_and_store_checkpoints(runs):
    """Either kind of checkpoint resumes into either kind of run, with the same losses."""
    tmp = Path(runs["_tmp"]["path"])
    want = _losses(runs["folder_resumed"])
    assert sorted(want) == [3, 4]
    folder_from_store, store_from_folder = runs["folder_from_store"], runs["store_from_folder"]
    assert folder_from_store["checkpoint"]["start_step"] == 2 and _losses(folder_from_store) == want
    assert store_from_folder["checkpoint"]["start_step"] == 2 and _losses(store_from_folder) == want
    stock = sorted((tmp / "ck_folder" / "global_step2" / "offloaded_tensors" / "rank00").glob("*.swp"))
    assert store_from_folder["nvme"]["store"]["checkpoint_imported_tensors"] == len(stock) > 0
    assert folder_from_store["nvme"]["backend"] == "folder"


@pytest.mark.parametrize("nvme", ["swap", "r.store"])
def test_resume_of_checkpoint_without_nvme_optimizer_state_is_refused(runs, tmp_path, nvme):
    ck = tmp_path / "ck"
    shutil.copytree(Path(runs["_tmp"]["path"]) / "ck_folder", ck)
    shutil.rmtree(ck / "global_step2" / "offloaded_tensors")  # as saved with the optimizer in DRAM
    # ... by a memascend save, whose manifest then lists no such files (deleting files a manifest
    # lists is a damaged checkpoint: tests/faults/test_checkpoint_faults.py)
    manifest = ckpt.read_manifest(ck / "global_step2")
    ckpt.write_manifest(ck / "global_step2", {k: v for k, v in manifest.items()
                                              if k not in ("files", "format", "complete", "created_unix")})
    proc = run_cli(["finetune", *TINY, "--steps", "4", "--output", str(tmp_path / "o"),
                    "--nvme-path", str(tmp_path / nvme), "--resume", str(ck)], tmp_path, timeout_s=600)
    _refused(proc, "holds no NVMe optimizer state for rank 0")
    assert "resume it with the same --offload settings" in proc.stderr
    assert not (tmp_path / "r.store").exists() and not (tmp_path / "o").exists()
    assert not (tmp_path / "swap").exists() or not any((tmp_path / "swap").iterdir())


@pytest.mark.skipif(shutil.which("mkfs.ext4") is None, reason="needs mkfs.ext4 (e2fsprogs)")
def test_ext4_target_refused_untouched_then_overwritten(tmp_path):
    target = tmp_path / "fs.store"
    with open(target, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 256 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(target)], check=True)
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    proc = run_cli(["finetune", *TINY, "--steps", "1", "--output", str(tmp_path / "o"),
                    "--nvme-path", str(target)], tmp_path, timeout_s=600)
    _refused(proc, "carries a ext2/3/4 filesystem")
    assert hashlib.sha256(target.read_bytes()).hexdigest() == digest
    assert not (tmp_path / "o").exists()
    rep = _finetune(tmp_path, "o2", str(target), "--steps", "1", "--nvme-overwrite", "--no-crc")
    assert rep["nvme"]["store"]["enable_crc"] is False and len(rep["steps"]) == 1
    # the user's file, overwritten as they said, is theirs: kept at exit (memascend deletes only
    # store files it created)
    assert target.is_file() and target.stat().st_size >= 256 << 20


@pytest.mark.distributed
def test_two_ranks_one_store_each(tmp_path):
    rep = _finetune(tmp_path, "o", str(tmp_path / "two.store"), "--steps", "2", "--nproc", "2")
    ranks = {r["rank"]: r for r in rep["nvme"]["store_ranks"]}
    assert ranks[0]["target"] == str(tmp_path / "two.store.rank0")
    assert ranks[1]["target"] == str(tmp_path / "two.store.rank1")
    assert all(r["peak_used_bytes"] > 10e6 for r in ranks.values())
    assert len(rep["steps"]) == 2 and not list(tmp_path.glob("two.store*"))
