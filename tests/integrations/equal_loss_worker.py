"""One tiny ZeRO-3 NVMe-offload training run, stock or with memascend applied; prints a JSON report.

Run as a subprocess by ``test_equal_loss.py`` (one DeepSpeed process per engine, so neither run
sees the other's patches or locked memory)::

    python tests/integrations/equal_loss_worker.py --engine memascend --dtype bf16 --nvme DIR --steps 3

The report holds the per-step losses as ``float.hex`` strings (bit-exact comparison), the peak
locked memory (VmLck, sampled every 2 ms by a thread and at each phase) and peak RSS (VmHWM).

On a CUDA host (``--device cuda``, used by ``test_gpu_fp16_overflow.py``) the run may also use
fp16 with dynamic loss scaling (``--dtype fp16``) and make the gradients of chosen steps
non-finite (``--inject 2:inf --inject 4:nan``): the loss of that step is multiplied by inf or nan
before ``engine.backward``, so every gradient element is inf or nan (``inf * 0`` is nan) whatever
ZeRO-3 partitioning does afterwards. The report then also holds, per step, the loss scale after
the step (``engine.optimizer.loss_scale``), whether the optimizer flagged an overflow
(``engine.optimizer.overflow``) and whether the engine skipped the step (``engine.skipped_steps``
grew). Without ``--device cuda`` the run is the CPU one above (``DS_ACCELERATOR=cpu``, gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class PeakSampler:
    """Polls VmLck and VmRSS of this process; keeps the maxima (KiB)."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s = period_s
        self.peak_vmlck_kib = 0
        self.peak_rss_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        self.peak_vmlck_kib = max(self.peak_vmlck_kib, _status_kib("VmLck"))
        self.peak_rss_kib = max(self.peak_rss_kib, _status_kib("VmRSS"))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.period_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


class WritebackProbe:
    """Records the parameter swapper's write-back buffer (``partitioned_swap_buffer``): its bytes at
    named points, and per ``swap_out_partitioned_params`` the phase, thread and bytes held then."""

    def __init__(self, model) -> None:
        self.swapper = next(p.nvme_swapper for p in model.parameters() if getattr(p, "nvme_swapper", None))
        self.phase = "initialize"
        self.held: dict[str, int] = {}
        self.writes: list[dict] = []
        original = self.swapper.swap_out_partitioned_params

        def swap_out_partitioned_params(dst_fp16_params, src_fp32_params):
            original(dst_fp16_params, src_fp32_params)
            self.writes.append({"phase": self.phase, "thread": threading.current_thread().name,
                                "held_bytes": self._bytes()})

        self.swapper.swap_out_partitioned_params = swap_out_partitioned_params

    def _bytes(self) -> int:
        buffer = self.swapper.partitioned_swap_buffer
        return 0 if buffer is None else buffer.numel() * buffer.element_size()

    def mark(self, name: str) -> None:
        self.held[name] = self._bytes()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_config(dtype: str, nvme: str, sub_group_size: int, param_buffer_count: int, clip: float) -> dict:
    """DeepSpeed config of the run: ZeRO-3, params and optimizer on NVMe, tight stock buffers."""
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "steps_per_print": 10_000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": sub_group_size,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": param_buffer_count,
                              "buffer_size": 1 << 20, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        # Dynamic loss scaling (loss_scale 0, the default), starting at 2**8; hysteresis 1 halves the
        # scale on every overflow; the 1000-step window never doubles it in a short run.
        # Keys: deepspeed/runtime/precision_config.py (DeepSpeedFP16Config), DeepSpeed 0.19.8.
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 1000,
                       "hysteresis": 1, "min_loss_scale": 1}
    return cfg


INJECT_KINDS = {"inf": float("inf"), "nan": float("nan")}


