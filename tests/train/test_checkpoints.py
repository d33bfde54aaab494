"""Checkpoint lifecycle (memascend/train/checkpoints.py) without DeepSpeed: a fake engine writes
the files DeepSpeed's save would, so atomicity, manifests, verification, picking and pruning are
checked in milliseconds. The DeepSpeed runs are in tests/faults/test_checkpoint_faults.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from memascend.errors import DeviceError, IntegrityError, TrainingError, UserError
from memascend.train import checkpoints as ckpt
from memascend.train.checkpoints import manifest
from memascend.train.evaluation import check_finite_loss

INFO = {"dtype": "bf16", "world_size": 1, "param_shapes": {"emb.weight": [10, 4], "head.weight": [4, 10]}}


class FakeEngine:
    """Writes what DeepSpeed 0.19.8's save_checkpoint writes (tag folder, a model-states file, an
    optimizer swap file); ``fail_after`` raises after that many files, like a save killed mid-way."""

    def __init__(self, step: int, fail_after: int | None = None) -> None:
        self.global_steps = step
        self.fail_after = fail_after
        self.calls = []

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        self.calls.append({"save_dir": save_dir, "tag": tag, "save_latest": save_latest})
        tag_dir = Path(save_dir) / tag
        (tag_dir / "offloaded_tensors" / "rank00").mkdir(parents=True)
        files = [
            (tag_dir / "mp_rank_00_model_states.pt", os.urandom(3000)),
            (tag_dir / "offloaded_tensors" / "rank00" / "0_exp_avg.tensor.swp", os.urandom(5000)),
        ]
        for i, (path, data) in enumerate(files):
            if self.fail_after is not None and i >= self.fail_after:
                raise OSError(28, "No space left on device")
            path.write_bytes(data)
        if save_latest:
            (Path(save_dir) / "latest").write_text(tag)


def _save(root: Path, step: int, **kw) -> ckpt.Checkpoint:
    return ckpt.save_checkpoint(FakeEngine(step, **kw), root, run_id=f"20261125-120000-{os.getpid()}",
                                info=INFO, rank=0)


def test_save_is_atomic_and_names_latest_last(tmp_path):
    root = tmp_path / "ck"
    saved = _save(root, 3)
    assert saved.tag == "global_step3" and saved.path == root / "global_step3"
    assert (root / "latest").read_text() == "global_step3"
    # DeepSpeed was told not to write 'latest' itself, and saved into a staging folder
    assert sorted(p.name for p in root.iterdir()) == ["global_step3", "latest"]
    manifest = json.loads((root / "global_step3" / ckpt.MANIFEST_NAME).read_text())
    assert manifest["complete"] is True and manifest["step"] == 3 and manifest["param_shapes"] == INFO["param_shapes"]
    assert sorted(manifest["files"]) == ["mp_rank_00_model_states.pt", "offloaded_tensors/rank00/0_exp_avg.tensor.swp"]
    assert manifest["files"]["mp_rank_00_model_states.pt"]["bytes"] == 3000
    ckpt.verify_files(ckpt.resolve_resume(str(root), tmp_path))


def test_fake_engine_told_save_latest_false(tmp_path):
    eng = FakeEngine(1)
    ckpt.save_checkpoint(eng, tmp_path / "ck", run_id="20261125-120000-1", info=INFO, rank=0)
    assert eng.calls[0]["save_latest"] is False
    assert Path(eng.calls[0]["save_dir"]).name.startswith(ckpt.PARTIAL_PREFIX)


def test_failed_save_leaves_previous_checkpoint_and_latest(tmp_path):
    root = tmp_path / "ck"
    with pytest.raises(DeviceError, match=r"global_step1 failed: No space left on device; .*no earlier checkpoint"):
        _save(root, 1, fail_after=0)
    _save(root, 2)
    with pytest.raises(DeviceError, match=r"global_step4 failed: No space left on device; nothing of it was kept "
                       r"\(the last complete checkpoint, .*global_step2, is intact\)") as info:
        _save(root, 4, fail_after=1)
    assert info.value.exit_code == 3
    assert (root / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in root.iterdir()) == ["global_step2", "latest"]
    assert ckpt.resolve_resume(str(root), tmp_path).step == 2


def test_partial_of_dead_process_is_never_picked_and_cleaned_by_next_save(tmp_path):
    out = tmp_path / "out"
    root = ckpt.periodic_root(out)
    _save(root, 2)
    # what a save killed with SIGKILL leaves: a staging folder named after a pid that is gone
    dead = subprocess.Popen(["true"])
    dead.wait()
    partial = root / f"{ckpt.PARTIAL_PREFIX}global_step4-20261125-120000-{dead.pid}"
    (partial / "global_step4").mkdir(parents=True)
    (partial / "global_step4" / "mp_rank_00_model_states.pt").write_bytes(b"half")
    # and a tag folder without its manifest (e.g. copied by hand, or written by stock DeepSpeed)
    (root / "global_step5").mkdir()
    (root / "global_step5" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    assert ckpt.resolve_resume("auto", out).tag == "global_step2"
    _save(root, 6)
    assert not partial.exists()
    assert (root / "global_step5").exists()  # not memascend's: left alone
    assert ckpt.resolve_resume("auto", out).tag == "global_step6"


def test_auto_without_checkpoints_starts_fresh(tmp_path):
    assert ckpt.resolve_resume("auto", tmp_path / "nothing") is None


def test_explicit_resume_of_incomplete_checkpoint_refused(tmp_path):
    root = tmp_path / "ck"
    _save(root, 2)
    (root / "global_step2" / ckpt.MANIFEST_NAME).unlink()
    with pytest.raises(UserError, match=r"global_step2 is incomplete: no memascend_checkpoint.json"):
        ckpt.resolve_resume(str(root), tmp_path)
    (root / "latest").write_text("global_step9")
    with pytest.raises(UserError, match="names 'global_step9', which is not a folder there"):
        ckpt.resolve_resume(str(root), tmp_path)
    with pytest.raises(UserError, match="no checkpoint there"):
        ckpt.resolve_resume(str(tmp_path), tmp_path)


def test_tag_folder_resumed_directly(tmp_path):
    _save(tmp_path / "ck", 3)
    found = ckpt.resolve_resume(str(tmp_path / "ck" / "global_step3"), tmp_path)
    assert found.load_dir == tmp_path / "ck" and found.tag == "global_step3"


def test_flipped_bit_and_truncation_detected_naming_file_and_range(tmp_path):
    found = _save(tmp_path / "ck", 2)
    swp = found.path / "offloaded_tensors" / "rank00" / "0_exp_avg.tensor.swp"
    data = bytearray(swp.read_bytes())
    data[1234] ^= 0x40  # one exponent bit of an fp32 value
    swp.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"0_exp_avg.tensor.swp is corrupt: the SHA-256 of bytes 0..5000"):
        ckpt.verify_checkpoint(found)
    swp.write_bytes(bytes(data[:100]))
    with pytest.raises(IntegrityError, match=r"is 100 bytes, the manifest says 5000"):
        ckpt.verify_files(found)
    swp.unlink()
    with pytest.raises(IntegrityError, match=r"0_exp_avg.tensor.swp is missing"):
        ckpt.verify_files(found)
    # the ranks share the hashing: rank 1 of 2 checks the second file only
    ckpt.verify_files(found, share=(0, 2))


def test_corrupt_checkpoint_names_the_older_one(tmp_path):
    _save(tmp_path / "ck", 2)
    found = _save(tmp_path / "ck", 4)
    (found.path / "mp_rank_00_model_states.pt").write_bytes(b"x" * 3000)
    with pytest.raises(IntegrityError, match=r"is corrupt: .*; move .*global_step4 away to resume .*global_step2$"):
        ckpt.verify_checkpoint(found)


def test_damaged_manifest_is_integrity_error(tmp_path):
    found = _save(tmp_path / "ck", 2)
    (found.path / ckpt.MANIFEST_NAME).write_text('{"complete": true, "step": ')
    with pytest.raises(IntegrityError, match="is damaged"):
        ckpt.resolve_resume(str(tmp_path / "ck"), tmp_path)


def test_chunk_location_of_a_flip_past_the_first_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "HASH_CHUNK_BYTES", 1024)
    found = _save(tmp_path / "ck", 2)
    swp = found.path / "offloaded_tensors" / "rank00" / "0_exp_avg.tensor.swp"
    data = bytearray(swp.read_bytes())
    data[4100] ^= 1
    swp.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"bytes 4096..5000 differs"):
        ckpt.verify_files(found)


def test_compatibility(tmp_path):
    found = _save(tmp_path / "ck", 2)
    ckpt.check_compatible(found, param_shapes=INFO["param_shapes"], dtype="bf16", world_size=1)
    with pytest.raises(UserError, match=r"different model: parameter emb.weight is \[10, 4\] in the checkpoint, \[10, 8\]"):
        ckpt.check_compatible(found, param_shapes={"emb.weight": [10, 8], "head.weight": [4, 10]}, dtype="bf16", world_size=1)
    with pytest.raises(UserError, match=r"parameter extra.bias \[3\] is not in the checkpoint"):
        ckpt.check_compatible(found, param_shapes={**INFO["param_shapes"], "extra.bias": [3]}, dtype="bf16", world_size=1)
    with pytest.raises(UserError, match=r"checkpoint's parameter head.weight \[4, 10\] is not in this model"):
        ckpt.check_compatible(found, param_shapes={"emb.weight": [10, 4]}, dtype="bf16", world_size=1)
    with pytest.raises(UserError, match="saved with --dtype bf16; this run uses fp32"):
        ckpt.check_compatible(found, param_shapes=INFO["param_shapes"], dtype="fp32", world_size=1)
    with pytest.raises(UserError, match="saved by 1 rank.*resume with --nproc 1"):
        ckpt.check_compatible(found, param_shapes=INFO["param_shapes"], dtype="bf16", world_size=2)


def test_prune_keeps_newest_and_only_touches_memascend_checkpoints(tmp_path):
    root = tmp_path / "ck"
    for step in (1, 2, 3, 4):
        _save(root, step)
    (root / "global_step0").mkdir()  # someone else's folder of the same shape
    removed = ckpt.prune(root, 2)
    assert sorted(p.name for p in removed) == ["global_step1", "global_step2"]
    assert sorted(p.name for p in root.iterdir()) == ["global_step0", "global_step3", "global_step4", "latest"]


def test_existing_foreign_tag_folder_refused(tmp_path):
    root = tmp_path / "ck"
    (root / "global_step2").mkdir(parents=True)
    (root / "global_step2" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="exists and is not a memascend checkpoint"):
        _save(root, 2)
    assert (root / "global_step2" / "notes.txt").read_text() == "mine"


def test_same_tag_replaced(tmp_path):
    root = tmp_path / "ck"
    first = _save(root, 2).manifest["files"]
    second = _save(root, 2).manifest["files"]
    assert first != second  # new random bytes
    assert sorted(p.name for p in root.iterdir()) == ["global_step2", "latest"]


def test_periodic_by_steps_and_minutes():
    now = [0.0]
    saved = []

    def save(root):
        saved.append(len(saved))
        return ckpt.Checkpoint(Path(root), f"global_step{len(saved)}", {"step": len(saved)})

    by_steps = ckpt.PeriodicCheckpointer("/nonexistent", every_steps=2, every_minutes=None, keep=2, save=save,
                                         rank=1, clock=lambda: now[0])
    assert [by_steps.maybe_checkpoint(s) is not None for s in (1, 2, 3, 4)] == [False, True, False, True]
    by_time = ckpt.PeriodicCheckpointer("/nonexistent", every_steps=None, every_minutes=1.5, keep=2, save=save,
                                        rank=1, clock=lambda: now[0])
    now[0] = 60.0
    assert by_time.maybe_checkpoint(1) is None
    now[0] = 91.0
    assert by_time.maybe_checkpoint(2) is not None
    now[0] = 150.0
    assert by_time.maybe_checkpoint(3) is None
    off = ckpt.PeriodicCheckpointer("/nonexistent", every_steps=None, every_minutes=None, keep=2, save=save)
    assert not off.enabled and off.maybe_checkpoint(5) is None
    assert len(saved) == 3


def test_nonfinite_loss():
    check_finite_loss(3, 2.5, skipped=False, allow=False)
    check_finite_loss(3, math.inf, skipped=True, allow=False)  # fp16 loss-scale skip
    check_finite_loss(3, math.nan, skipped=False, allow=True)
    with pytest.raises(TrainingError, match="step 3: the training loss is nan") as info:
        check_finite_loss(3, math.nan, skipped=False, allow=False)
    assert info.value.exit_code == 5


def test_estimate_checkpoint_bytes():
    # bf16 params + fp32 master + 2 fp32 moments = 14 bytes per parameter, 10 % margin, 64 MiB
    assert ckpt.estimate_checkpoint_bytes(1_000_000, "bf16") == int(14e6 * 1.1) + (64 << 20)
    assert ckpt.estimate_checkpoint_bytes(1_000_000, "fp32") == int(16e6 * 1.1) + (64 << 20)
    assert ckpt.estimate_checkpoint_bytes(1_000_000, "bf16", 1_000_000) == ckpt.estimate_checkpoint_bytes(1_000_000, "bf16")


def test_a_frozen_base_reserves_no_optimizer_state():
    # LoRA: every parameter in bf16, optimizer state (12 bytes each) only for the 10,000 trained ones
    assert ckpt.estimate_checkpoint_bytes(1_000_000, "bf16", 10_000) == int((2e6 + 12 * 10_000) * 1.1) + (64 << 20)


def test_space_check_counts_only_the_trained_parameters(tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace

    free = ckpt.estimate_checkpoint_bytes(10**9, "bf16", 10**6) + 1
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=free, used=0, free=free))
    train = SimpleNamespace(save_checkpoint=str(tmp_path / "ck"), checkpoint_every=None, checkpoint_every_minutes=None,
                            dtype="bf16")
    ckpt.check_checkpoint_space(train, tmp_path, 10**9, 10**6)  # fits: a LoRA run's checkpoint
    with pytest.raises(UserError, match="needs about"):
        ckpt.check_checkpoint_space(train, tmp_path, 10**9)  # the same model fully trained does not


def test_target_inside_a_file_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="is inside a file"):
        ckpt.check_checkpoint_target(tmp_path / "f" / "ck", 1, "--save-checkpoint")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs, read-write and read-only (needs root and mount)."""
    mounts = []

    def make(name: str, *opts: str) -> Path:
        mnt = tmp_path / name
        mnt.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=4m", *opts)), "tmpfs", str(mnt)],
                             capture_output=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
        mounts.append(mnt)
        return mnt

    yield make
    for mnt in mounts:
        subprocess.run(["umount", str(mnt)], check=False)


