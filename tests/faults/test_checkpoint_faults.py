"""Checkpoints that never lie, and runs that survive kill -9 (issue 19, item 11 and "long runs").

Every run is llama-tiny from scratch, 32-token blocks, micro-batch 1 (~15-25 s on 2 cores). The
refusals happen before DeepSpeed starts (a few seconds of imports and tokenizing).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memascend.train import checkpoints as ckpt
from tests.conftest import run_cli

pytestmark = pytest.mark.faults

TINY = ["--from-scratch", "llama-tiny", "--seq-len", "32", "--micro-batch", "1", "--eval-blocks", "1",
        "--no-save-model"]
STEPS = 6


def _finetune(tmp: Path, out: str, *extra: str, nvme: str = "swap") -> dict:
    proc = run_cli(["finetune", *TINY, "--output", str(tmp / out), "--nvme-path", str(tmp / nvme), *extra],
                   tmp, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / out / "report.json").read_text())


def _losses(rep: dict) -> dict[int, float]:
    return {s["step"]: s["loss"] for s in rep["steps"]}


def _one_line(proc, code: int, *needles: str) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """An uninterrupted run; a run with a checkpoint every 2 steps killed with SIGKILL after its
    first checkpoint; a 2-step raw-store run with --save-checkpoint."""
    tmp = tmp_path_factory.mktemp("ckfaults")
    straight = _finetune(tmp, "straight", "--steps", str(STEPS))
    out = tmp / "killed"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "THP_MEM_ALLOC_ENABLE"):
        env.pop(key, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "memascend", "finetune", *TINY, "--steps", str(STEPS), "--checkpoint-every", "2",
         "--keep-checkpoints", "2", "--output", str(out), "--nvme-path", str(tmp / "swap")],
        cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    first = ckpt.periodic_root(out) / "global_step2"
    deadline = time.monotonic() + 400
    while not first.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.is_dir(), (proc.poll(), proc.stderr.read()[-3000:] if proc.poll() is not None else "")
    # mid-step 3 (or later): a power cut. The whole process group, so the training process dies
    # too whether or not a supervising parent runs it.
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    store = _finetune(tmp, "store2", "--steps", "2", "--save-checkpoint", str(tmp / "ck_store"), nvme="r.store")
    return {"tmp": tmp, "straight": straight, "killed": out, "killed_rc": proc.returncode, "store2": store}


def _resume_losses_bit_equal(resumed: dict, straight: dict, start: int) -> None:
    """Every resumed step's loss equals the uninterrupted run's bit for bit (fix_exact_resume)."""
    got, want = _losses(resumed), _losses(straight)
    assert sorted(got) == list(range(start + 1, STEPS + 1))
    assert {s: got[s].hex() for s in got} == {s: want[s].hex() for s in got}


def test_kill9_mid_run_then_resume_auto(runs):
    """kill -9 after a periodic checkpoint, then the same command with --resume auto continues
    from the newest complete checkpoint with per-step losses bit-equal to the uninterrupted run's;
    a half-written one (staging folder, tag folder without its manifest) is never picked;
    --keep-checkpoints holds."""
    tmp, out = runs["tmp"], runs["killed"]
    assert runs["killed_rc"] == -signal.SIGKILL
    root = ckpt.periodic_root(out)
    newest = ckpt.complete_checkpoints(root)[-1]
    # what a kill during a save leaves, and a newer tag folder whose save never finished
    partial = root / f"{ckpt.PARTIAL_PREFIX}global_step{newest.step + 2}-20261125-000000-999999999"
    (partial / f"global_step{newest.step + 2}").mkdir(parents=True)
    half = root / f"global_step{newest.step + 1}"
    shutil.copytree(newest.path, half)
    (half / ckpt.MANIFEST_NAME).unlink()
    rep = _finetune(tmp, "killed", "--steps", str(STEPS), "--checkpoint-every", "2", "--keep-checkpoints", "2",
                    "--resume", "auto")
    assert rep["checkpoint"]["start_step"] == newest.step
    assert rep["checkpoint"]["resumed_from"].endswith(newest.tag)
    _resume_losses_bit_equal(rep, runs["straight"], newest.step)
    # the newest two complete checkpoints kept; the foreign half-written folder left alone
    assert [c.step for c in ckpt.complete_checkpoints(root)] == [STEPS - 2, STEPS]
    assert (root / "latest").read_text() == f"global_step{STEPS}"
    assert half.is_dir()


def test_explicit_resume_of_half_written_checkpoint_refused(runs, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(ckpt.periodic_root(runs["killed"]), ck)
    tag = (ck / "latest").read_text()
    (ck / tag / ckpt.MANIFEST_NAME).unlink()
    proc = run_cli(["finetune", *TINY, "--steps", str(STEPS + 2), "--output", str(tmp_path / "o"),
                    "--nvme-path", str(tmp_path / "swap"), "--resume", str(ck)], tmp_path, timeout_s=600)
    _one_line(proc, 2, f"{tag} is incomplete: no {ckpt.MANIFEST_NAME}")
    assert not (tmp_path / "o").exists()


def _store_ck(runs, tmp_path) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(runs["tmp"] / "ck_store", ck)
    return ck


def test_store_checkpoint_with_unfinished_export_refused(runs, tmp_path):
    """Before: a raw-store checkpoint whose export never finished resumed from fresh weights, exit 0."""
    ck = _store_ck(runs, tmp_path)
    (ck / "global_step2" / "memascend_store" / "rank00" / "manifest.json").unlink()
    args = ["finetune", *TINY, "--steps", "4", "--output", str(tmp_path / "o"), "--nvme-path", str(tmp_path / "r.store"),
            "--resume", str(ck)]
    _one_line(run_cli(args, tmp_path, timeout_s=600), 4, "memascend_store/rank00/manifest.json is missing")
    # a checkpoint from before the manifest (or a save killed before it): refused as incomplete
    (ck / "global_step2" / ckpt.MANIFEST_NAME).unlink()
    _one_line(run_cli(args, tmp_path, timeout_s=600), 2, "is incomplete")
    assert not (tmp_path / "r.store").exists() and not (tmp_path / "o").exists()


def test_flipped_exponent_bit_in_swapped_fp32_tensor_detected(runs, tmp_path):
    """Before: a folder checkpoint with one flipped exponent bit trained at loss=inf, exit 0."""
    ck = tmp_path / "ck"
    shutil.copytree(ckpt.periodic_root(runs["killed"]), ck)
    tag = (ck / "latest").read_text()
    master = next(p for p in (ck / tag / "offloaded_tensors" / "rank00").glob("*.swp") if "exp_avg" not in p.name)
    with open(master, "r+b") as f:
        f.seek(4 * 1000 + 3)  # element 1000's byte with the sign and the top exponent bits
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    proc = run_cli(["finetune", *TINY, "--steps", str(STEPS + 2), "--output", str(tmp_path / "o"),
                    "--nvme-path", str(tmp_path / "swap"), "--resume", str(ck)], tmp_path, timeout_s=600)
    _one_line(proc, 4, f"{master.name} is corrupt", "bytes 0..")
    assert not (tmp_path / "o").exists()


def test_corrupt_model_states_detected(runs, tmp_path):
    ck = _store_ck(runs, tmp_path)
    states = next((ck / "global_step2").glob("*model_states.pt"))
    states.write_bytes(states.read_bytes()[:100] + b"garbage")
    proc = run_cli(["finetune", *TINY, "--steps", "4", "--output", str(tmp_path / "o"),
                    "--nvme-path", str(tmp_path / "swap"), "--resume", str(ck)], tmp_path, timeout_s=600)
    _one_line(proc, 4, states.name, "manifest says")


def test_resume_into_another_model_refused(runs, tmp_path):
    """Before: trained garbage on a raw store; DeepSpeed aborted (SIGABRT) on a swap folder."""
    ck = ckpt.periodic_root(runs["killed"])
    wider = ["--from-scratch", "hidden=128,layers=2,heads=4,vocab=49152"]
    args = [a for a in TINY if a not in ("--from-scratch", "llama-tiny")]
    proc = run_cli(["finetune", *args, *wider, "--steps", str(STEPS + 2), "--output", str(tmp_path / "o"),
                    "--nvme-path", str(tmp_path / "swap"), "--resume", str(ck)], tmp_path, timeout_s=600)
    _one_line(proc, 2, "was saved for a different model: parameter model.embed_tokens.weight is [49152, 64] in the "
              "checkpoint, [49152, 128] in this model")
    proc = run_cli(["finetune", *TINY, "--dtype", "fp32", "--steps", str(STEPS + 2), "--output", str(tmp_path / "o"),
                    "--nvme-path", str(tmp_path / "swap"), "--resume", str(ck)], tmp_path, timeout_s=600)
    _one_line(proc, 2, "was saved with --dtype bf16; this run uses fp32")
    assert not (tmp_path / "o").exists() and not any((tmp_path / "swap").glob("memascend-*"))


def test_nonfinite_loss_stops_run_without_saving(tmp_path):
    """Before: fp32 with a diverging learning rate trained to NaN and exited 0, model saved."""
    args = ["finetune", "--from-scratch", "llama-tiny", "--seq-len", "32", "--micro-batch", "1", "--eval-blocks", "1",
            "--dtype", "fp32", "--lr", "1e38", "--steps", "3", "--output", str(tmp_path / "o"),
            "--nvme-path", str(tmp_path / "swap"), "--save-checkpoint", str(tmp_path / "ck")]
    proc = run_cli(args, tmp_path, timeout_s=600)
    _one_line(proc, 5, "step 2: the training loss is nan", "--allow-nonfinite-loss")
    assert not (tmp_path / "o" / "model").exists() and not (tmp_path / "ck").exists()


@pytest.fixture
def tmpfs(tmp_path):
    mounts = []

    def make(name: str, *opts: str) -> Path:
        mnt = tmp_path / name
        mnt.mkdir()
        opts = opts if any(o.startswith("size=") for o in opts) else ("size=4m", *opts)
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(opts), "tmpfs", str(mnt)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {res.stderr.strip()}")
        mounts.append(mnt)
        return mnt

    yield make
    for mnt in mounts:
        subprocess.run(["umount", str(mnt)], check=False)


def test_read_only_or_too_small_checkpoint_folder_refused_before_training(tmp_path, tmpfs):
    """Before: found only after training (a traceback, the training lost)."""
    ro, small = tmpfs("ro", "ro"), tmpfs("small")
    base = ["finetune", *TINY, "--steps", "2", "--output", str(tmp_path / "o"), "--nvme-path", str(tmp_path / "swap")]
    t0 = time.monotonic()
    proc = run_cli([*base, "--save-checkpoint", str(ro / "ck")], tmp_path, timeout_s=600)
    _one_line(proc, 2, f"--save-checkpoint {ro / 'ck'} is not writable", "Read-only file system")
    proc = run_cli([*base, "--save-checkpoint", str(small / "ck")], tmp_path, timeout_s=600)
    _one_line(proc, 2, f"--save-checkpoint {small / 'ck'} has 4.00 MiB free; a checkpoint of this run needs about")
    assert list(small.iterdir()) == [] and not (tmp_path / "o").exists()
    assert not (tmp_path / "swap").exists() or not any((tmp_path / "swap").glob("memascend-*"))
    assert time.monotonic() - t0 < 120  # refused up front, not after training


def test_disk_full_during_periodic_save_keeps_last_checkpoint(tmp_path, tmpfs):
    """The up-front space check passed, then something else filled the disk: the failing save is
    one line (exit 3), leaves no staging folder, and the previous checkpoint stays complete and named
    by ``latest``."""
    out = tmp_path / "o"
    out.mkdir()
    mnt = tmpfs("ckfs", "size=300m")
    root = ckpt.periodic_root(out)
    root.mkdir()
    subprocess.run(["mount", "--bind", str(mnt), str(root)], check=True)
    try:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "THP_MEM_ALLOC_ENABLE")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "memascend", "finetune", *TINY, "--steps", "6", "--checkpoint-every", "2",
             "--keep-checkpoints", "1", "--output", str(out), "--nvme-path", str(tmp_path / "swap")],
            cwd=tmp_path, env={**env, "PYTHONWARNINGS": "ignore"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 400
        while not (root / "global_step2").is_dir() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (root / "global_step2").is_dir(), proc.stderr.read()[-3000:] if proc.poll() is not None else ""
        with open(mnt / "filler", "wb") as f:  # another program takes all but 1 MiB
            os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(mnt).free - (1 << 20))
        _, stderr = proc.communicate(timeout=400)
        _one_line(subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr), 3,
                  "saving checkpoint", "No space left on device", "global_step2, is intact")
        assert sorted(p.name for p in root.iterdir()) == ["filler", "global_step2", "latest"]
        assert (root / "latest").read_text() == "global_step2"
        ckpt.verify_checkpoint(ckpt.resolve_resume("auto", out))
    finally:
        subprocess.run(["umount", str(root)], check=False)


@pytest.mark.slow  # ~100 s on 2 busy cores (two-rank resume exactness: tests/integrations/test_exact_resume.py)
@pytest.mark.distributed
def test_two_ranks_periodic_checkpoint_resume_auto(tmp_path):
    """Two ranks: one checkpoint holds both ranks' files in its manifest; --resume auto continues
    with both; one rank is refused. (Two-rank loss equality after resume: the exact-resume tests.)"""
    _finetune(tmp_path, "o", "--steps", "2", "--checkpoint-every", "2", "--nproc", "2")
    found = ckpt.resolve_resume("auto", tmp_path / "o")
    assert found.step == 2 and found.manifest["world_size"] == 2
    files = found.manifest["files"]
    assert any("rank00" in f for f in files) and any("rank01" in f for f in files)
    resumed = _finetune(tmp_path, "o", "--steps", "3", "--checkpoint-every", "2", "--resume", "auto", "--nproc", "2")
    assert resumed["checkpoint"]["start_step"] == 2 and sorted(_losses(resumed)) == [3]
    assert resumed["checkpoint"]["periodic_saved"] == []  # step 3 is not a multiple of 2
    proc = run_cli(["finetune", *TINY, "--steps", "3", "--output", str(tmp_path / "o"), "--nvme-path",
                    str(tmp_path / "swap"), "--resume", "auto"], tmp_path, timeout_s=600)
    _one_line(proc, 2, "saved by 2 rank(s); this run has 1: resume with --nproc 2")
