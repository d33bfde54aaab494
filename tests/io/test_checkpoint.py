"""Store checkpoints as plain files (memascend.io.checkpoint): export and import round trip, a
corrupt export file refused, DeepSpeed swap files imported as raw bytes, and an export written out
as DeepSpeed-style swap files (folder-of-files run resuming a raw-store checkpoint), CRC32C-checked."""

from __future__ import annotations

import pytest
import torch

from memascend.errors import UserError
from memascend.io.checkpoint import (
    copy_export_to_folder,
    export_files,
    import_files,
    import_swap_files,
    read_manifest,
)
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
        export_files(store, tmp_path / "ck")
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


def test_export_import_round_trip_and_corrupt_checkpoint(store_path, tmp_path):
    tensors = {
        "p.0": torch.randn(123_457),
        "p.1": torch.arange(10, dtype=torch.int64).view(2, 5),
        "empty": torch.empty(0, 3),
    }
    with TensorStore.create(store_path, size_bytes=8 * MiB) as store:
        for k, t in tensors.items():
            store.write(k, t)
        export_files(store, tmp_path / "ckpt", chunk_bytes=64 << 10)
    other = tmp_path / "other.bin"
    with TensorStore.create(other, size_bytes=8 * MiB) as store:
        assert sorted(import_files(store, tmp_path / "ckpt", chunk_bytes=64 << 10)) == sorted(tensors)
        for k, t in tensors.items():
            out = store.read_tensor(k)
            assert out.shape == t.shape and torch.equal(out, t)
        bad = tmp_path / "ckpt" / "tensor_000001.bin"  # p.0 (sorted keys: empty, p.0, p.1)
        data = bytearray(bad.read_bytes())
        data[77] ^= 0x10
        bad.write_bytes(bytes(data))
        used = store.used_bytes
        with pytest.raises(ChecksumError, match=r"tensor 'p.0' from .*tensor_000001.bin"):
            import_files(store, tmp_path / "ckpt")
        assert store.used_bytes <= used


def test_import_swap_files_as_raw_bytes(store_path, tmp_path):
    src = {"opt/rank0/0.tensor.swp": torch.randn(3000), "opt/rank0/1.tensor.swp": torch.arange(7, dtype=torch.int64)}
    files = {}
    for i, (k, t) in enumerate(src.items()):
        files[k] = tmp_path / f"{i}.swp"
        files[k].write_bytes(t.numpy().tobytes())
    with TensorStore.create(store_path, size_bytes=8 * MiB) as store:
        assert sorted(import_swap_files(store, files, chunk_bytes=4096)) == sorted(src)
        for k, t in src.items():
            out = torch.empty_like(t)
            store.read(k, out)  # CRC computed at import is checked here
            assert torch.equal(out, t) and store.record(k).dtype == "torch.uint8"
        with pytest.raises(UserError, match="missing"):
            import_swap_files(store, {"x": tmp_path / "nope.swp"})
