"""--nvme-path: folder vs raw store, and which store each rank gets."""

from __future__ import annotations

import pytest

from memascend.errors import UserError
from memascend.train.store_target import is_store_target, resolve_store_target, store_file_bytes


def test_folder_or_store(tmp_path):
    assert not is_store_target(str(tmp_path / "swap"))
    assert is_store_target(str(tmp_path / "s.store"))
    assert is_store_target(f"{tmp_path}/a.store,{tmp_path}/b.store")


def test_per_rank_targets(tmp_path):
    one = str(tmp_path / "s.store")
    assert resolve_store_target(one, 0, 1) == tmp_path / "s.store"
    assert resolve_store_target(one, 1, 2) == tmp_path / "s.store.rank1"
    pair = f"{tmp_path}/a.store,{tmp_path}/b.store"
    assert resolve_store_target(pair, 1, 2) == tmp_path / "b.store"
    with pytest.raises(UserError, match="lists 2 stores for 3 rank"):
        resolve_store_target(pair, 0, 3)
    with pytest.raises(UserError, match="neither a block device nor a file ending in .store"):
        resolve_store_target(f"{tmp_path}/a.store,{tmp_path}/b.bin", 1, 2)
    (tmp_path / "d.store").mkdir()
    with pytest.raises(UserError, match="not a regular file"):
        resolve_store_target(str(tmp_path / "d.store"), 0, 1)
    with pytest.raises(UserError, match="does not exist"):
        resolve_store_target(str(tmp_path / "nope" / "x.store"), 0, 1)
    assert store_file_bytes(100) > 100


def test_targets_are_per_node_indexed_by_local_rank(tmp_path):
    # two nodes x two ranks: every node names its own two stores; local rank 1 of either node gets the second
    pair = f"{tmp_path}/a.store,{tmp_path}/b.store"
    assert resolve_store_target(pair, 1, 2) == tmp_path / "b.store"
    with pytest.raises(UserError, match="lists 2 stores for 4 rank.* on this node"):
        resolve_store_target(pair, 3, 4)  # a list is never indexed by the global rank
    one = str(tmp_path / "s.store")
    assert resolve_store_target(one, 1, 2) == tmp_path / "s.store.rank1"
    assert resolve_store_target(one, 0, 1) == tmp_path / "s.store"  # one rank per node: the path itself


def test_open_raw_store_uses_the_local_rank_and_keeps_the_global_one(tmp_path, monkeypatch):
    import memascend.integrations.deepspeed as seam
    from memascend.config import OffloadConfig
    from memascend.train.dist import DistInfo
    from memascend.train.swap_target import open_raw_store

    calls = []
    monkeypatch.setattr(seam, "apply_raw_store", lambda target, **kw: calls.append((target, kw)) or "handle")
    offload = OffloadConfig(nvme_path=f"{tmp_path}/a.store,{tmp_path}/b.store")
    info = DistInfo(rank=3, local_rank=1, world_size=4, device_type="cpu", local_world_size=2, node_rank=1)
    assert open_raw_store(offload, info, need_bytes=1 << 20) == "handle"
    assert calls[0][0] == tmp_path / "b.store" and calls[0][1]["world_rank"] == 3
    # one node, two ranks, no LOCAL_WORLD_SIZE: as before (local == global)
    info = DistInfo(rank=1, local_rank=1, world_size=2, device_type="cpu")
    open_raw_store(OffloadConfig(nvme_path=str(tmp_path / "s.store")), info, need_bytes=1 << 20)
    assert calls[1][0] == tmp_path / "s.store.rank1" and calls[1][1]["world_rank"] == 1
