"""A run's configuration, in one package.

- :mod:`~memascend.config.schema`: :class:`RunConfig` and its frozen sections (model, data, train,
  offload, lora), each field with its docstring, its checks and, where it has one, its CLI flag
  (:mod:`~memascend.config.flags`); :mod:`~memascend.config.presets` and
  :mod:`~memascend.config.families`: the from-scratch models; :mod:`~memascend.config.settings`:
  :class:`MemAscendSettings`, what the DeepSpeed seam applies.
- :mod:`~memascend.config.loader`: a ``--config`` file (TOML or YAML) and the flags merged into a
  :class:`RunConfig` (validated by :mod:`~memascend.config.validate`); :mod:`~memascend.config.user_ds`:
  the user's ``--deepspeed-config``, read once, and its conflicts with the flags.
- :mod:`~memascend.config.render`: the one place that turns a config, a model shape and a rank count
  into DeepSpeed's JSON (:func:`~memascend.config.render.resolve`), with the model-dependent sizes of
  :mod:`~memascend.config.sizing` and DeepSpeed 0.19.8's defaults from one table
  (:mod:`~memascend.config.ds_defaults`).

Imports :mod:`memascend.errors` and :mod:`memascend.units` only.
"""

from __future__ import annotations

from memascend.config.loader import build_run_config, load_config_file
from memascend.config.presets import FROM_SCRATCH_PRESETS, FromScratchConfig, parse_from_scratch
from memascend.config.schema import (
    DEFAULT_DATA,
    DEFAULT_MAX_DATA_BYTES,
    DEFAULT_MODEL,
    MAX_EPOCHS,
    MAX_SEED,
    MAX_STEPS,
    STORE_FILE_SUFFIX,
    DataConfig,
    LoraConfig,
    ModelConfig,
    OffloadConfig,
    RunConfig,
    SwapTarget,
    TrainConfig,
    is_block_device,
)
from memascend.config.settings import DS_CONFIG_SECTION, MemAscendSettings

__all__ = [
    "DEFAULT_DATA",
    "DEFAULT_MAX_DATA_BYTES",
    "DEFAULT_MODEL",
    "DS_CONFIG_SECTION",
    "FROM_SCRATCH_PRESETS",
    "MAX_EPOCHS",
    "MAX_SEED",
    "MAX_STEPS",
    "STORE_FILE_SUFFIX",
    "DataConfig",
    "FromScratchConfig",
    "LoraConfig",
    "MemAscendSettings",
    "ModelConfig",
    "OffloadConfig",
    "RunConfig",
    "SwapTarget",
    "TrainConfig",
    "build_run_config",
    "is_block_device",
    "load_config_file",
    "parse_from_scratch",
]
