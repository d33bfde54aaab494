"""The start-up's heap trims (memascend.train.startup_memory)."""

import dataclasses

from memascend.config import RunConfig
from memascend.memory import host_allocator
from memascend.train import startup_memory


def _count_trims(monkeypatch) -> list[int]:
    calls: list[int] = []
    monkeypatch.setattr(host_allocator, "trim", lambda: calls.append(1) or True)
    return calls


def test_memascend_engine_trims(monkeypatch):
    calls = _count_trims(monkeypatch)
    assert startup_memory.trim_after_stage(RunConfig()) is True and calls == [1]


def test_stock_and_policy_off_are_left_alone(monkeypatch):
    calls = _count_trims(monkeypatch)
    cfg = RunConfig()
    assert startup_memory.trim_after_stage(dataclasses.replace(cfg, engine="baseline")) is False
    off = dataclasses.replace(cfg, memascend=dataclasses.replace(cfg.memascend, enable_malloc_policy=False))
    assert startup_memory.trim_after_stage(off) is False
    assert calls == []


def test_trim_hands_freed_heap_back():
    from memascend.telemetry.footprint import read_rss_split

    blocks = [bytearray(64 << 10) for _ in range(1024)]  # 64 MiB in small heap chunks, written
    keep = blocks[-1]  # a live chunk at the heap's top: glibc's own trim cannot shrink past it
    del blocks
    before = read_rss_split()["rss_anon_bytes"]
    assert startup_memory.trim_after_stage(RunConfig())
    after = read_rss_split()["rss_anon_bytes"]
    assert before - after >= 32 << 20, (before, after)
    del keep
