"""The fine-tuning job: load, initialize ZeRO-3 (ZeRO-Infinity offload), evaluate, train, save, report.

One call, :func:`run_finetune`, per process; under torchrun or the ``deepspeed`` launcher every
rank calls it. Rank 0 writes the outputs. Swap files live in a private folder under the NVMe path
and are removed at exit, including on Ctrl-C, SIGTERM and errors. When ``--nvme-path`` names a
block device or a ``.store`` file (:mod:`memascend.train.store_target`), parameters and optimizer
state go to a raw store instead (:mod:`memascend.integrations.deepspeed.raw_store`), closed at exit
(a file target is deleted; a device keeps the store header so the next run reuses it).
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import sys
import time
from pathlib import Path

from memascend.config import MAX_STEPS, OffloadConfig, RunConfig
from memascend.errors import UserError
from memascend.io.runlock import TargetBusyError
from memascend.telemetry import MemorySampler, read_proc_io
from memascend.train import checkpoints as ckpt
from memascend.train import determinism
from memascend.train import dist as dist_setup
from memascend.train import report as report_mod
from memascend.train.ds_config import derived_as_dicts, load_user_ds_config, model_shape, render_ds_config
from memascend.train.preflight import (
    check_aio_for_swap_folder,
    check_memlock_for_run,
    check_stock_param_dram,
    upfront_locked_bytes,
)
from memascend.train.run_log import RunLog, write_json_atomic
from memascend.train.store_target import (
    is_store_target,
    resolve_store_target,
    store_file_bytes,
)
from memascend.train.supervisor import record_run_state
from memascend.train.swapdir import (
    TerminationAsInterrupt,
    estimate_nvme_bytes,
    folder_bytes,
    lock_swap_folder,
    make_run_id,
    prepare_swap_dir,
    remove_swap_dir,
)
from memascend.units import DTYPE_BYTES, format_bytes


def _check_dtype_supported(dtype: str, device_type: str) -> None:
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if dtype == "fp16" and not acc.is_fp16_supported():
        raise UserError(f"--dtype fp16 is not supported on this device ({device_type}); use bf16 or fp32")
    if dtype == "bf16" and not acc.is_bf16_supported():
        raise UserError(f"--dtype bf16 is not supported on this device ({device_type}); use fp16 or fp32")


def _check_output_dir(out_dir: Path) -> None:
    """Fail early if ``--output`` cannot be created or written (without creating anything)."""
    probe = out_dir.resolve()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"--output is inside a file, not a folder: {out_dir}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"--output is not writable: {out_dir}")


def _meta_shape(src, cfg: RunConfig):
    """Parameter layout from a meta-device instance (no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memascend.models.loading import llama_config

    try:
        hf_cfg = llama_config(cfg.model.from_scratch) if cfg.model.from_scratch else AutoConfig.from_pretrained(src.hf_dir)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(hf_cfg)
    except (ValueError, KeyError, OSError) as exc:  # an architecture transformers has no causal LM for
        raise UserError(
            f"model {src.origin}: no causal-LM model can be built from its config.json "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        ) from None
    return model_shape(meta)


def _broadcast(obj, rank: int):
    import torch.distributed as tdist

    box = [obj if rank == 0 else None]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def _all_reduce_sum(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as tdist

    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return list(values)
    from deepspeed.accelerator import get_accelerator

    # nccl reduces device tensors only; gloo (CPU accelerator) takes host tensors.
    t = torch.tensor(values, dtype=torch.float64, device=get_accelerator().current_device_name())
    tdist.all_reduce(t)
    return t.cpu().tolist()


def evaluate(engine, blocks, micro_batch: int, info, sampler: MemorySampler) -> float | None:
    """Token-weighted mean cross-entropy over the held-out blocks (all ranks take part)."""
    import torch

    n = len(blocks) // info.world_size * info.world_size
    if n == 0:
        return None
    sampler.phase("eval")
    engine.eval()
    mine = list(range(info.rank, n, info.world_size))
    loss_sum = tok_sum = 0.0
    with torch.no_grad():
        for i in range(0, len(mine), micro_batch):
            idx = torch.tensor(mine[i : i + micro_batch])
            ids, labels = blocks.input_ids[idx], blocks.labels[idx]
            dev = engine.device
            out = engine(input_ids=ids.to(dev), labels=labels.to(dev))
            count = float((labels[:, 1:] != -100).sum())
            loss_sum += float(out.loss) * count
            tok_sum += count
    engine.train()
    loss_sum, tok_sum = _all_reduce_sum([loss_sum, tok_sum])
    return loss_sum / tok_sum if tok_sum else None


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="fine-tune", unit="step", disable=not enabled, dynamic_ncols=True)


class _Cleanup:
    """What must be undone at exit, filled in as the run progresses."""

    def __init__(self) -> None:
        self.swap_dir: Path | None = None
        self.swap_lock = None
        self.revert = None
        self.raw_store = None
        self.created_out_dir: Path | None = None
        self.run_log: RunLog | None = None

    def run(self, *, failed: bool = False) -> None:
        """Undo everything; every step runs even when an earlier one raises (the first error is
        re-raised at the end). After a failed run, an output folder this run created and left
        empty is removed too."""
        first: BaseException | None = None
        for step in (self._swap_dir, self._revert, self._raw_store, *((self._out_dir,) if failed else ())):
            try:
                step()
            except BaseException as exc:  # noqa: BLE001 - finish the cleanup, raise the first
                first = first or exc
        if first is not None:
            raise first

    def _swap_dir(self) -> None:
        remove_swap_dir(self.swap_dir)
        if self.swap_lock is not None:
            self.swap_lock.release()

    def _revert(self) -> None:
        if self.revert is not None:
            self.revert()

    def _raw_store(self) -> None:
        # Also when the interrupt came between apply_raw_store's return and self.raw_store being
        # set: the applied store is known to its module, and its file must not stay behind.
        store_mod = sys.modules.get("memascend.integrations.deepspeed.raw_store")
        if self.raw_store is not None or (store_mod is not None and store_mod.active_raw_store() is not None):
            from memascend.integrations.deepspeed.raw_store import revert_raw_store

            revert_raw_store(close=True)

    def _out_dir(self) -> None:
        if self.created_out_dir is not None:
            with contextlib.suppress(OSError):
                self.created_out_dir.rmdir()  # only if empty


def run_finetune(cfg: RunConfig) -> dict | None:
    """Run one fine-tuning job and write its outputs to ``cfg.output_dir``.

    Returns:
        The report dict on rank 0, ``None`` on other ranks.

    Raises:
        UserError: bad input detected before or during the run (nothing is left behind).
    """
    info = dist_setup.setup_env()
    cleanup = _Cleanup()
    with TerminationAsInterrupt(), MemorySampler() as sampler:
        try:
            result = _run(cfg, info, sampler, cleanup)
        except BaseException as exc:
            # The run's own error (e.g. a checksum mismatch naming tensor and offset) is what the
            # user must see; a second failure while cleaning up must not replace it.
            if cleanup.run_log is not None:
                with contextlib.suppress(Exception):
                    # bad input leaves nothing behind; a crash or an interrupt leaves its record
                    cleanup.run_log.fail(exc, discard=isinstance(exc, UserError))
            with contextlib.suppress(Exception):
                cleanup.run(failed=True)
            raise
        cleanup.run()
        return result


def _run(cfg: RunConfig, info, sampler: MemorySampler, cleanup: _Cleanup) -> dict | None:
    save_checkpoint_dir, resume_dir = cfg.train.save_checkpoint, cfg.train.resume
    is_rank0 = info.rank == 0
    out_dir = Path(cfg.output_dir)
    t_start = time.time()

    # ---- load: cheap checks first, then model source and data --------------------------------
    sampler.phase("load")
    from memascend.data import BlockSampler, build_blocks, read_documents
    from memascend.models.loading import build_model, load_tokenizer, max_positions, resolve_model

    user_ds = load_user_ds_config(cfg.deepspeed_config) if cfg.deepspeed_config else None
    src = resolve_model(cfg.model)
    limit = max_positions(src, cfg.model.from_scratch)
    if cfg.data.seq_len > limit:
        raise UserError(f"--seq-len {cfg.data.seq_len} exceeds the model's limit of {limit} tokens")
    _check_output_dir(out_dir)
    tokenizer = load_tokenizer(src)
    docs = read_documents(cfg.data.source, cfg.data.max_documents)
    split = build_blocks(docs, tokenizer, cfg.data.seq_len, cfg.data.eval_blocks, cfg.train.seed)
    shape = _meta_shape(src, cfg)
    if cfg.model.from_scratch and cfg.model.from_scratch.vocab_size < len(tokenizer):
        raise UserError(
            f"from-scratch vocab_size {cfg.model.from_scratch.vocab_size} is smaller than the tokenizer's {len(tokenizer)}"
        )

    dist_setup.init_process_group()
    _check_dtype_supported(cfg.train.dtype, info.device_type)
    run_id = _broadcast(make_run_id(), info.rank)
    # Checkpoints (memascend/train/checkpoints.py): the one to resume is checked against this run
    # (parameter names and shapes, dtype, ranks) and every file's checksum before DeepSpeed starts;
    # checkpoint folders are checked for writability and space before the first step.
    resume_ck = None
    periodic_on = cfg.train.checkpoint_every is not None or cfg.train.checkpoint_every_minutes is not None
    layout = None
    if resume_dir is not None or save_checkpoint_dir is not None or periodic_on:
        layout = ckpt.meta_param_layout(src, cfg.model)
    if resume_dir is not None:
        resume_ck = ckpt.resolve_resume(resume_dir, out_dir)
        if resume_ck is not None:
            ckpt.check_compatible(resume_ck, param_shapes=layout, dtype=cfg.train.dtype, world_size=info.world_size)
            ckpt.verify_checkpoint(resume_ck, rank=info.rank, world_size=info.world_size)
        elif is_rank0:
            import sys

            print(f"memascend: --resume auto: no complete checkpoint in {ckpt.periodic_root(out_dir)}; "
                  "starting from step 0", file=sys.stderr)
    ckpt.check_checkpoint_space(cfg.train, out_dir, shape.total_numel)
    swap_dir = None
    raw_store = None
    if cfg.offload.uses_nvme:
        need = estimate_nvme_bytes(
            shape.total_numel,
            DTYPE_BYTES[cfg.train.dtype],
            cfg.offload.param == "nvme",
            cfg.offload.optimizer == "nvme",
        )
        if is_store_target(cfg.offload.nvme_path):
            raw_store = _open_raw_store(cfg.offload, info, need // info.world_size)
            cleanup.raw_store = raw_store
            record_run_state(info.rank, key_root=str(raw_store.key_root),
                             store_file=str(raw_store.target) if raw_store.created_file else None)
            swap_dir = raw_store.key_root
        else:
            check_aio_for_swap_folder()
            cleanup.swap_lock = _lock_swap_folder(cfg.offload.nvme_path, info, run_id)
            # Every rank checks (ranks may have different NVMe paths via the environment); the first
            # rank's folder name is shared so all ranks of one launch use one run folder.
            swap_dir = prepare_swap_dir(cfg.offload.nvme_path, need // info.world_size, run_id)
            cleanup.swap_dir = swap_dir
            record_run_state(info.rank, swap_dir=str(swap_dir), nvme_path=str(swap_dir.parent))
    ds_cfg, derived = render_ds_config(cfg, shape, info.world_size, str(swap_dir) if swap_dir else None, user_ds)
    if cfg.engine == "baseline":
        check_stock_param_dram(ds_cfg, shape.param_numels, info.world_size)
    micro_batch = int(ds_cfg["train_micro_batch_size_per_gpu"])
    grad_accum = int(ds_cfg["gradient_accumulation_steps"])

    if is_rank0:
        if not out_dir.exists():
            cleanup.created_out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        cleanup.run_log = RunLog(out_dir, sampler, _log_header(cfg, shape, split, info))
        record_run_state(info.rank, out_dir=str(out_dir.resolve()))

    # ---- initialize -----------------------------------------------------------------------------
    sampler.phase("initialize")
    import dataclasses

    import deepspeed

    from memascend.integrations import deepspeed as seam

    settings = seam.MemAscendSettings.from_mapping((user_ds or {}).get("memascend", {}))
    if cfg.engine == "memascend":
        ds_cfg, settings = seam.prepare_ds_config(ds_cfg, settings, param_numels=shape.param_numels,
                                                  world_size=info.world_size)
    else:
        # Stock ZeRO-Infinity plus only the correctness fixes (fix_*: false in a "memascend"
        # section turns them off, reproducing stock DeepSpeed exactly).
        fixes = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name.startswith("fix_")}
        settings = dataclasses.replace(seam.MemAscendSettings.baseline(), **fixes)
    cleanup.revert = seam.revert
    seam.apply(settings)
    engine_settings = dataclasses.asdict(settings)
    check_memlock_for_run(
        upfront_locked_bytes(ds_cfg, cfg.train.dtype, shape.largest_numel, info.world_size, cfg.engine)
    )
    model, hf_ds = build_model(src, cfg.model, ds_cfg, cfg.train.seed)
    if cfg.train.activation_checkpointing:
        model.gradient_checkpointing_enable()
    engine, _opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    del hf_ds
    first = next(engine.module.parameters())
    # The parameter's own dtype: ZeRO-3 keeps it when it frees param.data, while ds_tensor of a
    # partition that lives on NVMe only is DeepSpeed's float16 placeholder until it is swapped in.
    param_dtype = str(first.dtype).replace("torch.", "")

    global_batch_blocks = micro_batch * grad_accum * info.world_size
    if cfg.train.epochs is not None:
        steps = max(1, math.floor(cfg.train.epochs * len(split.train) / global_batch_blocks))
        if steps > MAX_STEPS:
            raise UserError(
                f"--epochs {cfg.train.epochs:g} is {steps:,} optimizer steps over {len(split.train):,} training "
                f"blocks, more than the {MAX_STEPS:,} a run may take"
            )
    else:
        steps = int(cfg.train.steps)
    start_step = 0
    client_state = None
    if resume_ck is not None:
        sampler.phase("resume")
        if raw_store is None:  # a raw-store checkpoint keeps its optimizer state outside stock's folder
            from memascend.integrations.deepspeed.raw_store import prepare_folder_resume

            prepare_folder_resume(engine, resume_ck.load_dir, resume_ck.tag)
        load_path, client_state = engine.load_checkpoint(str(resume_ck.load_dir), tag=resume_ck.tag)
        if load_path is None:
            raise UserError(f"--resume {resume_dir}: DeepSpeed found no checkpoint to load")
        start_step = int(engine.global_steps)
        if start_step > steps:
            raise UserError(f"--resume {resume_dir} is at step {start_step}, beyond --steps {steps}")
    loss_before = evaluate(engine, split.eval, micro_batch, info, sampler)
    ck_info = {
        "dtype": cfg.train.dtype,
        "world_size": info.world_size,
        "engine": cfg.engine,
        "backend": "raw_store" if raw_store is not None else ("folder" if swap_dir is not None else None),
        "param_shapes": layout,
    }

    ck_saves: list[dict] = []

    def save_ck(root: Path):
        """Atomic checkpoint of this step into ``root`` (every rank calls it)."""
        t_save = time.monotonic()
        saved = _save_ck(root)
        ck_saves.append({"path": str(saved.path), "save_s": time.monotonic() - t_save,
                         "manifest_s": saved.manifest_s, "bytes": saved.total_bytes})
        return saved

    def _save_ck(root: Path):
        return ckpt.save_checkpoint(engine, root, run_id=run_id, info=ck_info, rank=info.rank,
                                    client_state=determinism.checkpoint_client_state(info.world_size))

    periodic = ckpt.PeriodicCheckpointer(
        ckpt.periodic_root(out_dir),
        every_steps=cfg.train.checkpoint_every,
        every_minutes=cfg.train.checkpoint_every_minutes,
        keep=cfg.train.keep_checkpoints,
        save=save_ck,
        rank=info.rank,
    )

    # ---- train ----------------------------------------------------------------------------------
    block_sampler = BlockSampler(len(split.train), micro_batch, info.world_size, info.rank, cfg.train.seed)
    # Every RNG the steps draw from (dropout): seeded with seed + rank, or a checkpoint's states.
    seeding = determinism.seed_training(cfg.train.seed, info.rank, info.world_size)
    seeding["rng_from_checkpoint"] = determinism.restore_from_client_state(client_state, info.rank, info.world_size)
    io0 = read_proc_io()
    store_io0 = raw_store.store.io_counters() if raw_store is not None else None
    per_step = []
    tokens_per_step = global_batch_blocks * cfg.data.seq_len
    peak_swap_bytes = 0
    bar = _progress(steps, is_rank0)
    bar.update(start_step)
    train_t0 = time.monotonic()
    try:
        for step in range(start_step, steps):
            t0 = time.monotonic()
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            skipped_before = int(getattr(engine, "skipped_steps", 0))
            losses = []
            phase_s = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_step_s": 0.0}
            for micro in range(grad_accum):
                idx = block_sampler.indices(step * grad_accum + micro)
                ids = split.train.input_ids[idx].to(engine.device)
                labels = split.train.labels[idx].to(engine.device)
                sampler.phase("forward")
                t_phase = time.monotonic()
                loss = engine(input_ids=ids, labels=labels).loss
                sampler.phase("backward")
                t_backward = time.monotonic()
                engine.backward(loss)
                sampler.phase("step")
                t_step = time.monotonic()
                engine.step()
                t_done = time.monotonic()
                phase_s["forward_s"] += t_backward - t_phase
                phase_s["backward_s"] += t_step - t_backward
                phase_s["optimizer_step_s"] += t_done - t_step
                losses.append(float(loss.detach().float()))
            loss_sum, n = _all_reduce_sum([sum(losses), len(losses)])
            dt = time.monotonic() - t0
            rss = sampler.sample().rss_bytes
            entry = {
                "step": step + 1,
                "loss": loss_sum / n,
                "rank_losses": losses,
                "time_s": dt,
                # This rank's wall time in each phase, summed over the micro-batches (engine.step()
                # is the ZeRO-3 optimizer step, swap-in/out of the optimizer state included).
                "phase_s": phase_s,
                "tokens": tokens_per_step,
                "tokens_per_s": tokens_per_step / dt,
                "rss_bytes": rss,
                # Pages this rank's process faulted in during the step (all threads): memory handed
                # back to the OS and touched again costs one fault per page (4 KiB, or 2 MiB with THP).
                "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0,
                "skipped": int(getattr(engine, "skipped_steps", 0)) > skipped_before,
            }
            per_step.append(entry)
            if cleanup.run_log is not None:
                cleanup.run_log.step(entry)
            if raw_store is not None:
                raw_store.sample_usage()
            elif swap_dir is not None and step == start_step:
                peak_swap_bytes = folder_bytes(swap_dir)
            bar.set_postfix(
                loss=f"{entry['loss']:.4f}", tok_s=f"{entry['tokens_per_s']:.0f}", rss=f"{rss / 2**30:.2f}GiB"
            )
            bar.update(1)
            # A NaN/inf loss stops the run before anything is saved from that state.
            # fp16 excepted: a loss-scale overflow step that DeepSpeed skipped (bf16/fp32 steps that
            # DeepSpeed skips on a non-finite gradient norm are not excused).
            ckpt.check_finite_loss(step + 1, entry["loss"], skipped=entry["skipped"] and cfg.train.dtype == "fp16",
                                   allow=cfg.train.allow_nonfinite_loss)
            periodic.maybe_checkpoint(step + 1)
    finally:
        bar.close()
    train_s = time.monotonic() - train_t0
    io1 = read_proc_io()
    if raw_store is not None:
        raw_store.train_io = raw_store.store.io_counters() - store_io0
    skipped_steps = int(getattr(engine, "skipped_steps", 0))
    loss_after = evaluate(engine, split.eval, micro_batch, info, sampler)

    # ---- save -----------------------------------------------------------------------------------
    sampler.phase("save")
    checkpoint_tag = None
    if save_checkpoint_dir is not None:
        checkpoint_tag = ckpt.tag_for_step(int(engine.global_steps))
        same = Path(save_checkpoint_dir).absolute() == periodic.root.absolute()
        if not (same and periodic.saved and periodic.saved[-1] == checkpoint_tag):
            save_ck(Path(save_checkpoint_dir))
    model_dir = None
    if cfg.train.save_model:
        state_dict = engine._zero3_consolidated_16bit_state_dict()
        if is_rank0:
            model_dir = out_dir / "model"
            model_to_save = engine.module
            with contextlib.suppress(AttributeError):
                model_to_save.config.use_cache = True
            model_to_save.save_pretrained(model_dir, state_dict=state_dict, safe_serialization=True)
            tokenizer.save_pretrained(model_dir)
        del state_dict
    sampler.phase("done")

    # ---- report ---------------------------------------------------------------------------------
    summary = sampler.summary()
    from memascend.integrations.deepspeed.accounting import memory_breakdown

    breakdown = memory_breakdown(engine, summary, sampler.samples)
    import torch.distributed as tdist

    rank_peaks = [None] * info.world_size
    tdist.all_gather_object(rank_peaks, {"rank": info.rank, **{k: summary[k] for k in ("peak_rss_bytes", "peak_locked_bytes")}})
    store_ranks = None
    if raw_store is not None:  # every rank has its own store: gather each one's report
        store_ranks = [None] * info.world_size
        tdist.all_gather_object(store_ranks, {"rank": info.rank, **raw_store.report()})
    engine.destroy() if hasattr(engine, "destroy") else None
    if not is_rank0:
        return None
    rep = report_mod.build_report(
        cfg=cfg,
        ds_cfg=ds_cfg,
        derived=derived_as_dicts(derived),
        engine_settings=engine_settings,
        info=info,
        split=split,
        shape=shape,
        per_step=per_step,
        loss_before=loss_before,
        loss_after=loss_after,
        summary=summary,
        rank_peaks=rank_peaks,
        io_read_bytes=io1["read_bytes"] - io0["read_bytes"],
        io_write_bytes=io1["write_bytes"] - io0["write_bytes"],
        swap_folder_bytes=peak_swap_bytes,
        train_s=train_s,
        wall_s=time.time() - t_start,
        skipped_steps=skipped_steps,
        model_dir=str(model_dir) if model_dir else None,
        param_dtype=param_dtype,
    )
    rep["memory_breakdown"] = breakdown
    # The user's --deepspeed-config as read (its path may be gone when the report is read again, e.g.
    # by the planner's check against recorded runs).
    rep["user_deepspeed_config"] = user_ds
    rep["seeding"] = seeding
    rep["nvme"]["backend"] = "raw_store" if raw_store is not None else ("folder" if swap_dir is not None else None)
    if raw_store is not None:
        rep["nvme"]["store"] = raw_store.report()
        rep["nvme"]["store_ranks"] = store_ranks
    rep["checkpoint"] = {
        "resumed_from": str(resume_ck.path) if resume_ck is not None else None,
        "periodic_saved": periodic.saved,
        # every save of this run: wall seconds (DeepSpeed's save + hashing/fsync + rename), of which
        # manifest_s hashing and fsyncing the files (rank 0), and the checkpoint's bytes
        "saves": ck_saves,
        "start_step": start_step,
        "saved_to": save_checkpoint_dir,
        "saved_tag": checkpoint_tag,
    }
    if cleanup.run_log is not None:
        cleanup.run_log.close()
    sampler.write_csv(out_dir / "memory_timeline.csv")
    from memascend.telemetry.plot import plot_timelines

    plot_timelines(
        {cfg.engine: out_dir / "memory_timeline.csv"},
        out_dir / "memory_timeline.png",
        title=f"{cfg.model.name_or_path if not cfg.model.from_scratch else 'from-scratch'} / {cfg.engine}",
    )
    write_json_atomic(out_dir / "report.json", rep)
    return rep


def _log_header(cfg: RunConfig, shape, split, info) -> dict:
    """What a partial ``report.json`` carries before the first step (the final report's keys)."""
    return {
        "report_version": report_mod.REPORT_VERSION,
        "engine": cfg.engine,
        "config": cfg.to_dict(),
        "versions": report_mod.versions(),
        "host": {"device_type": info.device_type, "world_size": info.world_size},
        "model": {"source": cfg.model.name_or_path, "from_scratch": cfg.model.from_scratch is not None,
                  "param_numel": shape.total_numel, "largest_param_numel": shape.largest_numel},
        "data": {"source": cfg.data.source, "documents": split.num_documents, "tokens": split.num_tokens,
                 "train_blocks": len(split.train), "eval_blocks": len(split.eval), "seq_len": cfg.data.seq_len},
    }


def _lock_swap_folder(nvme_path: str, info, run_id: str):
    """Take the swap folder's run lock (one rank per host and folder holds it for the launch) and
    remove the run folders of runs that died there; every rank fails with one line if another run
    holds it.

    Raises:
        TargetBusyError: another live run uses the folder.
    """
    import socket

    import torch.distributed as tdist

    key = (socket.gethostname(), os.path.realpath(os.path.expanduser(nvme_path)))
    keys = [key]
    if tdist.is_initialized() and info.world_size > 1:
        keys = [None] * info.world_size
        tdist.all_gather_object(keys, key)
    lock, error = None, None
    if keys.index(key) == info.rank:
        try:
            lock, removed = lock_swap_folder(nvme_path, run_id)
        except UserError as exc:
            error = exc
        else:
            for folder, size_bytes in removed:
                print(f"memascend: note: removed {folder} ({format_bytes(size_bytes)}), the swap folder of an "
                      "earlier run that did not finish", file=sys.stderr, flush=True)
    errors = [error]
    if tdist.is_initialized() and info.world_size > 1:
        errors = [None] * info.world_size
        tdist.all_gather_object(errors, None if error is None else str(error))
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        if lock is not None:
            lock.release()
        raise error if error is not None else TargetBusyError(str(first))
    return lock


def _open_raw_store(offload: OffloadConfig, info, need_bytes: int):
    """Create this rank's raw store and route DeepSpeed's swappers to it.

    Raises:
        UserError: bad target list, refused target (filesystem, partition table, other store, a
            non-empty file that is not a store, mounted) without ``--nvme-overwrite``, a target
            another run holds, or a device smaller than the run needs (checked before the store
            header is written: a refused target is left as it was).
    """
    from memascend.integrations.deepspeed.raw_store import apply_raw_store

    target = resolve_store_target(offload.nvme_path, info.rank, info.world_size)
    return apply_raw_store(
        target,
        world_rank=info.rank,
        allow_overwrite=offload.nvme_overwrite,
        enable_crc=offload.enable_crc,
        size_bytes=store_file_bytes(need_bytes),
        min_capacity_bytes=need_bytes,
    )
