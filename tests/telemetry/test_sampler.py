import ctypes
import mmap
import time

from memascend.telemetry import MemorySampler, read_proc_status
from memascend.telemetry.plot import plot_timelines, read_timeline

MIB = 1 << 20


def test_proc_status_fields_are_bytes():
    st = read_proc_status()
    assert st["rss_bytes"] > 10 * MIB and st["hwm_bytes"] >= st["rss_bytes"] - MIB


def test_sampler_sees_rss_and_locked_memory_grow_in_the_right_phase(tmp_path):
    libc = ctypes.CDLL(None, use_errno=True)
    size = 64 * MIB
    # Earlier tests in the same process may hold locked memory (CI of 2026-11-26: 64 MiB + 32 KiB
    # locked before this test began): the phases are judged against this baseline.
    base_locked = read_proc_status()["locked_bytes"]
    with MemorySampler(interval_s=0.02) as s:
        s.phase("idle")
        time.sleep(0.1)
        s.phase("grow")
        buf = mmap.mmap(-1, size)
        buf.write(b"\x01" * size)  # touch every page
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(size)) == 0
        time.sleep(0.1)
        s.phase("idle2")
        libc.munlock(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    summ = s.summary()
    assert summ["phase_peak_rss_bytes"]["grow"] >= summ["phase_peak_rss_bytes"]["idle"] + size - 4 * MIB
    assert summ["phase_peak_locked_bytes"]["grow"] >= base_locked + size
    assert summ["phase_peak_locked_bytes"]["idle"] < base_locked + size
    csv_path = tmp_path / "t.csv"
    s.write_csv(csv_path)
    cols = read_timeline(csv_path)
    assert len(cols["t_s"]) == summ["num_samples"]
    assert "grow" in cols["phase"]
    png = tmp_path / "t.png"
    plot_timelines({"a": csv_path, "b": csv_path}, png, title="two runs")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    del buf


def test_a_sample_in_flight_keeps_the_phase_it_started_in(monkeypatch):
    """CI flake of 2026-11-26: the sampler thread read VmLck after the main thread had moved on to
    the next phase and mlocked, yet booked the value to the phase before. phase() must wait for
    a sample in flight."""
    import threading

    import memascend.telemetry.sampler as sampler_mod

    reading, release = threading.Event(), threading.Event()
    real = sampler_mod.read_proc_status

    def slow_read(pid="self"):
        if threading.current_thread().name == "in-flight":
            reading.set()
            assert release.wait(10)
        return real(pid)

    monkeypatch.setattr(sampler_mod, "read_proc_status", slow_read)
    s = MemorySampler(interval_s=3600)
    out = {}
    t_sample = threading.Thread(target=lambda: out.update(s=s.sample()), name="in-flight")
    t_sample.start()
    assert reading.wait(10)
    t_phase = threading.Thread(target=s.phase, args=("grow",))
    t_phase.start()
    time.sleep(0.1)
    assert t_phase.is_alive(), "phase() returned while a sample was in flight"
    assert s.current_phase == "start"
    release.set()
    t_sample.join(10)
    t_phase.join(10)
    assert out["s"].phase == "start"
    assert s.current_phase == "grow"
    assert [x.phase for x in s.samples] == ["start", "grow"]
