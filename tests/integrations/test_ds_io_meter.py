"""The swap I/O meter (memascend.integrations.deepspeed.io_meter): counting wrappers on a handle
class (bytes, ops, seconds waited), reversal through the patch registry, the disk floor, the report's
per-phase summary, and the bandwidth probe through DeepSpeed's real aio handle on a folder."""

from __future__ import annotations

import time

import pytest
import torch

from memascend.integrations.deepspeed import io_meter
from memascend.integrations.deepspeed.patches import PatchRegistry
from memascend.train import report


class SlowHandle:
    """aio-handle-shaped: transfers happen in ``wait`` (which sleeps), the synchronous ones sleep."""

    def __init__(self) -> None:
        self.pending = 0

    def async_pread(self, buffer, path, offset=0):
        self.pending += 1
        return 0

    def async_pwrite(self, buffer, path, offset=0):
        self.pending += 1
        return 0

    def sync_pread(self, buffer, path, offset=0):
        time.sleep(0.02)
        return 1

    def wait(self):
        time.sleep(0.05)
        done, self.pending = self.pending, 0
        return done


def test_counting_wrappers_count_bytes_ops_and_waits_and_revert_restores_them(monkeypatch):
    monkeypatch.setattr(io_meter, "handle_classes", lambda: [SlowHandle])
    originals = {name: SlowHandle.__dict__[name] for name in ("async_pread", "async_pwrite", "sync_pread", "wait")}
    registry = PatchRegistry()
    assert io_meter.install(registry) == 4
    assert io_meter.install(registry) == 0  # already wrapped: not wrapped twice
    h = SlowHandle()
    before = io_meter.METER.totals()
    h.async_pread(torch.zeros(1024), "a", 0)  # 4096 bytes
    h.async_pwrite(torch.zeros(256, dtype=torch.bfloat16), "b")  # 512 bytes
    assert h.wait() == 2
    h.sync_pread(torch.zeros(10, dtype=torch.uint8), "c", 0)
    d = io_meter.METER.totals() - before
    assert (d.read_bytes, d.write_bytes, d.read_ops, d.write_ops) == (4096 + 10, 512, 2, 1)
    assert 0.07 <= d.wait_s < 1.0  # the wait (0.05) and the synchronous read (0.02); submits not timed
    registry.restore_all()
    assert {name: SlowHandle.__dict__[name] for name in originals} == originals


def test_floor_and_summary_per_phase():
    bw = {"read_bytes_per_s": 1e9, "write_bytes_per_s": 5e8}
    io = {"read_bytes": 2e9, "write_bytes": 1e9, "read_ops": 1, "write_ops": 1, "io_wait_s": 0.5}
    assert io_meter.floor_s(io, bw) == pytest.approx(4.0)
    assert io_meter.floor_s(io, None) is None
    zero = {"read_bytes": 0, "write_bytes": 0, "read_ops": 0, "write_ops": 0, "io_wait_s": 0.0}
    steps = []
    for t in (9.0, 6.0, 8.0):
        phase_s = {"forward_s": 1.0, "backward_s": 2.0, "optimizer_step_s": t}
        phase_io = {"forward_s": io, "backward_s": zero, "optimizer_step_s": io}
        steps.append({"phase_s": phase_s, **report.swap_io_fields(phase_s, phase_io, bw)})
    assert steps[0]["swap_read_bytes"] == 4e9 and steps[0]["io_wait_s"] == 1.0
    assert steps[0]["phase_floor_s"] == {"forward_s": 4.0, "backward_s": 0.0, "optimizer_step_s": 4.0}
    summary = report.swap_io_summary(steps, bw)
    step_phase = summary["median_phase"]["optimizer_step_s"]
    assert step_phase["time_s"] == 7.0  # median of the steady steps (6, 8): the first is excluded
    assert step_phase["time_over_floor"] == pytest.approx(7.0 / 4.0)
    assert summary["median_phase"]["backward_s"]["time_over_floor"] is None  # no bytes, no floor
    assert summary["median_step"]["write_bytes"] == 2e9
    assert report.swap_io_summary([{"phase_s": {}}], None)["median_phase"] is None
    assert "worker_s" not in step_phase  # no step overlap: the phase's own time is the step's


def test_the_overlapped_steps_worker_time_is_held_against_the_floor():
    bw = {"read_bytes_per_s": 1e9, "write_bytes_per_s": 1e9}
    io = {"read_bytes": 1e9, "write_bytes": 1e9, "read_ops": 1, "write_ops": 1, "io_wait_s": 0.0}
    steps = []
    for worker_s in (None, 2.5, 3.0, 2.0):  # the first step has no finished worker step yet
        phase_s = {"forward_s": 3.0, "backward_s": 1.0, "optimizer_step_s": 0.01}
        phase_io = {"forward_s": io, "backward_s": io, "optimizer_step_s": io}
        steps.append({"phase_s": phase_s, "step_worker_s": worker_s, **report.swap_io_fields(phase_s, phase_io, bw)})
    step_phase = report.swap_io_summary(steps, bw)["median_phase"]["optimizer_step_s"]
    assert step_phase["time_over_floor"] == pytest.approx(0.01 / 2.0)  # the training thread only queued it
    assert step_phase["worker_s"] == 2.5 and step_phase["worker_over_floor"] == pytest.approx(1.25)


@pytest.mark.slow
def test_probe_measures_the_folder_through_the_aio_handle(tmp_path):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    AsyncIOBuilder().load(verbose=False)
    before = io_meter.METER.totals()
    bw = io_meter.probe_folder_bandwidth(tmp_path, {"aio": {"block_size": 1 << 20, "queue_depth": 8}},
                                         probe_bytes=32 << 20, call_bytes=4 << 20)
    assert bw is not None and bw.probe_bytes == 32 << 20 and bw.block_size_bytes == 1 << 20
    assert bw.read_bytes_per_s > 1e6 and bw.write_bytes_per_s > 1e6
    assert list(tmp_path.iterdir()) == []  # the probe file is removed
    assert io_meter.METER.totals() == before  # not counted as swap I/O


def test_the_step_workers_io_is_counted_apart():
    import threading

    from memascend.integrations.deepspeed.io_meter import SwapIOMeter, count_as_step_worker

    meter = SwapIOMeter()
    meter.add(read_bytes=4096, wait_s=0.5)

    def worker():
        count_as_step_worker()
        meter.add(write_bytes=8192, wait_s=1.0)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert (meter.totals().read_bytes, meter.totals().write_bytes, meter.totals().wait_s) == (4096, 0, 0.5)
    assert (meter.worker_totals().write_bytes, meter.worker_totals().write_ops, meter.worker_totals().wait_s) == (
        8192, 1, 1.0)
    meter.add(write_bytes=1)  # this thread was never marked
    assert meter.totals().write_bytes == 1
