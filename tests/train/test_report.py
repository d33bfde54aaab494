"""report.json's record of where each rank ran and what it swapped to (issue 22: per-node swap
targets): memory.ranks (rank_record) and memory.nodes (node_peaks)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from memascend.train import report as report_mod
from memascend.train.dist import DistInfo

PEAKS = {"peak_rss_bytes": 3 << 30, "peak_locked_bytes": 1 << 20, "peak_uss_bytes": 1}


def _info(rank: int) -> DistInfo:  # two hosts, two ranks each
    return DistInfo(rank=rank, local_rank=rank % 2, world_size=4, device_type="cpu", local_world_size=2,
                    node_rank=rank // 2, hostname=f"host{rank // 2}")


def test_a_rank_records_its_host_node_local_rank_and_swap_target(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = report_mod.rank_record(_info(3), PEAKS, swap_dir="nvme/memascend-run")  # relative, as given
    assert folder == {"rank": 3, "peak_rss_bytes": 3 << 30, "peak_locked_bytes": 1 << 20, "hostname": "host1",
                      "node_rank": 1, "local_rank": 1, "swap_target": str(tmp_path / "nvme" / "memascend-run"),
                      "swap_kind": "folder"}
    store = SimpleNamespace(target="/dev/nvme1n1p2", is_block_device=True)
    assert report_mod.rank_record(_info(1), PEAKS, raw_store=store)["swap_target"] == "/dev/nvme1n1p2"
    assert report_mod.rank_record(_info(1), PEAKS, raw_store=store)["swap_kind"] == "block_device"
    file_store = SimpleNamespace(target="s.store.rank1", is_block_device=False)
    rec = report_mod.rank_record(_info(1), PEAKS, raw_store=file_store)
    assert (rec["swap_target"], rec["swap_kind"]) == (os.path.join(tmp_path, "s.store.rank1"), "store_file")
    nothing = report_mod.rank_record(_info(0), PEAKS)  # nothing on NVMe
    assert (nothing["swap_target"], nothing["swap_kind"]) == (None, None)


def test_each_node_lists_its_ranks_swap_targets():
    ranks = [report_mod.rank_record(_info(r), PEAKS, swap_dir=f"/nvme{r % 2}/swap") for r in range(4)]
    nodes = report_mod.node_peaks(ranks)
    assert [(n["hostname"], n["ranks"], n["swap_targets"]) for n in nodes] == [
        ("host0", [0, 1], ["/nvme0/swap", "/nvme1/swap"]), ("host1", [2, 3], ["/nvme0/swap", "/nvme1/swap"])]
    mem = report_mod._memory_section(PEAKS, ranks)
    assert mem["ranks"] == ranks and mem["max_node_peak_rss_bytes"] == 6 << 30
    # ranks recorded before swap targets were: None in their place
    old = report_mod.node_peaks([{"rank": 0, "peak_rss_bytes": 1, "peak_locked_bytes": 0}])
    assert old[0]["swap_targets"] == [None]
