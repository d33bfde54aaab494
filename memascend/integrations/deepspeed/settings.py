"""Settings of the DeepSpeed seam (re-exported): :class:`MemAscendSettings`, one ``enable_*`` flag per
MemAscend optimization, lives in the low layer :mod:`memascend.settings` so that the run config can
carry it; :func:`rewrite_ds_config`, which writes the settings that live in DeepSpeed's own config,
lives with the model-dependent sizing in :mod:`memascend.integrations.deepspeed.sizing`.
"""

from __future__ import annotations

from memascend.integrations.deepspeed.sizing import rewrite_ds_config
from memascend.settings import DS_CONFIG_SECTION, MemAscendSettings, load_ds_config

__all__ = ["DS_CONFIG_SECTION", "MemAscendSettings", "load_ds_config", "rewrite_ds_config"]
