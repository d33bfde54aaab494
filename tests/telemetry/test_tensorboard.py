"""TensorBoard event files of a run, read back with the tensorboard package."""

from __future__ import annotations

import pytest

from memascend.telemetry.tensorboard import EVENT_GLOB, STEP_SCALARS, TensorBoardLog

pytest.importorskip("tensorboard")


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def step(n: int, eval_loss=None) -> dict:
    return {"step": n, "loss": 10.0 - n, "lr": 1e-4 * n, "tokens_per_s": 100.0 * n, "time_s": 0.5,
            "rss_bytes": 1 << 30, "locked_bytes": 1 << 20, "nvme_read_bytes": 4096 * n, "nvme_write_bytes": 8192,
            "eval_loss": eval_loss, "rank_losses": [1.0], "phase_s": {"forward_s": 0.1}}


def test_steps_and_evals_become_scalars(tmp_path):
    log = TensorBoardLog(tmp_path / "tb")
    log.eval(0, 11.0)
    log.step(step(1))
    log.step(step(2, eval_loss=9.5))
    log.eval(2, None)  # no held-out blocks: nothing written
    log.close()
    log.close()
    got = read_scalars(tmp_path / "tb")
    assert set(got) == set(STEP_SCALARS.values())
    assert got["train/loss"] == [(1, 9.0), (2, 8.0)]
    assert got["eval/loss"] == [(0, 11.0), (2, 9.5)]
    assert [s for s, _ in got["train/lr"]] == [1, 2] and got["train/lr"][1][1] == pytest.approx(2e-4)
    assert got["memory/locked_bytes"] == [(1, float(1 << 20)), (2, float(1 << 20))]
    assert got["nvme/read_bytes"] == [(1, 4096.0), (2, 8192.0)]


def test_an_earlier_runs_events_are_replaced_and_a_discarded_log_leaves_nothing(tmp_path):
    first = TensorBoardLog(tmp_path / "tb")
    first.step(step(1))
    first.close()
    second = TensorBoardLog(tmp_path / "tb")
    second.step(step(5))
    second.close()
    assert len(list((tmp_path / "tb").glob(EVENT_GLOB))) == 1
    assert read_scalars(tmp_path / "tb")["train/loss"] == [(5, 5.0)]
    fresh = TensorBoardLog(tmp_path / "new")
    fresh.step(step(1))
    fresh.discard()
    assert not (tmp_path / "new").exists()
    second_again = TensorBoardLog(tmp_path / "tb")  # a folder it did not create stays
    second_again.discard()
    assert (tmp_path / "tb").is_dir() and not list((tmp_path / "tb").glob(EVENT_GLOB))
