"""Output folders (memascend/cli/outputs.py): a fresh runs/<stamp>-<name> per run with runs/latest linking
to it; a non-empty --output refused unless --overwrite-output (memascend's files removed, nobody else's)
or --resume (checkpoints kept, the old model and report removed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from memascend.cli import outputs
from memascend.config import build_run_config
from memascend.errors import UserError
from tests.conftest import run_cli


def _populate(folder: Path) -> None:
    for name in ("model/model.safetensors", "report.json", "steps.jsonl", "memory_timeline.csv",
                 "tensorboard/events.out.tfevents.1", "checkpoints/global_step2/x", "notes.txt", "data/train.jsonl"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("old")


def test_run_names():
    assert outputs.run_name(build_run_config({}, {"model": {"from_scratch": "llama-1b"}})) == "llama-1b"
    assert outputs.run_name(build_run_config({}, {"model": {"from_scratch": "hidden=128,layers=2,heads=4"}})) \
        == "from-scratch"
    assert outputs.run_name(build_run_config({}, {"model": {"name_or_path": "Qwen/Qwen2.5-0.5B"}})) == "Qwen2.5-0.5B"
    assert outputs.run_name(build_run_config({}, {"model": {"name_or_path": "/m/tiny q.gguf"}})) == "tiny-q"
    assert outputs.run_name(build_run_config({}, {})) == "smollm2-135m"


def test_fresh_folders_are_new_each_time(tmp_path):
    cfg = build_run_config({}, {"model": {"from_scratch": "llama-tiny"}})
    first = outputs.fresh_run_dir(cfg, tmp_path, now_s=0)
    assert first.parent == tmp_path and first.name.endswith("-llama-tiny") and len(first.name.split("-")[0]) == 8
    first.mkdir()
    second = outputs.fresh_run_dir(cfg, tmp_path, now_s=0)
    assert second.name == first.name + "-2"


def test_settle_makes_and_locks_a_fresh_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = build_run_config({}, {"model": {"from_scratch": "llama-tiny"}})
    first, fresh, lock = outputs.settle_output(cfg, given=False, overwrite=False)
    assert fresh and first.output_dir.startswith("runs/")
    assert Path(first.output_dir).is_dir()  # created and locked by the first process
    lock.release()
    assert not Path(first.output_dir).exists()  # created by the lock, left empty: removed


def test_latest_links_to_the_newest_run(tmp_path):
    for name in ("20250101-000000-a", "20250102-000000-b"):
        (tmp_path / name).mkdir()
        outputs.link_latest(tmp_path / name)
        assert os.readlink(tmp_path / "latest") == name and (tmp_path / "latest").resolve() == tmp_path / name
    outputs.link_latest(tmp_path / "never-created")  # a run refused before its folder: latest stays
    assert os.readlink(tmp_path / "latest") == "20250102-000000-b"
    real = tmp_path / "real"
    (real / "latest").mkdir(parents=True)
    (real / "run").mkdir()
    outputs.link_latest(real / "run")  # an earlier memascend's runs/latest folder is not touched
    assert (real / "latest").is_dir() and not (real / "latest").is_symlink()


def test_a_non_empty_output_is_refused(tmp_path):
    _populate(tmp_path)
    with pytest.raises(UserError, match=r"is not empty \(checkpoints, data, memory_timeline.csv, model, \.\.\.\): "
                                        r"give --overwrite-output"):
        outputs.prepare_explicit_output(tmp_path, overwrite=False, resume=False)
    assert (tmp_path / "model").is_dir()
    outputs.prepare_explicit_output(tmp_path / "new", overwrite=False, resume=False)  # missing: fine
    (tmp_path / "empty").mkdir()
    outputs.prepare_explicit_output(tmp_path / "empty", overwrite=False, resume=False)
    with pytest.raises(UserError, match="is a file"):
        outputs.prepare_explicit_output(tmp_path / "notes.txt", overwrite=False, resume=False)
    # Empty folders hold nothing to lose (a checkpoint folder the user made or mounted for the run).
    (tmp_path / "prepared" / "checkpoints").mkdir(parents=True)
    outputs.prepare_explicit_output(tmp_path / "prepared", overwrite=False, resume=False)
    assert (tmp_path / "prepared" / "checkpoints").is_dir()
    (tmp_path / "prepared" / "checkpoints" / "x").write_text("x")
    with pytest.raises(UserError, match=r"is not empty \(checkpoints\)"):
        outputs.prepare_explicit_output(tmp_path / "prepared", overwrite=False, resume=False)


def test_overwrite_removes_only_memascend_s_files(tmp_path):
    _populate(tmp_path)
    outputs.prepare_explicit_output(tmp_path, overwrite=True, resume=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "data", "notes.txt"]
    # checkpoints/global_step2 has no memascend manifest: not memascend's checkpoint, kept
    assert (tmp_path / "checkpoints" / "global_step2" / "x").read_text() == "old"


def test_overwrite_keeps_the_user_s_files_inside_memascend_s_folders(tmp_path):
    """Only the files memascend writes go; a user's file keeps its folder (and the folder stays)."""
    from memascend.train.checkpoints import MANIFEST_NAME

    files = {"model/model.safetensors": "w", "model/config.json": "c", "model/README.mine": "mine",
             "tensorboard/events.out.tfevents.1.host": "e", "tensorboard/my_notes.txt": "notes",
             f"checkpoints/global_step2/{MANIFEST_NAME}": "{}", "checkpoints/global_step2/mp_rank_00.pt": "ck",
             "checkpoints/latest": "global_step2", "checkpoints/README.mine": "mine", "report.json": "{}"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    outputs.prepare_explicit_output(tmp_path, overwrite=True, resume=False)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["checkpoints/README.mine", "model/README.mine", "tensorboard/my_notes.txt"]


@pytest.mark.parametrize("flag", ["model", "data", "config", "deepspeed_config", "resume"])
def test_overwrite_never_removes_what_the_run_reads(tmp_path, flag):
    """An input inside one of the outputs the run replaces is refused before anything is removed."""
    _populate(tmp_path)
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "report.json").write_text("{}")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    given = {"model": {"model": {"name_or_path": str(tmp_path / "model")}},
             "data": {"data": {"source": f"shakespeare,{tmp_path / 'steps.jsonl'}"}},
             "deepspeed_config": {"deepspeed_config": str(tmp_path / "report.json")},
             "resume": {"train": {"resume": str(tmp_path / "model")}}}.get(flag, {})
    cfg = build_run_config({}, given)
    config_file = str(tmp_path / "memory_timeline.csv") if flag == "config" else None
    inputs = outputs.run_inputs(cfg, config_file)
    with pytest.raises(UserError, match=r"lies in the run's output .*which this run replaces: give another --output"):
        outputs.prepare_explicit_output(tmp_path, overwrite=True, resume=flag == "resume", inputs=inputs)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_a_data_folder_that_is_the_output_is_refused(tmp_path):
    _populate(tmp_path)
    cfg = build_run_config({}, {"data": {"source": str(tmp_path)}})
    with pytest.raises(UserError, match=r"--data .* lies in the run's output"):
        outputs.prepare_explicit_output(tmp_path, overwrite=True, resume=False, inputs=outputs.run_inputs(cfg))
    assert (tmp_path / "steps.jsonl").read_text() == "old"


