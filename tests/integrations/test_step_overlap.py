"""The optimizer step beside the next forward (memascend.integrations.deepspeed.step_overlap).

Unit: a parameter fetch waits for exactly the partitions it reads, the worker's errors come back on
the training thread, ``_post_step`` runs without its persistent all-gather, which happens at first
use or at the join. End to end: ``memascend finetune`` with the overlap on and off (llama-tiny, a
warmup + cosine schedule whose rate moves every step, gradient accumulation 2, a checkpoint and the
model saved right after the last step) trains to the same losses bit for bit and saves the same
model and checkpoint files.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import run_cli

pytest.importorskip("deepspeed")

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402

from memascend.integrations.deepspeed import step_overlap  # noqa: E402
from memascend.integrations.deepspeed.step_overlap import StepOverlap  # noqa: E402


class _Param:
    """A stand-in ZeRO-3 parameter: status, persistence, and an ``all_gather`` that records."""

    def __init__(self, numel: int, persist: bool = False) -> None:
        self.ds_numel = numel
        self.ds_persist = persist
        self.ds_status = ZeroParamStatus.NOT_AVAILABLE
        self.gathered: list[list] = []

    def all_gather(self, params):
        self.gathered.append(list(params))
        for p in params:
            p.ds_status = ZeroParamStatus.AVAILABLE


def _optimizer(*groups: list[_Param], persistent: tuple[_Param, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(fp16_groups=[list(g) for g in groups], fp16_partitioned_groups=[list(g) for g in groups],
                           persistent_parameters=list(persistent))


def _teardown(overlap: StepOverlap) -> None:
    step_overlap.join_all(raise_errors=False)
    assert not overlap.in_flight()


def test_a_fetch_waits_for_exactly_the_partitions_it_reads():
    a, b, c = _Param(10), _Param(20), _Param(30)
    opt = _optimizer([a, b], [c])
    overlap = StepOverlap(opt)
    assert overlap.param_end == {id(a): (0, 10), id(b): (0, 30), id(c): (1, 30)}
    release = threading.Event()
    done: list[str] = []

    def first_chunk():
        overlap.publish(0, 10)  # a's partition written, b's not yet
        release.wait(10)
        overlap.publish(0, 30)
        done.append("group 0")

    overlap.defer(first_chunk)
    overlap.defer(lambda: overlap.publish(1, 30))
    overlap.launch()
    try:
        overlap.wait_for([a])  # returns while the worker still holds b back
        assert not done
        waiter = threading.Thread(target=overlap.wait_for, args=([b],))
        waiter.start()
        time.sleep(0.2)
        assert waiter.is_alive()  # b is not visible yet
        release.set()
        waiter.join(10)
        assert not waiter.is_alive() and done == ["group 0"]
        overlap.join()
        assert overlap.steps == 1 and overlap.worker_s > 0 and not overlap.in_flight()
    finally:
        release.set()
        _teardown(overlap)


def test_a_worker_error_is_raised_on_the_training_thread():
    a = _Param(8)
    overlap = StepOverlap(_optimizer([a]))

    def fail():
        raise OSError(5, "aio write refused")

    overlap.defer(fail)
    overlap.launch()
    with pytest.raises(OSError, match="aio write refused"):
        overlap.wait_for([a])
    assert not overlap.in_flight()
    overlap.join()  # nothing left: a no-op


def test_post_step_runs_without_the_persistent_gather_which_happens_at_first_use_or_at_the_join():
    norm, bias, big = _Param(4, persist=True), _Param(4, persist=True), _Param(64)
    opt = _optimizer([norm, big, bias], persistent=(norm, bias))
    overlap = StepOverlap(opt)
    seen: list[list] = []
    overlap.defer(lambda: overlap.run_post_step(lambda: seen.append(list(opt.persistent_parameters))))
    overlap.defer(lambda: overlap.publish(0, 72))
    overlap.launch()
    try:
        overlap.wait_for([norm, big])  # the first module that uses norm gathers it (stock's call)
        assert seen == [[]] and opt.persistent_parameters == [norm, bias]
        assert norm.gathered == [[norm]] and norm.ds_status == ZeroParamStatus.AVAILABLE
        assert bias.ds_status == ZeroParamStatus.NOT_AVAILABLE
        overlap.join()  # bias, never fetched, at the join
        assert bias.gathered == [[bias]] and bias.ds_status == ZeroParamStatus.AVAILABLE
        overlap.wait_for([norm])
        assert norm.gathered == [[norm]]  # once per step
    finally:
        _teardown(overlap)


def test_nothing_queued_launches_nothing():
    overlap = StepOverlap(_optimizer([_Param(4)]))
    overlap.launch()  # an overflow skipped the step: no sub-group queued
    assert not overlap.in_flight() and overlap.steps == 0
    assert step_overlap.stats(SimpleNamespace(__dict__={})) is None


# ---- end to end -------------------------------------------------------------------------------------

ARGS = ["--from-scratch", "llama-tiny", "--grad-accum", "2", "--steps", "3", "--seq-len", "32", "--micro-batch", "2",
        "--eval-blocks", "0", "--report-to", "none", "--lr-scheduler", "cosine", "--warmup-steps", "2"]


def _run(tmp_path: Path, name: str, *extra: str) -> dict:
    out = tmp_path / name
    proc = run_cli(["finetune", *ARGS, *extra, "--output", str(out), "--nvme-path", str(tmp_path / f"swap-{name}"),
                    "--save-checkpoint", str(tmp_path / f"ck-{name}")], tmp_path, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    report["losses_hex"] = [step["loss"].hex() for step in report["steps"]]
    report["lrs"] = [step["lr"] for step in report["steps"]]
    return report


def _digests(folder: Path, pattern: str) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob(pattern)) if p.is_file()}


def test_overlap_on_and_off_train_and_save_the_same_model(tmp_path):
    off_config = tmp_path / "off.json"
    off_config.write_text(json.dumps({"memascend": {"enable_step_overlap": False}}))
    on = _run(tmp_path, "on")
    off = _run(tmp_path, "off", "--deepspeed-config", str(off_config))
    assert on["memascend_settings"]["enable_step_overlap"] is True
    assert on["step_overlap"]["steps"] == 3 and off["step_overlap"] is None
    # each step records the worker time of the step that finished beside its forward; the last
    # step's worker finishes after the loop (joined at the end), so it is in the total only
    worker = [s["step_worker_s"] for s in on["steps"]]
    assert worker[0] == 0.0 and all(w > 0 for w in worker[1:])
    assert sum(worker) < on["step_overlap"]["worker_s"]
    assert all(s["step_worker_s"] is None for s in off["steps"])
    assert len(set(on["lrs"])) == 3  # the rate moved every step while the worker was stepping
    assert on["losses_hex"] == off["losses_hex"]
    # The last step's update completed before the model and the checkpoint were written.
    assert _digests(tmp_path / "on", "*.safetensors") == _digests(tmp_path / "off", "*.safetensors") != {}
    swapped_on, swapped_off = _digests(tmp_path / "ck-on", "*.swp"), _digests(tmp_path / "ck-off", "*.swp")
    assert swapped_on and swapped_on == swapped_off


def test_two_ranks_with_and_without_the_overlap_train_alike(tmp_path):
    """Every all-gather stays on the training thread in stock's order: with two ranks (each its own
    worker, at its own point) the prefetch that waits for no rank is skipped on both."""
    off_config = tmp_path / "off.json"
    off_config.write_text(json.dumps({"memascend": {"enable_step_overlap": False}}))
    on = _run(tmp_path, "on", "--nproc", "2", "--no-save-model")
    off = _run(tmp_path, "off", "--nproc", "2", "--no-save-model", "--deepspeed-config", str(off_config))
    assert on["step_overlap"]["steps"] == 3 and off["step_overlap"] is None
    assert on["losses_hex"] == off["losses_hex"]
    assert [s["rank_losses"] for s in on["steps"]] == [s["rank_losses"] for s in off["steps"]]
