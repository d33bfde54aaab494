"""Store checkpoints as plain files: an export written out as DeepSpeed-style swap files
(folder-of-files run resuming a raw-store checkpoint), CRC32C-checked."""

from __future__ import annotations

import pytest
import torch

from memascend.errors import UserError
from memascend.io.checkpoint import copy_export_to_folder, read_manifest
from memascend.io.errors import ChecksumError
from memascend.io.store import TensorStore

MiB = 1 << 20


@pytest.fixture()
def export(store_path, tmp_path):
    tensors = {"z/optimizer/rank0/0_0.tensor.swp": torch.randn(70_000),
               "z/optimizer/rank0/1_0.tensor.swp": torch.randn(1024).bfloat16()}
    with TensorStore.create(store_path, size_bytes=8 * MiB) as store:
        for k, t in tensors.items():
            store.write(k, t)
        store.export_files(tmp_path / "ck")
    return tmp_path / "ck", tensors


def test_copy_export_writes_the_tensor_bytes(export, tmp_path):
    folder, tensors = export
    dest = {k: tmp_path / "swap" / k.rsplit("/", 1)[1] for k in tensors}
    assert sorted(copy_export_to_folder(folder, dest, chunk_bytes=4096)) == sorted(dest.values())
    for k, t in tensors.items():
        assert dest[k].read_bytes() == t.view(torch.uint8).numpy().tobytes()
    assert {e["key"] for e in read_manifest(folder)} == set(tensors)


def test_copy_export_corrupt_file_or_unknown_key(export, tmp_path):
    folder, tensors = export
    key = sorted(tensors)[0]
    entry = next(e for e in read_manifest(folder) if e["key"] == key)
    data = bytearray((folder / entry["file"]).read_bytes())
    data[5000] ^= 1
    (folder / entry["file"]).write_bytes(bytes(data))
    dest = tmp_path / "swap" / "0_0.tensor.swp"
    with pytest.raises(ChecksumError, match=rf"tensor '{key}' from .*{entry['file']}"):
        copy_export_to_folder(folder, {key: dest})
    assert not dest.exists()
    with pytest.raises(UserError, match="'nope' is not in"):
        copy_export_to_folder(folder, {"nope": dest})
    with pytest.raises(UserError, match="no readable manifest.json"):
        copy_export_to_folder(tmp_path, {key: dest})
