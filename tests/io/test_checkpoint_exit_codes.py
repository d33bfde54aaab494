"""A damaged raw-store checkpoint is an integrity failure (exit code 4), not bad input (2): a file its
manifest lists that is cut short or missing, or one whose CRC32C differs, on import into a store and
on copy into a swap folder."""

from __future__ import annotations

import pytest
import torch

from memascend.errors import IntegrityError, UserError
from memascend.io.checkpoint import copy_export_to_folder, export_files, import_files, read_manifest
from memascend.io.store import TensorStore

MiB = 1 << 20


@pytest.fixture()
def export(store_path, tmp_path):
    tensors = {"z/optimizer/rank0/0_0.tensor.swp": torch.randn(70_000)}
    with TensorStore.create(store_path, size_bytes=8 * MiB) as store:
        for k, t in tensors.items():
            store.write(k, t)
        export_files(store, tmp_path / "ck")
    key = next(iter(tensors))
    return tmp_path / "ck", key, next(e for e in read_manifest(tmp_path / "ck") if e["key"] == key)


@pytest.mark.parametrize("damage", ["truncated", "missing", "flipped"])
def test_damaged_export_file_is_an_integrity_error(export, tmp_path, damage):
    folder, key, entry = export
    file = folder / entry["file"]
    if damage == "truncated":
        file.write_bytes(file.read_bytes()[:-4096])
    elif damage == "missing":
        file.unlink()
    else:
        data = bytearray(file.read_bytes())
        data[100] ^= 0x40
        file.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as copied:
        copy_export_to_folder(folder, {key: tmp_path / "swap" / "0_0.tensor.swp"})
    assert not isinstance(copied.value, UserError) and copied.value.exit_code == 4
    assert entry["file"] in str(copied.value) and key in str(copied.value)
    with TensorStore.create(tmp_path / "other.store", size_bytes=8 * MiB) as store:
        with pytest.raises(IntegrityError) as imported:
            import_files(store, folder)
    assert imported.value.exit_code == 4 and entry["file"] in str(imported.value)
