"""The DeepSpeed JSON of a run: rendered by :mod:`memascend.resolve` (the one place), re-exported here
for the imports that still name this module."""

from __future__ import annotations

from memascend.resolve import (
    AIO_ALIGN_NUMEL,
    DS_DEFAULT_MAX_IN_CPU_NUMEL,
    DS_DEFAULT_PARAM_BUFFER_COUNT,
    DS_DEFAULT_PARAM_BUFFER_SIZE_NUMEL,
    Derived,
    ModelShape,
    derived_as_dicts,
    load_user_ds_config,
    model_shape,
    per_rank_param_numel,
    render_ds_config,
)

__all__ = [
    "AIO_ALIGN_NUMEL",
    "DS_DEFAULT_MAX_IN_CPU_NUMEL",
    "DS_DEFAULT_PARAM_BUFFER_COUNT",
    "DS_DEFAULT_PARAM_BUFFER_SIZE_NUMEL",
    "Derived",
    "ModelShape",
    "derived_as_dicts",
    "load_user_ds_config",
    "model_shape",
    "per_rank_param_numel",
    "render_ds_config",
]