def test_resume_from_the_output_s_own_checkpoints_is_allowed(tmp_path):
    _populate(tmp_path)
    cfg = build_run_config({}, {"train": {"resume": str(tmp_path / "checkpoints")}})
    outputs.prepare_explicit_output(tmp_path, overwrite=True, resume=True, inputs=outputs.run_inputs(cfg))
    assert (tmp_path / "checkpoints" / "global_step2").is_dir() and not (tmp_path / "report.json").exists()


def test_a_locked_output_refuses_a_second_run_and_names_its_pid(tmp_path):
    import subprocess
    import sys
    import time

    from memascend.io.runlock import TargetBusyError

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from memascend.cli.outputs import lock_output; l = lock_output(Path(sys.argv[1])); "
                               "print('locked', flush=True); time.sleep(60)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        (out / "report.json").write_text("live")
        with pytest.raises(TargetBusyError, match=rf"--output {out} is in use by another memascend run "
                                                  rf"\(process {holder.pid}\)"):
            outputs.lock_output(out)
        assert (out / "report.json").read_text() == "live"
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    outputs.lock_output(out).release()  # the kernel dropped the dead holder's lock


def test_resume_keeps_the_checkpoints_and_drops_the_old_model_and_report(tmp_path):
    _populate(tmp_path)
    outputs.prepare_explicit_output(tmp_path, overwrite=False, resume=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "data", "notes.txt", "tensorboard"]
    _populate(tmp_path)
    outputs.prepare_explicit_output(tmp_path, overwrite=True, resume=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "data", "notes.txt", "tensorboard"]


