"""A registry of attribute patches that remembers the originals and restores them exactly.

Every change memascend makes to DeepSpeed (its optimizations and the raw store) goes through the
seam's one :class:`PatchRegistry`, so that :func:`memascend.integrations.deepspeed.revert` puts back
the very same objects (``is``-identical) and deletes attributes that did not exist before. One
attribute is patched at most once, so the records are independent and any tail of them can be
undone on its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class PatchRecord:
    """One patched attribute: ``owner.name`` was ``original`` (or absent) and is now ``replacement``."""

    owner: Any
    name: str
    original: Any
    replacement: Any

    @property
    def existed(self) -> bool:
        """Whether ``owner`` had the attribute in its own ``__dict__`` before patching."""
        return self.original is not _MISSING


class PatchRegistry:
    """Applies patches and undoes them in reverse order."""

    def __init__(self) -> None:
        self._records: list[PatchRecord] = []

    def patch(self, owner: Any, name: str, replacement: Any) -> None:
        """Set ``owner.name = replacement``, remembering what was there.

        Only the owner's own ``__dict__`` entry is remembered: for a class that inherits the
        attribute, revert deletes the override so the inherited one shows again.

        Raises:
            RuntimeError: ``owner.name`` is already patched by this registry.
        """
        if any(r.owner is owner and r.name == name for r in self._records):
            raise RuntimeError(f"{_describe(owner)}.{name} is already patched")
        own = vars(owner) if hasattr(owner, "__dict__") else {}
        original = own.get(name, _MISSING)
        self._records.append(PatchRecord(owner, name, original, replacement))
        setattr(owner, name, replacement)

    def restore_all(self) -> None:
        """Undo every patch, last first, and forget them."""
        self.restore_after(0)

    def restore_after(self, count: int) -> None:
        """Undo the patches applied after the first ``count`` (``len(registry)`` taken before a
        group of patches undoes just that group), last first, and forget them."""
        while len(self._records) > count:
            record = self._records.pop()
            if record.existed:
                setattr(record.owner, record.name, record.original)
            else:
                delattr(record.owner, record.name)

    def records(self) -> tuple[PatchRecord, ...]:
        """The patches in force, in the order they were applied."""
        return tuple(self._records)

    def __len__(self) -> int:
        return len(self._records)


def _describe(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__name__
