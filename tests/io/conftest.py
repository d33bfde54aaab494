"""Fixtures of the device-store tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture()
def store_path(tmp_path) -> Path:
    """Path of a store file that does not exist yet (TensorStore.create preallocates it)."""
    return tmp_path / "store.bin"
