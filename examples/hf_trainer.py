"""Fine-tune with Hugging Face's Trainer under DeepSpeed ZeRO-3, parameters and optimizer state on NVMe,
with memascend as a drop-in: a ``"memascend"`` section in the DeepSpeed config and one
``apply_from_config`` call before the model is built. Nothing else changes in the script.

    python3 examples/hf_trainer.py --nvme-path ./memascend-swap --steps 3
    python3 examples/hf_trainer.py --nvme-path ./memascend-swap --steps 3 --no-memascend   # stock DeepSpeed
    python3 examples/hf_trainer.py --nvme-path ./memascend-swap --steps 3 --baseline       # stock + fixes
    memascend run -- python3 examples/hf_trainer.py --nvme-path ./memascend-swap --no-apply  # no apply line
    torchrun --nproc-per-node 2 examples/hf_trainer.py --nvme-path ./memascend-swap        # two ranks

The model is a from-scratch Llama preset of memascend (``--from-scratch llama-tiny``, random weights)
or the built-in SmolLM2-135M (``--model smollm2-135m``), in bf16; the data are random token ids
(seeded), so the run needs no download. On a host without a GPU the Trainer needs ``use_cpu=True``
(DeepSpeed's CPU accelerator and gloo); the script sets it when CUDA is unavailable.

On two or more ranks, compare against ``--baseline`` rather than ``--no-memascend``: stock DeepSpeed
0.19.8 with the optimizer on NVMe silently loses the O_DIRECT reads of gradient fragments that sit
at unaligned host addresses (SmolLM2-135M on two ranks: the losses part from step 2 on), which
memascend fixes in both its engines (``fix_unaligned_gradient_io``); ``--baseline`` is stock DeepSpeed
with only that fix, as ``memascend finetune --engine baseline``.

With ``--no-apply`` the script is what a user of a framework has: the ``"memascend"`` section in the
config and no memascend code; ``memascend run -- COMMAND`` applies it (without ``memascend run`` the
section is ignored and DeepSpeed runs stock).

The last line on stdout is ``HF_TRAINER_RESULT {json}`` with the per-step training losses (as
``float.hex`` strings too, for a bit-exact comparison), the DeepSpeed sizes the engine ran with,
whether memascend was applied (``applied``) and the class of the parameter swapper.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def ds_config(nvme_path: str, memascend: bool) -> dict:
    """The DeepSpeed config: ZeRO-3, parameters and optimizer state on NVMe, bf16; "auto" values are
    filled by the Trainer from its TrainingArguments, the "memascend" section's by memascend."""
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 1 << 30,
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True},
        },
    }
    if memascend:
        # Every optimization on; the keys are MemAscendSettings' fields. Its model-dependent sizes
        # default to "auto" and are resolved by deepspeed.initialize: do not write "auto" here, the
        # Trainer (accelerate) refuses every "auto" it does not fill itself.
        cfg["memascend"] = {}
    return cfg


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvme-path", required=True, help="swap folder on local NVMe (created)")
    parser.add_argument("--output", default="runs/hf-trainer", help="Trainer output_dir")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--from-scratch", default="llama-tiny", help="memascend from-scratch preset")
    model.add_argument("--model", help="memascend model name or Hugging Face folder (e.g. smollm2-135m)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    engine = parser.add_mutually_exclusive_group()
    engine.add_argument("--no-memascend", action="store_true", help="stock DeepSpeed: no section, no apply")
    engine.add_argument("--no-apply", action="store_true",
                        help="the section without the apply_from_config line: memascend applies only under "
                             "'memascend run -- python3 examples/hf_trainer.py ...'")
    engine.add_argument("--baseline", action="store_true",
                        help="no section; only memascend's correctness fixes applied (as memascend finetune "
                             "--engine baseline): stock DeepSpeed 0.19.8 loses unaligned gradient reads on two "
                             "ranks and trains on other numbers")
    return parser.parse_args(argv)


def single_process_env() -> None:
    """A run started without a launcher is rank 0 of 1 (DeepSpeed asks for the rendezvous variables)."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def build_model(args: argparse.Namespace):
    from transformers import AutoModelForCausalLM

    from memascend.config import ModelConfig, parse_from_scratch
    from memascend.models.loading import llama_config, resolve_model

    if args.model:
        return AutoModelForCausalLM.from_pretrained(str(resolve_model(ModelConfig(name_or_path=args.model)).hf_dir))
    return AutoModelForCausalLM.from_config(llama_config(parse_from_scratch(args.from_scratch)))


class RandomTokens:
    """``n`` sequences of ``seq_len`` token ids below ``vocab`` (seeded), labels = inputs."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        import torch

        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    memascend = not (args.no_memascend or args.baseline)
    if memascend and not args.no_apply:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # torch reads it when it loads (enable_torch_thp)
    single_process_env()
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from transformers import Trainer, TrainingArguments, set_seed

    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    cfg = ds_config(args.nvme_path, memascend)
    if memascend and not args.no_apply:
        import memascend.integrations.deepspeed as ma_ds

        ma_ds.apply_from_config(cfg)  # before the model is built; deepspeed.initialize sizes the rest
    elif args.baseline:
        import memascend.integrations.deepspeed as ma_ds
        from memascend.config.settings import MemAscendSettings

        ma_ds.apply(MemAscendSettings.baseline())  # every optimization off, the correctness fixes on
    training_args = TrainingArguments(
        output_dir=args.output, deepspeed=cfg, bf16=True, use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=args.micro_batch, max_steps=args.steps, learning_rate=1e-4,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], seed=1234,
        dataloader_num_workers=0, disable_tqdm=True)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # zero.Init (the model below) needs the process group; on a CPU host (use_cpu) nothing has
        # started it yet at this point
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    set_seed(training_args.seed)
    model = build_model(args)  # after TrainingArguments: transformers builds it under zero.Init
    data = RandomTokens(args.steps * args.micro_batch * int(os.environ.get("WORLD_SIZE", "1")), args.seq_len,
                         model.config.vocab_size)
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    trainer.train()
    losses = [float(e["loss"]) for e in trainer.state.log_history if "loss" in e]
    zero = trainer.model_wrapped._config.zero_config
    seam = sys.modules.get("memascend.integrations.deepspeed")  # loaded by apply_from_config or memascend run
    swapper = getattr(next(trainer.model_wrapped.module.parameters()), "nvme_swapper", None)
    result = {"memascend": memascend, "baseline": args.baseline, "losses": losses, "losses_hex": [x.hex() for x in losses],
              "sub_group_size": int(zero.sub_group_size), "reduce_bucket_size": int(zero.reduce_bucket_size),
              "max_in_cpu": int(zero.offload_param.max_in_cpu),
              "applied": seam is not None and seam.applied_settings() is not None,
              "param_swapper": type(swapper).__name__}
    if int(os.environ.get("RANK", "0")) == 0:
        print("HF_TRAINER_RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip DeepSpeed/gloo teardown
