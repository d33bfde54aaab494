"""Builds one tiny ZeRO-3 engine (parameters and optimizer on NVMe), stock or with memascend applied,
and prints what ``_create_fp32_partitions`` left: per optimizer sub-group its fp32 swap file's size
and the SHA-256 of its values (the first ``numel`` fp32 elements; the I/O padding after them is not
compared: stock's is whatever its reused buffer held), or for a sub-group kept in DRAM the SHA-256 of
its fp32 tensor; and memascend's chunked-build statistics.

Run as a subprocess by ``test_ds_chunked_init.py`` (one DeepSpeed process per engine)::

    python tests/integrations/chunked_init_worker.py --engine memascend --nvme DIR --chunk-numel 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import socket
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("baseline", "memascend"), required=True)
    parser.add_argument("--nvme", required=True)
    parser.add_argument("--chunk-numel", type=int, default=4096)
    parser.add_argument("--sub-group-size", type=int, default=1_200_000)
    parser.add_argument("--dram-numel", type=int, default=0, help="memascend optimizer_dram_numel")
    parser.add_argument("--fast-init", action="store_true", help="offload_optimizer.fast_init")
    parser.add_argument("--param-buffer-numel", type=int, default=1 << 20,
                        help="offload_param.buffer_size (fast_init stages a whole sub-group in one)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args()

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", DS_ACCELERATOR="cpu")
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # 4096 x 256 embedding and lm_head (1 Mi elements, 2 MiB in bf16: swapped, above the 1 MiB
    # min_aio_bytes), attention and MLP matrices of 64 Ki and 256 Ki elements (kept in DRAM): with
    # sub-groups of 1,200,000 elements each sub-group mixes swapped and DRAM partitions, which a
    # window of a few thousand elements splits at unaligned offsets.
    model_cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                            tie_word_embeddings=False)
    cfg = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 3, "sub_group_size": args.sub_group_size,
            "offload_param": {"device": "nvme", "nvme_path": args.nvme, "buffer_count": 8, "buffer_size": args.param_buffer_numel,
                              "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme, "buffer_count": 4,
                                  "fast_init": args.fast_init},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True},
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if args.engine == "memascend":
        import memascend.integrations.deepspeed as ma_ds

        # The config's sub-groups, max_in_cpu and bucket as given (no model-sized rewrite), so the
        # sub-groups are stock's.
        ma_ds.apply(ma_ds.MemAscendSettings(optimizer_chunk_numel=args.chunk_numel,
                                            optimizer_dram_numel=args.dram_numel or None,
                                            optimizer_sub_group_numel=None, param_dram_numel=None,
                                            reduce_bucket_numel=None))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = LlamaForCausalLM(model_cfg)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    opt = engine.optimizer
    swapper = opt.optimizer_swapper
    groups = []
    for i, fp32 in enumerate(opt.fp32_partitioned_groups_flat):
        numel = int(opt.fp16_partitioned_groups_flat_numel[i])
        info = swapper._get_param_swap_info(fp32) if opt._swappable_optimizer_subgroup(i) else None
        if info is None:
            values = fp32.detach().contiguous().view(torch.uint8).numpy().tobytes()
            groups.append({"numel": numel, "swapped": False, "sha256": hashlib.sha256(values).hexdigest()})
            continue
        path = info.tensors[0].swap_path
        with open(path, "rb") as f:
            values = f.read(numel * 4)
        groups.append({"numel": numel, "swapped": True, "file_bytes": os.path.getsize(path),
                       "sha256": hashlib.sha256(values).hexdigest(), "fp32_numel": fp32.numel(),
                       "requires_grad": bool(fp32.requires_grad), "ds_id": str(fp32.ds_id)})
    from deepspeed.runtime.zero.partition_parameters import PartitionedParamStatus

    statuses = [[str(p.ds_status), str(p.ds_tensor.status), int(p.data.numel())] for p in model.parameters()]
    stats = skipped = None
    if args.engine == "memascend":
        from memascend.integrations.deepspeed import chunked_init, grad_hook_setup

        found = chunked_init.stats(opt)
        stats = dataclasses.asdict(found) if found is not None else None
        skipped = grad_hook_setup.skipped(opt)
    report = {"engine": args.engine, "groups": groups, "chunked_init": stats, "statuses": statuses,
              "hooks": len(opt._grad_acc_hooks), "hook_gathers_skipped": skipped,
              "subgroup_to_device": {str(k): v for k, v in getattr(opt, "subgroup_to_device", {}).items()},
              "param_groups_empty": all(not g["params"] for g in opt.optimizer.param_groups),
              "not_available": str(PartitionedParamStatus.NOT_AVAILABLE)}
    print("CHUNKED_INIT_REPORT " + json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip DeepSpeed/gloo teardown


if __name__ == "__main__":
    main()