def test_read_only_and_too_small_targets_refused_leaving_nothing(small_tmpfs):
    ro = small_tmpfs("ro", "ro")
    with pytest.raises(UserError, match=r"--save-checkpoint .*/ro/ck is not writable .*Read-only file system"):
        ckpt.check_checkpoint_target(ro / "ck", 1, "--save-checkpoint")
    small = small_tmpfs("small")
    with pytest.raises(UserError, match=r"has 4.00 MiB free; a checkpoint of this run needs about 1.00 GiB"):
        ckpt.check_checkpoint_target(small / "ck", 1 << 30, "--save-checkpoint")
    ckpt.check_checkpoint_target(small / "ck", 1 << 20, "--save-checkpoint")
    assert list(small.iterdir()) == []  # the writability probe left nothing


def test_raw_store_save_names_latest_only_after_the_export(tmp_path):
    """DeepSpeed 0.19.8's save_checkpoint writes ``latest`` before it returns, i.e. before the raw
    store's export of the optimizer state ran: a run killed during the export left a ``latest``
    naming a checkpoint without its optimizer state. The wrapper saves with save_latest=False and
    writes ``latest`` after the export."""
    from memascend.integrations.deepspeed import store_checkpoint

    seen = {}

    def stock_save(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        seen["save_latest"] = save_latest
        tag = tag if tag is not None else f"global_step{self.global_steps}"  # as stock resolves it
        (Path(save_dir) / tag).mkdir(parents=True)
        if save_latest:
            (Path(save_dir) / "latest").write_text(tag)
        return True

    class Handle:
        def export_checkpoint(self, tag_dir, folder):
            seen["latest_at_export"] = (Path(tag_dir).parent / "latest").exists()

    class Swapper:
        swap_folder = str(tmp_path / "keys" / "zero_stage_3" / "optimizer" / "rank0")

    class Engine:
        global_steps, global_rank = 3, 0
        optimizer = type("Opt", (), {"optimizer_swapper": Swapper()})()

        def zero_nvme_offload_optimizer(self):
            return True

    save = store_checkpoint.make_save_checkpoint(stock_save, Handle())
    assert save(Engine(), str(tmp_path / "ck")) is True
    assert seen == {"save_latest": False, "latest_at_export": False}
    assert (tmp_path / "ck" / "latest").read_text() == "global_step3"
    save(Engine(), str(tmp_path / "ck2"), "tagX", save_latest=False)
    assert not (tmp_path / "ck2" / "latest").exists()


def test_latest_behind_a_newer_complete_checkpoint_and_stale_latest_temporaries(tmp_path):
    """A save cut off between renaming global_step4 into place and writing 'latest': 'latest' still
    names global_step2 and a '.latest.tmp-<pid>' of the dead process is left; the newest complete
    checkpoint is resumed, and the next save removes the dead process's temporary (a live one stays)."""
    root = tmp_path / "ck"
    _save(root, 2)
    _save(root, 4)
    (root / "latest").write_text("global_step2")
    dead, live = root / ".latest.tmp-999999999", root / f".latest.tmp-{os.getppid()}"  # a live process
    dead.write_text("global_step4")
    live.write_text("global_step4")
    found = ckpt.resolve_resume(str(root), tmp_path)
    assert found.tag == "global_step4"
    assert ckpt.pick_reason(str(root), found).startswith("the newest complete checkpoint there; 'latest' names "
                                                         "global_step2")
    _save(root, 6)
    assert not dead.exists() and live.exists() and (root / "latest").read_text() == "global_step6"
    assert ckpt.pick_reason(str(root), ckpt.resolve_resume(str(root), tmp_path)) is None


def test_tag_folders_without_a_manifest_are_refused_only_where_the_run_saves(tmp_path):
    from types import SimpleNamespace

    out = tmp_path / "out"
    root = ckpt.periodic_root(out)
    (root / "global_step3").mkdir(parents=True)  # another tool's, no manifest
    every2 = SimpleNamespace(save_checkpoint=None, checkpoint_every=2, checkpoint_every_minutes=None)
    ckpt.check_tag_folders(every2, out, 2, 6)  # saves at 4 and 6 only
    with pytest.raises(UserError, match=r"periodic checkpoints: .*global_step3 exists and is not a memascend checkpoint"):
        ckpt.check_tag_folders(SimpleNamespace(**{**vars(every2), "checkpoint_every": 3}), out, 0, 6)
    with pytest.raises(UserError, match="global_step3 exists"):  # by the clock: any step may be saved
        ckpt.check_tag_folders(SimpleNamespace(**{**vars(every2), "checkpoint_every_minutes": 5.0}), out, 0, 6)
    ckpt.check_tag_folders(SimpleNamespace(**{**vars(every2), "checkpoint_every_minutes": 5.0}), out, 3, 6)
    with pytest.raises(UserError, match="--save-checkpoint: .*global_step3 exists"):
        ckpt.check_tag_folders(SimpleNamespace(save_checkpoint=str(root), checkpoint_every=None,
                                               checkpoint_every_minutes=None), out, 0, 3)
