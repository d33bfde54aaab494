"""Trains a tiny tied Llama the way a script driving DeepSpeed itself does (``zero.Init``,
``deepspeed.initialize(config_params=)``, its own loop), first stock, then with memascend applied by
``apply_from_config`` before the model exists, in one process::

    python tests/integrations/tied_embedding_worker.py [--steps N]

One JSON line ``TIED_EMBEDDING_REPORT {"stock": {...}, "memascend": {...}}``, each with
``losses_hex`` (each step's loss, ``float.hex``), ``weight_sha256`` (the tied weight's bytes after the
last step, gathered), ``replaced`` (the embedding had memascend's instance ``forward`` while
training), ``grad_path`` and ``stats`` (:mod:`memascend.integrations.deepspeed.tied_embedding`),
``hooks_during``/``hooks_after`` (post-accumulate-grad hooks on the tied weight while training and
after ``revert()``: DeepSpeed's, and memascend's one) and ``forward_after`` (the instance ``forward``
still there after ``revert()``).
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


def _config(engine_name: str) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1 << 30,
        "bf16": {"enabled": True}, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
    }
    if engine_name == "memascend":
        cfg["memascend"] = {}
    return cfg


def _train(engine_name: str, steps: int) -> dict:
    """Build the model under ``zero.Init`` (memascend applied first for ``memascend``), train ``steps``
    steps, return what ran (see the module docstring); memascend is reverted before returning."""
    import hashlib

    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import memascend.integrations.deepspeed as ma_ds
    from memascend.config import FROM_SCRATCH_PRESETS
    from memascend.integrations.deepspeed import tied_embedding
    from memascend.models.loading import llama_config

    cfg = _config(engine_name)
    if engine_name == "memascend":
        ma_ds.apply_from_config(cfg)  # the README's one call, before the model exists
    hf_ds = HfDeepSpeedConfig(cfg)  # noqa: F841 - transformers builds the model under zero.Init
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(FROM_SCRATCH_PRESETS["llama-tiny"]))
    embed = model.get_input_embeddings()
    assert model.get_output_embeddings().weight is embed.weight, "llama-tiny ties its embeddings"
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config_params=cfg)
    replaced = "forward" in vars(embed)
    hooks_during = len(getattr(embed.weight, "_post_accumulate_grad_hooks", None) or {})
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, vocab // 8, (2, 24), generator=gen)  # few distinct tokens: repeated rows
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.item()).hex())
    with deepspeed.zero.GatheredParameters([embed.weight]):
        weight_sha = hashlib.sha256(embed.weight.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    report = {"losses_hex": losses, "weight_sha256": weight_sha, "replaced": replaced,
              "grad_path": tied_embedding.grad_path(), "stats": tied_embedding.stats(), "hooks_during": hooks_during}
    ma_ds.revert()
    report["hooks_after"] = len(getattr(embed.weight, "_post_accumulate_grad_hooks", None) or {})
    report["forward_after"] = "forward" in vars(embed)
    engine.destroy()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", DS_ACCELERATOR="cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    report = {name: _train(name, args.steps) for name in ("stock", "memascend")}
    print("TIED_EMBEDDING_REPORT " + json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip DeepSpeed/gloo teardown


if __name__ == "__main__":
    main()
