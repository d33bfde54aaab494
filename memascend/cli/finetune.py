"""``memascend finetune``: offloaded fine-tuning (ZeRO-3 with params/optimizer on NVMe) on CPU or CUDA."""

from __future__ import annotations

import os
import sys

import click

from memascend.config import DEFAULT_DATA, DEFAULT_MODEL, build_run_config, load_toml
from memascend.errors import UserError


def _torchrun_cmd(nproc: int) -> list[str]:
    """This command under torchrun with ``nproc`` ranks on this host."""
    argv = [a for a in sys.argv[1:]]
    # drop --nproc N / --nproc=N so the children run single-rank logic
    cleaned, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        cleaned.append(a)
    from memascend.train.dist import free_port

    cmd = [
        sys.executable,
        "-m",
        "memascend.train.launch",  # torch.distributed.run, without its ChildFailedError traceback
        f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        "-m",
        "memascend",
        *cleaned,
    ]
    return cmd


@click.command(context_settings={"show_default": True})
@click.option("--model", "model", default=None, help=f"HF model folder, .gguf file, or built-in name [default: {DEFAULT_MODEL}]")
@click.option(
    "--from-scratch",
    default=None,
    metavar="SPEC",
    help="Random-weight Llama instead of the model's weights: a preset (llama-tiny, llama-0.1b .. llama-3b), "
    "'hidden=2048,layers=16,heads=32,vocab=49152', or a .toml/.json file",
)
@click.option("--data", default=None, help=f"Built-in corpus (shakespeare, chitchat), .jsonl file, or .txt/.md files/folders [default: {DEFAULT_DATA}]")
@click.option("--seq-len", type=int, default=None, help="Tokens per sequence [default: 256]")
@click.option("--micro-batch", type=int, default=None, help="Sequences per micro-batch per rank [default: 4]")
@click.option("--grad-accum", type=int, default=None, help="Micro-batches per optimizer step [default: 1]")
@click.option("--steps", type=int, default=None, help="Optimizer steps [default: 10]")
@click.option("--epochs", type=float, default=None, help="Passes over the training data (overrides --steps)")
@click.option("--lr", type=float, default=None, help="AdamW learning rate [default: 1e-4]")
@click.option("--seed", type=int, default=None, help="Seed for the data split and order, from-scratch init and every RNG the steps draw from (dropout: torch, Python, numpy, seed + rank per rank); checkpoints carry the RNG states [default: 1234]")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None, help="Training precision [default: bf16]")
@click.option("--offload-param", type=click.Choice(["nvme", "cpu", "none"]), default=None, help="Where parameter partitions live [default: nvme]")
@click.option("--offload-optimizer", type=click.Choice(["nvme", "cpu", "none"]), default=None, help="Where optimizer state lives [default: nvme]")
@click.option(
    "--nvme-path",
    default=None,
    help="Where swapped parameters/optimizer state go. A folder: stock DeepSpeed swap files there. "
    "A block device (/dev/nvme0n1p3) or a file ending in .store: memascend's raw store (no filesystem; "
    "a new file is preallocated to the run's estimated size and deleted at exit, an existing file is kept; a "
    "device keeps only the store header). Several ranks on one host: a comma-separated list with one device or file per rank, or one "
    ".store path that becomes PATH.rank<N> for rank N. "
    "[default: ./memascend-swap or $MEMASCEND_NVME_PATH]",
)
@click.option(
    "--nvme-overwrite",
    is_flag=True,
    default=False,
    help="Allow the raw store to overwrite a target that carries a filesystem, a partition table, another "
    "store, or a non-empty file of any content (refused otherwise; such a file is kept at exit; a mounted "
    "device or a target another run is using is always refused). A store left by an earlier memascend "
    "run is reused without it",
)
@click.option("--no-crc", is_flag=True, default=False,
              help="Raw store: skip the CRC32C per extent (checked on every read by default); for speed runs")
@click.option("--save-checkpoint", "save_checkpoint_dir", type=click.Path(file_okay=False), default=None,
              help="Save a DeepSpeed checkpoint (tag global_step<N>) here after the last step; with a raw store "
              "the swapped optimizer state is exported as files into it")
@click.option("--resume", "resume_dir", type=click.Path(file_okay=False), default=None,
              help="Load the latest checkpoint in this folder before training and continue from its step "
              "up to --steps (total optimizer steps); 'auto': the newest complete checkpoint in "
              "OUTPUT/checkpoints (none: start from step 0). Shapes, dtype, ranks and checksums are checked first")
@click.option("--checkpoint-every", type=int, default=None,
              help="Save a checkpoint to OUTPUT/checkpoints/global_step<N> every N steps (atomic)")
@click.option("--checkpoint-every-minutes", type=float, default=None,
              help="Save a checkpoint there when this many minutes passed since the last one")
@click.option("--keep-checkpoints", type=int, default=None, help="Periodic checkpoints kept [default: 2]")
@click.option("--allow-nonfinite-loss", is_flag=True, default=False,
              help="Keep training on a NaN/inf loss (by default the run stops, exit code 5, saving nothing)")
