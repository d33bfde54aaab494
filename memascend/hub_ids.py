"""The shape of a Hugging Face Hub repository id (``org/name``): one pattern for model ids
(:mod:`memascend.models.hub`) and data set ids (:mod:`memascend.data.tables`)."""

from __future__ import annotations

import re

#: ``org/name`` as the Hub spells repository ids: letters, digits, ``.``, ``_``, ``-``.
HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def looks_like_repo_id(name: str, not_suffixes: tuple[str, ...] = ()) -> bool:
    """Whether ``name`` reads as a Hub repository id and does not end (case-insensitively) in one of
    ``not_suffixes`` (file names that would otherwise match, e.g. ``dir/model.gguf``)."""
    return bool(HUB_REPO_ID.match(name)) and not name.lower().endswith(not_suffixes)
