"""Fine-tune with Hugging Face accelerate under DeepSpeed ZeRO-3, parameters and optimizer state on
NVMe, with memascend as a drop-in: a ``"memascend"`` section in the DeepSpeed config given to
``DeepSpeedPlugin(hf_ds_config=...)`` and one ``apply_from_config`` call before the model is built.
The training loop is accelerate's own (``accelerator.prepare``, ``accelerator.backward``).

    python3 examples/accelerate_finetune.py --nvme-path ./memascend-swap --steps 3
    python3 examples/accelerate_finetune.py --nvme-path ./memascend-swap --steps 3 --no-memascend  # stock
    torchrun --nproc-per-node 2 examples/accelerate_finetune.py --nvme-path ./memascend-swap       # two ranks
    accelerate launch --use_deepspeed --num_processes 2 examples/accelerate_finetune.py \
        --nvme-path ./memascend-swap

The model (a from-scratch Llama preset of memascend or the built-in SmolLM2-135M), the random-token
data and the DeepSpeed JSON are those of ``examples/hf_trainer.py``, with every value accelerate does
not fill itself written out. On a host without a GPU, DeepSpeed runs on its CPU accelerator: the
script starts accelerate's ``PartialState(cpu=True)`` before the ``Accelerator`` (which must be
created with ``cpu=False``: ``Accelerator(cpu=True)`` drops DeepSpeed altogether), as HF Trainer does
for ``use_cpu=True``, and then DeepSpeed's own process group (gloo), which accelerate starts only on
GPUs and ``zero.Init`` needs. ``accelerate launch`` on a CPU host needs ``--use_deepspeed`` (without
it, it starts one process whatever ``--num_processes`` says) and never ``--cpu`` (no DeepSpeed then).

The last line on stdout is ``ACCELERATE_RESULT {json}`` with the per-step training losses (the mean
over ranks, also as ``float.hex`` strings for a bit-exact comparison), the DeepSpeed sizes the engine
ran with and whether memascend was applied.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer import RandomTokens, build_model, single_process_env  # noqa: E402  (the sibling example)

LEARNING_RATE = 1e-4


def ds_config(nvme_path: str, micro_batch: int, world_size: int, memascend: bool) -> dict:
    """The DeepSpeed config: ZeRO-3, parameters and optimizer state on NVMe, bf16, AdamW; every value
    written out (accelerate fills only the batch sizes, accumulation, clipping and lr / weight decay)."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world_size,
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": LEARNING_RATE, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True},
        },
    }
    if memascend:
        # every optimization on; the model-dependent sizes ("auto" by default) are resolved by
        # deepspeed.initialize, which accelerate.prepare calls. Do not write "auto" here: accelerate
        # refuses every "auto" it does not fill itself.
        cfg["memascend"] = {}
    return cfg


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvme-path", required=True, help="swap folder on local NVMe (created)")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--from-scratch", default="llama-tiny", help="memascend from-scratch preset")
    model.add_argument("--model", help="memascend model name or Hugging Face folder (e.g. smollm2-135m)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--no-memascend", action="store_true", help="stock DeepSpeed: no section, no apply")
    args = parser.parse_args(argv)
    for flag in ("steps", "micro_batch", "seq_len"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    return args


def _accelerator(cfg: dict, cuda: bool):
    """An ``Accelerator`` that runs DeepSpeed with ``cfg``; on a CPU host through DeepSpeed's CPU
    accelerator (``PartialState(cpu=True)`` first: device cpu, gloo between ranks)."""
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    if not cuda:
        PartialState(cpu=True)  # starts torch.distributed (gloo) under a launcher
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    if not cuda:
        # zero.Init (the model) sizes its config by DeepSpeed's own process group, which accelerate
        # starts only on GPUs; without it every rank would see a world of one
        # ("train_batch_size ... 2 != 1 * 1 * 1")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    return accelerator


def train(args: argparse.Namespace) -> dict:
    """Run ``args.steps`` optimizer steps; the result dict printed as ``ACCELERATE_RESULT``."""
    import torch
    from accelerate.utils import DummyOptim, set_seed
    from torch.utils.data import DataLoader

    memascend = not args.no_memascend
    world_size = int(os.environ["WORLD_SIZE"])
    os.makedirs(args.nvme_path, exist_ok=True)
    cfg = ds_config(args.nvme_path, args.micro_batch, world_size, memascend)
    if memascend:
        import memascend.integrations.deepspeed as ma_ds

        ma_ds.apply_from_config(cfg)  # before the model is built; deepspeed.initialize sizes the rest
    accelerator = _accelerator(cfg, torch.cuda.is_available())
    set_seed(1234)
    model = build_model(args)  # under zero.Init: the plugin registered the ZeRO-3 config with transformers
    data = RandomTokens(args.steps * args.micro_batch * world_size, args.seq_len, model.config.vocab_size)
    loader = DataLoader(data, batch_size=args.micro_batch, shuffle=False)
    optimizer = DummyOptim(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)  # the config's AdamW
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach().float(), reduction="mean")))
    zero = model._config.zero_config
    return {"memascend": memascend, "losses": losses, "losses_hex": [x.hex() for x in losses],
            "sub_group_size": int(zero.sub_group_size), "reduce_bucket_size": int(zero.reduce_bucket_size),
            "max_in_cpu": int(zero.offload_param.max_in_cpu)}


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    if not args.no_memascend:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # torch reads it when it loads (enable_torch_thp)
    single_process_env()
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    result = train(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print("ACCELERATE_RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip DeepSpeed/gloo teardown