def parse_inject(value: str) -> tuple[int, str]:
    """``STEP:KIND`` (1-based step, KIND ``inf`` or ``nan``) -> ``(step, kind)``."""
    step_s, sep, kind = value.partition(":")
    try:
        step = int(step_s)
    except ValueError:
        step = 0
    if not sep or step < 1 or kind not in INJECT_KINDS:
        raise argparse.ArgumentTypeError(f"expected STEP:KIND with STEP >= 1 and KIND inf or nan, got {value!r}")
    return step, kind


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("baseline", "memascend"), required=True)
    parser.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), required=True,
                        help="fp16 (dynamic loss scaling) needs --device cuda")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: DeepSpeed's CPU accelerator and gloo; cuda: the CUDA accelerator and nccl")
    parser.add_argument("--inject", type=parse_inject, action="append", default=[], metavar="STEP:KIND",
                        help="make every gradient of 1-based STEP non-finite (KIND inf or nan), through the "
                             "loss; repeatable")
    parser.add_argument("--nvme", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sub-group-size", type=int, default=1_000_000_000)
    parser.add_argument("--param-buffer-count", type=int, default=8,
                        help="offload_param.buffer_count (stock needs 8 for this model, fails with 5)")
    parser.add_argument("--ma-sub-group-numel", type=lambda v: v if v == "auto" else int(v), default=None,
                        help="memascend only: optimizer_sub_group_numel (rewrites sub_group_size); "
                             "default: keep the config's")
    parser.add_argument("--ma-chunk-numel", type=lambda v: None if v == "none" else (v if v == "auto" else int(v)),
                        default="auto", help="memascend only: optimizer_chunk_numel ('none': stock's whole "
                                             "sub-group step); default: auto")
    parser.add_argument("--clip", type=float, default=0.0, help="gradient_clipping (0: off)")
    args = parser.parse_args()
    if args.dtype == "fp16" and args.device != "cuda":
        parser.error("--dtype fp16 needs --device cuda (fp16 loss scaling is checked on CUDA only; "
                     "DeepSpeed's CPU accelerator supports fp32 and bf16)")
    injections = dict(args.inject)
    if len(injections) != len(args.inject) or any(step > args.steps for step in injections):
        parser.error(f"--inject: steps must be distinct and within 1..{args.steps}, got {args.inject}")

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    if args.device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    else:
        os.environ["DS_ACCELERATOR"] = "cuda"  # not an inherited "cpu"
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (before CUDA init)
    import deepspeed
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch.cuda.is_available() is False")
        # Both engines take the same deterministic kernels, so their losses compare bit for bit.
        torch.use_deterministic_algorithms(True, warn_only=True)
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    with PeakSampler() as sampler:
        cfg = ds_config(args.dtype, args.nvme, args.sub_group_size, args.param_buffer_count, args.clip)
        model_cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=2048, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                                tie_word_embeddings=False)
        applied = None
        if args.engine == "memascend":
            import memascend.integrations.deepspeed as ma_ds

            with torch.device("meta"):
                numels = [p.numel() for p in LlamaForCausalLM(model_cfg).parameters()]
            cfg, applied = ma_ds.prepare_ds_config(
                cfg, ma_ds.MemAscendSettings(optimizer_sub_group_numel=args.ma_sub_group_numel,
                                             optimizer_chunk_numel=args.ma_chunk_numel), param_numels=numels)
            ma_ds.apply(applied)
        deepspeed.init_distributed(dist_backend="gloo" if args.device == "cpu" else "nccl")
        hf_ds = HfDeepSpeedConfig(cfg)  # noqa: F841 - keeps transformers' zero-3 awareness alive (fp32 route)
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = LlamaForCausalLM(model_cfg)
        sampler.sample()
        writeback = WritebackProbe(model) if applied is not None else None
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        sampler.sample()
        if writeback is not None:
            writeback.mark("after_initialize")
        gen = torch.Generator().manual_seed(1234)  # CPU generator: the same ids on either device
        losses = []
        # ZeRO-3 optimizer (DeepSpeedZeroOptimizer_Stage3): `loss_scale` is a property returning
        # loss_scaler.cur_scale; `overflow` is set by step(); the engine counts `skipped_steps`.
        initial_loss_scale = getattr(engine.optimizer, "loss_scale", None)
        loss_scales, overflows, skipped = [], [], []
        for step in range(1, args.steps + 1):
            ids = torch.randint(0, model_cfg.vocab_size, (2, 64), generator=gen)
            if writeback is not None:
                writeback.phase = f"step {step}"
                writeback.mark(f"before_forward_{step}")
            if args.device == "cuda":
                ids = ids.to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            skipped_before = engine.skipped_steps
            if step in injections:  # every gradient becomes inf/nan: d(c * loss) = c * d(loss)
                engine.backward(loss * INJECT_KINDS[injections[step]])
            else:
                engine.backward(loss)
            engine.step()
            sampler.sample()
            losses.append(float(loss.float().item()))
            scale = getattr(engine.optimizer, "loss_scale", None)
            loss_scales.append(None if scale is None else float(scale))
            overflows.append(bool(getattr(engine.optimizer, "overflow", False)))
            skipped.append(engine.skipped_steps > skipped_before)

        from memascend.integrations.deepspeed import swap_buffer_breakdown

        breakdown = swap_buffer_breakdown(engine)
        pool = None
        if applied is not None:
            swapper = next(p.nvme_swapper for p in model.parameters() if getattr(p, "nvme_swapper", None))
            stats = swapper.pool.stats()
            opt_mgr = engine.optimizer.optimizer_swapper.swap_buffer_manager
            pool = {"param_pool_reserved_bytes": stats.reserved_bytes,
                    "param_pool_classes": {str(k): [c.slots, c.peak_in_use] for k, c in stats.classes.items()},
                    "param_locked_bytes": swapper.locked_bytes(),
                    "optimizer_buffers": opt_mgr.peak_buffers_in_use,
                    "optimizer_locked_bytes": opt_mgr.peak_locked_bytes,
                    "allocator": swapper.locked_allocator.source}
            chunked = engine.optimizer.__dict__.get("_memascend_chunked")  # memascend.integrations.deepspeed.chunked_step
            pool["chunked_sub_groups"] = sorted(chunked.sub_groups) if chunked else []
            pool["chunk_locked_bytes"] = chunked.peak_locked_bytes if chunked else 0
            from memascend.integrations.deepspeed import step_overlap

            step_overlap.join_all()  # the last step's worker
            pool["step_overlap"] = step_overlap.stats(engine.optimizer)
            writeback.mark("after_last_step")
            pool["writeback"] = {"held_bytes": writeback.held, "writes": writeback.writes}
    report = {"engine": args.engine, "dtype": args.dtype, "losses_hex": [x.hex() for x in losses],
              "sub_group_numels": [int(n) for n in engine.optimizer.fp16_partitioned_groups_flat_numel],
              "losses": losses, "peak_vmlck_kib": sampler.peak_vmlck_kib, "peak_rss_kib": sampler.peak_rss_kib,
              "vmhwm_kib": _status_kib("VmHWM"), "pool": pool, "swap_buffers": breakdown,
              "device": args.device, "injected": {str(k): v for k, v in sorted(injections.items())},
              "initial_loss_scale": None if initial_loss_scale is None else float(initial_loss_scale),
              "loss_scales": loss_scales, "overflows": overflows, "skipped": skipped,
              "skipped_steps": int(engine.skipped_steps)}
    print("EQUAL_LOSS_REPORT " + json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip DeepSpeed/gloo teardown (slow, and irrelevant to the measurement)


if __name__ == "__main__":
    main()
