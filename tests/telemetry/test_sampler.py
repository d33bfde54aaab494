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
    assert summ["phase_peak_locked_bytes"]["grow"] >= size
    assert summ["phase_peak_locked_bytes"]["idle"] < size
    csv_path = tmp_path / "t.csv"
    s.write_csv(csv_path)
    cols = read_timeline(csv_path)
    assert len(cols["t_s"]) == summ["num_samples"]
    assert "grow" in cols["phase"]
    png = tmp_path / "t.png"
    plot_timelines({"a": csv_path, "b": csv_path}, png, title="two runs")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    del buf