def test_the_list_names_what_a_run_writes():
    from memascend.train import checkpoints, run_log

    for name in (run_log.STEPS_LOG, run_log.REPORT, run_log.TIMELINE_CSV, checkpoints.CHECKPOINTS_SUBDIR):
        assert name in outputs.MEMASCEND_OUTPUTS


def test_a_run_without_output_gets_a_fresh_folder_and_runs_latest(tmp_path):
    """End to end (one tiny run): the supervised child writes where the first process decided, and
    runs/latest moves from an earlier run's folder to this one."""
    old = tmp_path / "runs" / "20200101-000000-old"
    (old / "model").mkdir(parents=True)
    (tmp_path / "runs" / "latest").symlink_to(old.name)
    (tmp_path / "small.txt").write_text("a few words of text\n" * 400)
    proc = run_cli(["finetune", "--from-scratch", "llama-tiny", "--data", "small.txt", "--steps", "1", "--seq-len", "32",
                    "--micro-batch", "1", "--eval-blocks", "1", "--no-save-model", "--report-to", "none",
                    "--nvme-path", "swap"], tmp_path, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(runs) == 3 and runs[-1] == "latest" and runs[1].endswith("-llama-tiny"), runs
    latest = tmp_path / "runs" / "latest"
    assert latest.is_symlink() and os.readlink(latest) == runs[1]
    rep = json.loads((latest / "report.json").read_text())
    assert rep["config"]["output_dir"] == f"runs/{runs[1]}" and not (latest / "model").exists()
    assert (old / "model").is_dir()


def test_a_live_run_locks_its_output_and_overwrite_keeps_the_user_s_files(tmp_path):
    """End to end: a run with --overwrite-output removes only memascend's files (the user's notes in
    tensorboard/ and checkpoints/ stay); while it runs, a second run on the same --output, with or
    without --overwrite-output, is refused with one line naming the first run's pid and changes nothing."""
    import subprocess
    import sys
    import time

    from memascend.procfs import pids_with_open
    from tests.conftest import run_cli

    out = tmp_path / "om"
    mine = {"tensorboard/my_notes.txt": "notes", "checkpoints/README.mine": "mine", "model/README.mine": "m"}
    for name, text in {**mine, "report.json": "{}", "model/model.safetensors": "old",
                       "tensorboard/events.out.tfevents.1.old": "old"}.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    (tmp_path / "small.txt").write_text("a few words of text\n" * 400)
    args = ["finetune", "--from-scratch", "llama-tiny", "--data", "small.txt", "--steps", "4", "--seq-len", "32",
            "--micro-batch", "1", "--eval-blocks", "1", "--no-save-model", "--output", "om", "--overwrite-output"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    first = subprocess.Popen([sys.executable, "-m", "memascend", *args, "--nvme-path", "swap1"], cwd=tmp_path,
                             env={**env, "PYTHONWARNINGS": "ignore"}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while first.pid not in pids_with_open(out) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.pid in pids_with_open(out), "the first run never locked its output folder"
        for extra in (["--overwrite-output"], []):
            second = run_cli([*args[:-1], *extra, "--nvme-path", "swap2"], tmp_path, timeout_s=300)
            lines = [ln for ln in second.stderr.splitlines() if ln.startswith("memascend: error:")]
            assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
            assert f"--output om is in use by another memascend run (process {first.pid})" in lines[0], lines
            assert "Traceback" not in second.stderr
        _, err = first.communicate(timeout=600)
    finally:
        first.kill()
    assert first.returncode == 0, err[-3000:]
    for name, text in mine.items():
        assert (out / name).read_text() == text, name
    assert json.loads((out / "report.json").read_text())["status"] == "completed"
    assert not (out / "model" / "model.safetensors").exists()
    assert not (out / "tensorboard" / "events.out.tfevents.1.old").exists()
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
