"""Validate plain keyword dicts (a ``--config`` file, CLI flags) into memascend's config dataclasses
with pydantic, so that every error names the field it is about.

The config classes stay standard-library dataclasses (frozen, keyword-only, their own range checks
in ``__post_init__``); pydantic checks the types, strictly: a ``float`` field takes a number (an
``int`` too) but not the string ``"1e-4"``, nor ``nan`` or ``inf``; an ``int`` field an integer
(not ``2.5``, ``2.0``, ``"7"`` or ``true``); a ``str`` field a string; a ``bool`` field ``true`` or
``false``; a ``Literal`` one of its values; a section an object without unknown keys. Strictness is
applied to every scalar of the class's schema (:func:`_strict`), so fields added later are covered
without annotating them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from memascend.errors import UserError

T = TypeVar("T")

Loc = tuple[str | int, ...]
"""Where in the input an error is: ``("train", "lr")``."""


def _strict(node: Any) -> Any:
    """Make every scalar schema in pydantic's core schema ``node`` strict (in place): no coercion from
    another type, no non-finite floats, no unknown keyword in a dataclass."""
    if isinstance(node, dict):
        kind = node.get("type")
        if kind in ("int", "float", "str", "bool"):
            node["strict"] = True
        if kind == "float":
            node["allow_inf_nan"] = False
        if kind == "dataclass-args":
            node["extra_behavior"] = "forbid"
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)
    return node


@functools.cache
def _validator(cls: type):
    import copy

    from pydantic import TypeAdapter
    from pydantic_core import SchemaValidator

    return SchemaValidator(_strict(copy.deepcopy(TypeAdapter(cls).core_schema)))


def validate_config(cls: type[T], values: Mapping[str, Any], name_of: Callable[[Loc], str]) -> T:
    """Build ``cls`` (a config dataclass) from ``values``, a nested dict of keyword values.

    Args:
        cls: the dataclass; nested dataclass fields take dicts.
        values: its keyword arguments (fields left out take their defaults, which are not checked).
        name_of: how an error names the field at a location, e.g. ``("train", "lr")`` ->
            ``run.toml: train.lr`` or ``--lr``.

    Returns:
        The instance (its ``__post_init__`` ran, with its own range checks).

    Raises:
        UserError: the first type error, as ``<name_of(loc)>: <pydantic's message>, got <value>``, e.g.
            ``run.toml: train.lr: Input should be a valid number, got '1e-4'``; or what a
            ``__post_init__`` raised.
    """
    from pydantic import ValidationError

    try:
        return _validator(cls).validate_python(dict(values))
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = tuple(err["loc"])
        got = "" if err["type"] in ("missing", "unexpected_keyword_argument") else f", got {err['input']!r}"
        raise UserError(f"{name_of(loc)}: {err['msg']}{got}") from None


def dotted(loc: Loc) -> str:
    """``("train", "lr")`` -> ``train.lr``."""
    return ".".join(str(part) for part in loc)
