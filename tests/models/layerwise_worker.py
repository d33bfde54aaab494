"""Loads small Hugging Face folders both ways under ZeRO-3 (one rank, CPU) and prints what differs::

    python tests/models/layerwise_worker.py --root DIR

For each case (tied / untied embeddings, sharded / one file, the checkpoint in fp32 or bf16, training
in bf16 or fp32) it writes a random-weight Llama with ``save_pretrained``, builds it with
``memascend.models.loading.build_model`` stock (``layerwise=False``) and layer by layer, gathers both
and compares every parameter and buffer bit for bit, plus the training flag, config and generation
config. One JSON line ``LAYERWISE_REPORT {...}`` per case: ``differ`` (names whose tensors differ),
``unlike_file`` (checkpoint tensors the layer-wise model does not hold, cast to its dtype),
``cached_bytes`` (the files' page cache after the stock and after the layer-wise load), ``calls``
(how often ``transformers``' zero3 copy ran) and ``largest_call_keys`` (most keys in one). Then one
``FROM_SCRATCH_REPORT {...}`` per family and dtype: a from-scratch model built both ways, compared.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

CASES = [
    # name, tie_word_embeddings, max_shard_size (None: one file), checkpoint dtype, training dtype
    ("tied-sharded-fp32-to-bf16", True, "40KB", "float32", "bf16"),
    ("untied-sharded-bf16-to-bf16", False, "40KB", "bfloat16", "bf16"),
    ("untied-onefile-fp32-to-fp32", False, None, "float32", "fp32"),
    ("tied-onefile-bf16-to-fp32", True, None, "bfloat16", "fp32"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_folder(root: Path, name: str, tied: bool, shard: str | None, dtype: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(7)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    out = root / name
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    os.sync()  # written back, so that the loader's POSIX_FADV_DONTNEED can drop the pages
    return out


def _resident_bytes(folder: Path) -> int | None:
    """Page-cache bytes of the folder's safetensors files (util-linux ``fincore``; ``None`` without it)."""
    import shutil
    import subprocess

    if shutil.which("fincore") is None:
        return None
    files = [str(f) for f in sorted(folder.glob("*.safetensors"))]
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(x) for x in out.split())


def _gathered(model) -> dict:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        tensors = {f"param:{k}": v.detach().clone() for k, v in model.state_dict().items()}
    tensors.update({f"buffer:{k}": b.detach().clone() for k, b in model.named_buffers()})
    return tensors


def _build(folder: Path, dtype: str, layerwise: bool, calls: list):
    import transformers.modeling_utils as mu

    from memascend.config import ModelConfig
    from memascend.models.loading import ModelSource, build_model

    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": dtype == "bf16"},
          "zero_optimization": {"stage": 3}}
    stock_into = mu._load_state_dict_into_zero3_model

    def counting(model, state_dict, *args, **kwargs):  # what the stock copy is given, per call
        calls.append(sorted(state_dict))
        return stock_into(model, state_dict, *args, **kwargs)

    mu._load_state_dict_into_zero3_model = counting
    try:
        model, hf_ds = build_model(ModelSource(folder, str(folder)), ModelConfig(name_or_path=str(folder)), ds, 0,
                                   layerwise=layerwise)
    finally:
        mu._load_state_dict_into_zero3_model = stock_into
    del hf_ds
    return model