@click.option("--output", "output_dir", default=None, help="Output folder (model, report.json, memory timeline) [default: runs/latest]")
@click.option("--engine", type=click.Choice(["baseline", "memascend"]), default=None, help="memascend's memory optimisations (default) or stock ZeRO-Infinity (baseline) [default: memascend]")
@click.option("--eval-blocks", type=int, default=None, help="Held-out blocks evaluated before/after training [default: 16]")
@click.option("--activation-checkpointing/--no-activation-checkpointing", default=None, help="Recompute activations in backward [default: off]")
@click.option("--save-model/--no-save-model", default=None, help="Write the fine-tuned model as an HF folder [default: on]")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None, help="TOML file with [model] [data] [train] [offload] sections; flags override it")
@click.option("--deepspeed-config", type=click.Path(dir_okay=False), default=None, help="Your DeepSpeed JSON to start from; its explicit values win")
@click.option("--nproc", type=int, default=None, help="Launch this many ranks on this host (torchrun); default: one, or what a launcher set")
@click.option("--local_rank", "--local-rank", "launcher_local_rank", type=int, default=None, hidden=True,
              help="Set by the deepspeed launcher; LOCAL_RANK from the environment is used")
def finetune(**kw) -> None:
    """Fine-tune a causal LM with DeepSpeed ZeRO-3, parameters and optimizer state offloaded (ZeRO-Infinity).

    Defaults: SmolLM2-135M-Instruct on Shakespeare, bf16, micro-batch 4 x 256 tokens, 10 steps,
    parameters and optimizer state on NVMe (./memascend-swap). Writes the fine-tuned model
    (HF folder), report.json and memory_timeline.{csv,png} to --output.
    """
    kw.pop("launcher_local_rank")
    nproc = kw.pop("nproc")
    if nproc is not None and nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    from memascend.train.supervisor import is_supervised, supervise

    if nproc is not None and nproc > 1 and "RANK" not in os.environ:
        # the launch runs under a parent that cleans up after ranks killed outright
        sys.exit(supervise(_torchrun_cmd(nproc)))
    file_values = load_toml(kw.pop("config_file")) if kw.get("config_file") else {}
    kw.pop("config_file", None)
    overrides = {
        "model": {"name_or_path": kw["model"], "from_scratch": kw["from_scratch"]},
        "data": {"source": kw["data"], "seq_len": kw["seq_len"], "eval_blocks": kw["eval_blocks"]},
        "train": {
            "micro_batch": kw["micro_batch"],
            "grad_accum": kw["grad_accum"],
            "steps": kw["steps"],
            "epochs": kw["epochs"],
            "lr": kw["lr"],
            "seed": kw["seed"],
            "dtype": kw["dtype"],
            "activation_checkpointing": kw["activation_checkpointing"],
            "save_model": kw["save_model"],
            "save_checkpoint": kw["save_checkpoint_dir"],
            "resume": kw["resume_dir"],
            "checkpoint_every": kw["checkpoint_every"],
            "checkpoint_every_minutes": kw["checkpoint_every_minutes"],
            "keep_checkpoints": kw["keep_checkpoints"],
            "allow_nonfinite_loss": kw["allow_nonfinite_loss"] or None,
        },
        "offload": {
            "param": kw["offload_param"],
            "optimizer": kw["offload_optimizer"],
            "nvme_path": kw["nvme_path"],
            "nvme_overwrite": kw["nvme_overwrite"] or None,
            "enable_crc": False if kw["no_crc"] else None,
        },
        "output_dir": kw["output_dir"],
        "engine": kw["engine"],
        "deepspeed_config": kw["deepspeed_config"],
    }
    cfg = build_run_config(file_values, overrides)
    if "RANK" not in os.environ and not is_supervised():
        # Checked input, then the job in a child: a SIGKILL/OOM kill/abort of the training process
        # still gets one line and its swap files removed (memascend.train.supervisor).
        sys.exit(supervise([sys.executable, "-m", "memascend", *sys.argv[1:]]))
    if cfg.engine == "memascend":
        # Before torch loads (the runner imports it): c10 reads THP_MEM_ALLOC_ENABLE only then.
        from memascend.memory import torch_thp

        torch_thp.enable_before_torch(cfg.memascend)
    from memascend.train.runner import run_finetune

    report = run_finetune(cfg)
    if report is not None:
        _print_summary(report, cfg.output_dir)


def _print_summary(rep: dict, output_dir: str) -> None:
    from rich.console import Console
    from rich.table import Table

    gib = float(1 << 30)
    mem, ev = rep["memory"], rep["eval"]
    t = Table(title=f"memascend finetune ({rep['engine']})", show_header=False)

    def fmt(x, nd=4):
        return "n/a" if x is None else f"{x:.{nd}f}"

    t.add_row("held-out loss before -> after", f"{fmt(ev['loss_before'])} -> {fmt(ev['loss_after'])}")
    t.add_row("steps / median s per step", f"{rep['num_steps']} / {fmt(rep['median_step_s'], 2)}")
    t.add_row("median tokens/s", fmt(rep["median_tokens_per_s"], 1))
    t.add_row("peak RSS", f"{mem['peak_rss_bytes'] / gib:.2f} GiB")
    t.add_row("peak locked (VmLck)", f"{mem['peak_locked_bytes'] / gib:.2f} GiB")
    t.add_row("NVMe read / written", f"{rep['nvme']['read_bytes'] / gib:.2f} / {rep['nvme']['write_bytes'] / gib:.2f} GiB")
    t.add_row("outputs", output_dir)
    Console(stderr=True).print(t)
    if not rep["steps"]:
        raise UserError("no training step ran")
