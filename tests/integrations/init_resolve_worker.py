"""Builds a tiny Llama the way an HF Trainer script does (``apply_from_config`` before the model, the
config as a dict with a ``"memascend"`` section, ``zero.Init``, ``deepspeed.initialize(config_params=)``)
and prints what the engine got next to what ``memascend finetune``'s resolver gives for the model::

    python tests/integrations/init_resolve_worker.py --nvme DIR

One JSON line ``INIT_RESOLVE_REPORT {...}``: ``engine`` and ``finetune`` each hold
``sub_group_size``, ``reduce_bucket_size`` and ``max_in_cpu``; ``norm_patched`` says whether the
gradient norm keeps stock's grouping; ``reverted`` whether ``revert()`` gave ``deepspeed.initialize``
back.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _user_config(nvme: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1 << 30,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": nvme, "pin_memory": True},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True}},
        "memascend": {},
    }


def _finetune_values(nvme: str) -> dict:
    """What ``memascend finetune --from-scratch llama-tiny`` resolves for the same config."""
    import torch
    from transformers import AutoModelForCausalLM

    from memascend.config import FROM_SCRATCH_PRESETS, ModelConfig, OffloadConfig, RunConfig
    from memascend.config.render import model_shape, resolve
    from memascend.models.loading import llama_config

    preset = FROM_SCRATCH_PRESETS["llama-tiny"]
    with torch.device("meta"):
        shape = model_shape(AutoModelForCausalLM.from_config(llama_config(preset)))
    cfg = RunConfig(model=ModelConfig(from_scratch=preset), offload=OffloadConfig(nvme_path=nvme))
    zero = resolve(cfg, shape, world_size=1).ds_config["zero_optimization"]
    return {"sub_group_size": zero.get("sub_group_size"), "reduce_bucket_size": zero.get("reduce_bucket_size"),
            "max_in_cpu": zero["offload_param"].get("max_in_cpu", 1_000_000_000)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nvme", required=True)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", DS_ACCELERATOR="cpu")
    import deepspeed
    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as stage3
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import memascend.integrations.deepspeed as ma_ds
    from memascend.config import FROM_SCRATCH_PRESETS
    from memascend.models.loading import llama_config

    stock_initialize, stock_norm = deepspeed.initialize, stage3._get_norm_groups
    finetune = _finetune_values(args.nvme)  # a meta-device model: before transformers sees ZeRO-3
    cfg = _user_config(args.nvme)
    ma_ds.apply_from_config(cfg)  # the README's one call, before the model exists
    deepspeed.init_distributed(dist_backend="gloo")
    hf_ds = HfDeepSpeedConfig(cfg)  # noqa: F841 - transformers builds the model under zero.Init
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(FROM_SCRATCH_PRESETS["llama-tiny"]))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config_params=cfg)
    zero = engine._config.zero_config
    report = {
        "engine": {"sub_group_size": engine.optimizer.sub_group_size, "reduce_bucket_size": zero.reduce_bucket_size,
                   "max_in_cpu": zero.offload_param.max_in_cpu},
        "finetune": finetune,
        "norm_patched": stage3._get_norm_groups is not stock_norm,
        "user_config_untouched": cfg == _user_config(args.nvme),
    }
    ma_ds.revert()
    report["reverted"] = deepspeed.initialize is stock_initialize and stage3._get_norm_groups is stock_norm
    print("INIT_RESOLVE_REPORT " + json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip DeepSpeed/gloo teardown


if __name__ == "__main__":
    main()
