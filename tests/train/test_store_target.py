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
