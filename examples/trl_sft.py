"""Supervised fine-tuning with TRL's ``SFTTrainer`` under DeepSpeed ZeRO-3, parameters and optimizer
state on NVMe, with no memascend code: the DeepSpeed config (``examples/ds_zero3_nvme.json``) holds a
``"memascend"`` section, and ``memascend run`` in front of the command applies it.

    memascend run -- python3 examples/trl_sft.py --model MODEL_DIR --data chat.jsonl \\
        --deepspeed examples/ds_zero3_nvme.json --nvme-path ./memascend-swap --steps 3
    python3 examples/trl_sft.py ...       # the same without memascend run: stock DeepSpeed
    memascend run -- torchrun --nproc-per-node 2 examples/trl_sft.py ...   # two ranks

``--lora-rank R`` trains LoRA adapters (PEFT, every linear layer) instead of every weight (stock
DeepSpeed 0.19.8 needs the config's ``stage3_max_reuse_distance`` and ``stage3_prefetch_bucket_size``
of 0 for it with parameters on NVMe; docs/usage.md says why).
``--model`` is a Hugging Face folder with its tokenizer (a local path: the run is offline); ``--data``
a JSON Lines file of conversations (``{"messages": [{"role": "user", ...}, {"role": "assistant",
...}]}``) or of ``{"text": ...}`` rows. ``--nvme-path`` replaces both ``nvme_path`` values of the
config. On a host without a GPU the trainer needs ``use_cpu=True`` (DeepSpeed's CPU accelerator and
gloo); the script sets it when CUDA is unavailable.

The last line on stdout is ``TRL_SFT_RESULT {json}``: the per-step training losses (also as
``float.hex``), the DeepSpeed sizes the engine ran with, whether memascend was applied and the class
of the parameter swapper (read from the running process, for comparisons; the script imports no
memascend code).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder (with its tokenizer)")
    parser.add_argument("--data", required=True, help="JSON Lines file: messages or text rows")
    parser.add_argument("--deepspeed", required=True, help="DeepSpeed config JSON (ZeRO-3, NVMe offload)")
    parser.add_argument("--nvme-path", help="swap folder on local NVMe (created); replaces the config's nvme_path")
    parser.add_argument("--output", default="runs/trl-sft", help="SFTConfig output_dir")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256, help="SFTConfig max_length (tokens)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="train LoRA adapters of this rank on every linear layer (PEFT); 0: full fine-tune")
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


def ds_config(path: str, nvme_path: str | None) -> dict:
    """The DeepSpeed config at ``path``, ``nvme_path`` (created) put in for both offloads when given."""
    cfg = json.loads(Path(path).read_text())
    if nvme_path is not None:
        Path(nvme_path).mkdir(parents=True, exist_ok=True)
        for key in ("offload_param", "offload_optimizer"):
            cfg["zero_optimization"][key]["nvme_path"] = nvme_path
    return cfg


def _memascend_state(trainer) -> dict:
    seam = sys.modules.get("memascend.integrations.deepspeed")  # loaded only where memascend run applied it
    swapper = getattr(next(trainer.model_wrapped.module.parameters()), "nvme_swapper", None)
    zero = trainer.model_wrapped._config.zero_config
    return {"applied": seam is not None and seam.applied_settings() is not None,
            "param_swapper": type(swapper).__name__, "sub_group_size": int(zero.sub_group_size),
            "reduce_bucket_size": int(zero.reduce_bucket_size), "max_in_cpu": int(zero.offload_param.max_in_cpu)}


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    single_process_env()
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from datasets import load_dataset
    from transformers import set_seed
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(
        output_dir=args.output, deepspeed=ds_config(args.deepspeed, args.nvme_path), bf16=True,
        use_cpu=not torch.cuda.is_available(), per_device_train_batch_size=args.micro_batch, max_steps=args.steps,
        learning_rate=1e-5, lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
        seed=1234, max_length=args.seq_len, dataloader_num_workers=0, disable_tqdm=True)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import deepspeed  # zero.Init (the model below) needs the process group; use_cpu starts none

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    set_seed(config.seed)
    data = load_dataset("json", data_files=args.data, split="train")
    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=args.model, args=config, train_dataset=data,  # the model is built under zero.Init
                         peft_config=peft_config)
    trainer.train()
    losses = [float(e["loss"]) for e in trainer.state.log_history if "loss" in e]
    result = {"losses": losses, "losses_hex": [x.hex() for x in losses], **_memascend_state(trainer)}
    if int(os.environ.get("RANK", "0")) == 0:
        print("TRL_SFT_RESULT " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip DeepSpeed/gloo teardown