def run_case(root: Path, name: str, tied: bool, shard: str | None, ckpt_dtype: str, dtype: str) -> dict:
    import torch

    folder = _write_folder(root, name, tied, shard, ckpt_dtype)
    stock_calls: list = []
    mine_calls: list = []
    stock = _build(folder, dtype, False, stock_calls)
    cached_after_stock = _resident_bytes(folder)
    mine = _build(folder, dtype, True, mine_calls)
    cached_after_mine = _resident_bytes(folder)
    a, b = _gathered(stock), _gathered(mine)
    from safetensors.torch import load_file

    on_file = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    unlike_file = sorted(k for k, v in on_file.items() if not torch.equal(b[f"param:{k}"], v.to(b[f"param:{k}"].dtype)))
    differ = sorted(k for k in a.keys() | b.keys()
                    if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))
    return {
        "case": name,
        "shards": len(list(folder.glob("*.safetensors"))),
        "tensors": len(a),
        "param_dtype": str(next(mine.parameters()).dtype),
        "differ": differ,
        "file_tensors": len(on_file),
        "unlike_file": unlike_file,
        "tied": mine.lm_head.weight is mine.model.embed_tokens.weight,
        "stock_tied": stock.lm_head.weight is stock.model.embed_tokens.weight,
        "training": [stock.training, mine.training],
        "config_equal": stock.config.to_dict() == mine.config.to_dict(),
        "generation_config_equal": stock.generation_config.to_dict() == mine.generation_config.to_dict(),
        "cached_bytes": [cached_after_stock, cached_after_mine],
        "calls": len(mine_calls),
        "stock_calls": len(stock_calls),
        "largest_call_keys": max((len(c) for c in mine_calls), default=0),
        "call_groups": [sorted({k.split(".")[2] if k.startswith("model.layers.") else k for k in c})
                        for c in mine_calls],
    }


FAMILIES = {  # transformers config classes with small sizes: from-scratch construction in the training dtype
    "LlamaConfig": {"num_key_value_heads": 2, "intermediate_size": 64, "tie_word_embeddings": False},
    "MistralConfig": {"num_key_value_heads": 2, "intermediate_size": 64},
    "Qwen2Config": {"num_key_value_heads": 2, "intermediate_size": 64, "tie_word_embeddings": True},
    "GPTNeoXConfig": {"intermediate_size": 64, "tie_word_embeddings": False},
    "PhiConfig": {"intermediate_size": 64, "tie_word_embeddings": False},
}


def run_from_scratch(family: str, dtype: str) -> dict:
    """A from-scratch model built both ways (``layerwise`` False / True) with the same seed, compared."""
    import dataclasses

    import torch
    import transformers

    from memascend.config import FROM_SCRATCH_PRESETS, ModelConfig
    from memascend.models import loading

    cfg = getattr(transformers, family)(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        max_position_embeddings=64, **FAMILIES[family])
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": dtype == "bf16"},
          "zero_optimization": {"stage": 3}}
    model_cfg = dataclasses.replace(ModelConfig(), from_scratch=FROM_SCRATCH_PRESETS["llama-tiny"])
    names = [n for n in ("from_scratch_config", "llama_config") if hasattr(loading, n)]  # the name build_model calls
    stock = {n: getattr(loading, n) for n in names}
    for n in names:  # this family instead of the preset's Llama
        setattr(loading, n, lambda _fs: cfg.__class__.from_dict(cfg.to_dict()))
    try:
        built = [loading.build_model(None, model_cfg, ds, 1234, layerwise=lw)[0] for lw in (False, True)]
    finally:
        for n, fn in stock.items():
            setattr(loading, n, fn)
    a, b = (_gathered(m) for m in built)
    differ = sorted(k for k in a.keys() | b.keys()
                    if k not in a or k not in b or a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]))
    return {"family": family, "dtype": dtype, "tensors": len(a), "differ": differ,
            "model_class": [type(m).__name__ for m in built],
            "param_dtype": str(next(built[1].parameters()).dtype),
            "config_equal": built[0].config.to_dict() == built[1].config.to_dict(),
            "default_dtype_after": str(torch.get_default_dtype())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", DS_ACCELERATOR="cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    for case in CASES:
        print("LAYERWISE_REPORT " + json.dumps(run_case(Path(args.root), *case)), flush=True)
    for family in FAMILIES:
        for dtype in ("bf16", "fp32"):
            print("FROM_SCRATCH_REPORT " + json.dumps(run_from_scratch(family, dtype)), flush=True)


if __name__ == "__main__":
    main()
