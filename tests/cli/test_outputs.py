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


def test_settle_passes_the_fresh_folder_to_the_run_s_other_processes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(outputs.ENV_OUTPUT_DIR, "")  # restored (unset) after the test: settle_output sets it
    cfg = build_run_config({}, {"model": {"from_scratch": "llama-tiny"}})
    first, fresh = outputs.settle_output(cfg, given=False, overwrite=False, first_process=True)
    assert fresh and first.output_dir.startswith("runs/") and os.environ[outputs.ENV_OUTPUT_DIR] == first.output_dir
    child, fresh = outputs.settle_output(cfg, given=False, overwrite=False, first_process=False)
    assert fresh and child.output_dir == first.output_dir
    assert not Path("runs").exists()  # nothing is created before the run starts


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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]


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
