"""The fine-tuning run as a recipe: one rank's job in named steps (the shape of torchtune's recipes).

:func:`run_finetune` is the entry point (one call per process; under torchrun or the ``deepspeed``
launcher every rank calls it; rank 0 writes the outputs). It drives :class:`FinetuneRecipe`:

1. :meth:`~FinetuneRecipe.setup`: model source, tokenizer and data; the model's shape; the process
   group; the checkpoint to resume, checked; the run resolved (:func:`memascend.config.render.resolve`);
   the swap target (a private swap folder, or the raw store); the run log; the seam applied
   (:func:`memascend.integrations.deepspeed.apply`); ``deepspeed.initialize``; the resume.
2. :meth:`~FinetuneRecipe.evaluate` the held-out loss, :meth:`~FinetuneRecipe.train` (one
   :meth:`~FinetuneRecipe.train_step` and one :class:`StepRecord` per optimizer step, periodic
   checkpoints, the non-finite loss check), :meth:`~FinetuneRecipe.evaluate` again.
3. :meth:`~FinetuneRecipe.save` (checkpoint, model), :meth:`~FinetuneRecipe.report`
   (``report.json``, the memory timeline), then :meth:`~FinetuneRecipe.cleanup`; after an error,
   :meth:`~FinetuneRecipe.fail` (the partial report records it) and the error is raised again.

The parts these steps use have their own modules: the early checks (:mod:`~memascend.train.preflight`),
the collectives (:mod:`~memascend.train.dist`), the held-out loss (:mod:`~memascend.train.evaluation`),
the swap target (:mod:`~memascend.train.swap_target`), the checkpoints
(:mod:`~memascend.train.checkpoints`) and the cleanup ledger (:mod:`~memascend.train.cleanup`); the
report is built by :mod:`memascend.train.report`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import sys
import time
from pathlib import Path

from memascend.config import MAX_STEPS, RunConfig
from memascend.config.render import resolve
from memascend.errors import UserError
from memascend.integrations.deepspeed import step_overlap
from memascend.integrations.deepspeed.io_meter import METER, SwapIOTotals
from memascend.telemetry import MemorySampler, footprint, read_proc_io
from memascend.telemetry.tensorboard import check_tensorboard
from memascend.train import checkpoints as ckpt
from memascend.train import chunked_loss, console, determinism, resume_schedule, schedule
from memascend.train import dist as dist_setup
from memascend.train import report as report_mod
from memascend.train.cleanup import Cleanup
from memascend.train.dist import all_gather, all_reduce_sum, broadcast
from memascend.train.evaluation import check_finite_loss
from memascend.train.evaluation import evaluate as evaluate_held_out
from memascend.train.inputs import load_inputs
from memascend.train.preflight import (
    check_deepspeed_ops_loadable,
    check_dtype_supported,
    check_memlock_for_run,
    check_stock_param_dram,
)
from memascend.train.report import StepRecord
from memascend.train.run_log import RunLog, output_errors, write_json_atomic
from memascend.train.startup_memory import trim_after_stage
from memascend.train.supervisor import is_supervised, record_run_state
from memascend.train.swap_target import meter_swap_io, open_swap_target
from memascend.train.swapdir import TerminationAsInterrupt, folder_bytes, make_run_id
from memascend.units import format_bytes

__all__ = ["FinetuneRecipe", "StepRecord", "run_finetune"]


def run_finetune(cfg: RunConfig) -> dict | None:
    """Run one fine-tuning job and write its outputs to ``cfg.output_dir``.

    Returns:
        The report dict on rank 0, ``None`` on other ranks.

    Raises:
        UserError: bad input detected before or during the run (nothing is left behind).
    """
    footprint.mark("libraries")
    unquiet = console.quiet_deepspeed_logger(cfg.train.verbose)
    try:
        info = dist_setup.setup_env()
        with TerminationAsInterrupt(), MemorySampler() as sampler:
            recipe = FinetuneRecipe(cfg, info, sampler)
            try:
                result = recipe.run()
            except BaseException as exc:
                recipe.fail(exc)
                raise
            recipe.cleanup()
            return result
    finally:
        unquiet()


class FinetuneRecipe:
    """One rank's fine-tuning run, step by step (see the module doc for the order).

    Args:
        cfg: the run's configuration.
        info: this process's rank, local rank, world size and accelerator (:func:`dist.setup_env`).
        sampler: the run's memory sampler (started); its phase names the step the run is in.

    What must be undone at exit is recorded in :attr:`ledger` as the run goes (:meth:`cleanup`).
    """

    def __init__(self, cfg: RunConfig, info: dist_setup.DistInfo, sampler: MemorySampler) -> None:
        self.cfg, self.info, self.sampler = cfg, info, sampler
        self.ledger = Cleanup()
        self.is_rank0 = info.rank == 0
        self.out_dir = Path(cfg.output_dir)
        self.t_start = time.time()
        self.swap_dir: Path | None = None
        self.raw_store = None
        self.swap_bandwidth: dict | None = None  # io_meter.Bandwidth.to_dict() of the swap folder
        self.resume_ck = None
        self.layout: dict[str, list[int]] | None = None
        self.client_state: dict | None = None
        self.deterministic: dict = {}  # enable_deterministic_kernels()'s record under --deterministic
        self.start_step = 0
        self.records: list[StepRecord] = []
        self.ck_saves: list[dict] = []
        self.peak_swap_bytes = 0
        self.checkpoint_tag: str | None = None
        self.model_dir: Path | None = None
        self.phases = console.PhaseLines(self.is_rank0)

    @property
    def run_log(self) -> RunLog | None:
        """Rank 0's running record (``None`` before the output folder exists and on other ranks)."""
        return self.ledger.run_log

    @property
    def nvme_backend(self) -> str | None:
        """``raw_store``, ``folder`` (stock swap files) or ``None`` (nothing on NVMe)."""
        return "raw_store" if self.raw_store is not None else ("folder" if self.swap_dir is not None else None)

    def run(self) -> dict | None:
        """Every step in order; the report dict on rank 0, ``None`` on other ranks."""
        self.setup()
        self.loss_before = self._timed_eval("before training")
        if self.run_log is not None:
            self.run_log.eval(self.start_step, self.loss_before)
        self.train()
        last = self.records[-1] if self.records else None
        if last is not None and last.eval_loss is not None and last.step == self.steps:
            self.loss_after = last.eval_loss  # --eval-every evaluated this very state
        else:
            self.loss_after = self._timed_eval("after training")
            if self.run_log is not None:
                self.run_log.eval(self.steps, self.loss_after)
        self.save()
        return self.report()

    # ---- setup ----------------------------------------------------------------------------------

    def setup(self) -> None:
        """Cheap checks first, then the model source and data, the process group, the checkpoint
        to resume (checked against this run, parameter names and shapes, dtype, ranks, and every
        file's checksum before DeepSpeed starts; checkpoint folders checked for space), the run
        resolved, the swap target, the run log, the engine, and the resume.

        Raises:
            UserError: bad input (the message names it and the fix).
        """
        self._check_run_options()
        self.sampler.phase("load")
        self._load_inputs()
        check_deepspeed_ops_loadable()
        with console.quiet_prints(self.cfg.train.verbose):  # DeepSpeed's "shm_comm_op built successfully"
            dist_setup.init_process_group()
        footprint.mark("process_group")
        check_dtype_supported(self.cfg.train.dtype, self.info.device_type)
        self.run_id = broadcast(make_run_id(), self.info.rank)
        self._check_resume()
        ckpt.check_checkpoint_space(self.cfg.train, self.out_dir, self.shape.total_numel, self.shape.trainable_numel)
        self._resolve()
        self.steps = self._total_steps()
        ckpt.check_tag_folders(self.cfg.train, self.out_dir, self.resume_ck.step if self.resume_ck else 0, self.steps)
        self._open_swap_target()
        if self.cfg.engine == "baseline":
            check_stock_param_dram(self.resolved.ds_config, self.shape.param_numels, self.info.world_size)
        self._open_run_log()
        self.sampler.phase("initialize")
        self._initialize()
        self._resume()

    def _check_run_options(self) -> None:
        """The logging, evaluation and schedule options, checked before anything is loaded.

        Raises:
            UserError: ``--eval-every`` without held-out blocks; a schedule from the flags and a
                ``"scheduler"`` in ``--deepspeed-config``; ``--report-to tensorboard`` without the
                ``tensorboard`` package.
        """
        cfg = self.cfg
        if cfg.train.eval_every and cfg.data.eval_blocks == 0:
            raise UserError(f"--eval-every {cfg.train.eval_every} needs held-out blocks, but --eval-blocks is 0")
        schedule.check_json_scheduler(cfg.user_ds_config or {}, cfg.train)
        if cfg.train.report_to == "tensorboard" and self.is_rank0:
            check_tensorboard()
        self.phases.line(console.run_banner(cfg))

    def _load_inputs(self) -> None:
        inputs = load_inputs(self.cfg, self.out_dir)
        self.src, self.tokenizer, self.split, self.shape = inputs.src, inputs.tokenizer, (split := inputs.split), inputs.shape
        self.phases.line(f"data read: {split.num_documents:,} documents, {len(split.train):,} training + "
                         f"{len(split.eval):,} held-out blocks of {self.cfg.data.seq_len} tokens")

    def _check_resume(self) -> None:
        """The checkpoints' parameter layout (when any checkpoint is read or written) and the
        checkpoint to resume, checked (:mod:`memascend.train.checkpoints`)."""
        train, info = self.cfg.train, self.info
        periodic_on = train.checkpoint_every is not None or train.checkpoint_every_minutes is not None
        if train.resume is not None or train.save_checkpoint is not None or periodic_on:
            self.layout = ckpt.meta_param_layout(self.src, self.cfg.model, self.cfg.lora)
        ckpt.check_shared_folders(train, self.out_dir, info, self.run_id)  # several hosts: one folder
        if train.resume is None:
            return
        self.resume_ck = ckpt.resolve_resume_everywhere(train.resume, self.out_dir, info)
        if self.resume_ck is not None:
            ckpt.check_compatible(self.resume_ck, param_shapes=self.layout, dtype=train.dtype,
                                  world_size=info.world_size)
            ckpt.verify_checkpoint(self.resume_ck, rank=info.rank, world_size=info.world_size)
            if self.is_rank0:
                reason = ckpt.pick_reason(train.resume, self.resume_ck)
                print(f"memascend: --resume {train.resume}: resuming {self.resume_ck.path} (step {self.resume_ck.step}"
                      f"{f'; {reason}' if reason else ''})", file=sys.stderr, flush=True)
            self._resumed_settings()
        elif self.is_rank0:
            print(f"memascend: --resume auto: no complete checkpoint in {ckpt.periodic_root(self.out_dir)}; "
                  "starting from step 0", file=sys.stderr)

    def _resumed_settings(self) -> None:
        """The optimizer settings the resumed run trains with: the checkpoint's, except those given
        for this run (:func:`memascend.train.resume_schedule.resumed_train`; one note line names the
        changes). The run's config holds them from here on (DeepSpeed JSON, report, next checkpoint)."""
        cfg, ck = self.cfg, self.resume_ck
        train, note = resume_schedule.resumed_train(cfg.train, cfg.train_given, ck.manifest.get("schedule"),
                                                    user_ds_config=cfg.user_ds_config, where=str(ck.path))
        self.cfg = dataclasses.replace(cfg, train=train)
        if note and self.is_rank0:
            print(f"memascend: note: {note}", file=sys.stderr, flush=True)

    def _resolve(self) -> None:
        """The run's DeepSpeed JSON, settings and estimates; the swap folder's path is filled in
        by :meth:`_open_swap_target` (its size is checked against the estimate first)."""
        self.resolved = resolve(self.cfg, self.shape, self.info.world_size)

    def _open_swap_target(self) -> None:
        """The raw store, or the locked private swap folder (every rank checks: ranks may have
        different NVMe paths via the environment; the first rank's folder name is shared so all
        ranks of one launch use one run folder)."""
        cfg, info = self.cfg, self.info
        if not cfg.offload.uses_nvme:
            return
        self.swap_dir, self.raw_store = open_swap_target(cfg.offload, info, self.resolved.nvme_bytes_per_rank,
                                                         self.run_id, self.ledger,
                                                         lock_handle_buffers=cfg.engine == "baseline")
        self.resolved = self.resolved.with_swap_dir(str(self.swap_dir))

    def _open_run_log(self) -> None:
        if not self.is_rank0:
            return
        if not self.out_dir.exists():
            self.ledger.created_out_dir = self.out_dir
        self.out_dir.mkdir(parents=True, exist_ok=True)
        header = report_mod.report_header(self.cfg, self.shape, self.split, self.info)
        self.ledger.run_log = RunLog(self.out_dir, self.sampler, header,
                                     tensorboard=self.cfg.train.report_to == "tensorboard")
        record_run_state(self.info.rank, out_dir=str(self.out_dir.resolve()))

    def _initialize(self) -> None:
        """Apply the seam, check the memlock limit, build the model, ``deepspeed.initialize``."""
        import deepspeed

        from memascend.integrations import deepspeed as seam
        from memascend.models.loading import build_model

        cfg = self.cfg
        settings = self.resolved.settings
        if cfg.train.deterministic:  # before any kernel runs: cuBLAS reads its workspace setting once
            self.deterministic = determinism.enable_deterministic_kernels()
        self.ledger.revert = seam.revert
        seam.apply(settings)
        footprint.mark("seam")
        self.engine_settings = dataclasses.asdict(settings)
        check_memlock_for_run(self.resolved.upfront_locked_bytes)
        ds_cfg = self.resolved.ds_config
        self.sampler.phase("build")  # the model built or loaded (report: memory.phase_peak_rss_bytes.build)
        model, hf_ds = build_model(self.src, cfg.model, ds_cfg, cfg.train.seed, layerwise=cfg.engine == "memascend",
                                   lora=cfg.lora)
        trim_after_stage(cfg)
        footprint.mark("model")
        self.sampler.phase("initialize")
        self.phases.line(f"model {'built' if cfg.model.from_scratch else 'loaded'} "
                         f"({console.format_params(self.shape.total_numel)} params, {cfg.train.dtype})")
        if cfg.train.activation_checkpointing:
            model.gradient_checkpointing_enable()
        if cfg.train.loss_chunk_tokens:
            chunked_loss.install(model, cfg.train.loss_chunk_tokens)
        with console.quiet_prints(cfg.train.verbose):  # an op loaded from the build cache prints that it was built
            self.engine, _opt, _, _ = deepspeed.initialize(
                model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_cfg,
                lr_scheduler=schedule.scheduler_factory(cfg.train, self.steps))
        del hf_ds
        trim_after_stage(cfg)
        footprint.mark("engine")
        self._meter_swap_io()
        self.phases.line(f"DeepSpeed initialized (ZeRO-3; parameters on {cfg.offload.param}, optimizer state on "
                         f"{cfg.offload.optimizer}; {self.steps:,} steps, lr {cfg.train.lr:g} {cfg.train.lr_scheduler}"
                         f"{f', {cfg.train.warmup_steps} warm-up' if cfg.train.warmup_steps else ''})")
        first = next(self.engine.module.parameters())
        # The parameter's own dtype: ZeRO-3 keeps it when it frees param.data, while ds_tensor of a
        # partition that lives on NVMe only is DeepSpeed's float16 placeholder until it is swapped in.
        self.param_dtype = str(first.dtype).replace("torch.", "")

    def _meter_swap_io(self) -> None:
        """The swap target's bandwidth and the swap I/O meter (:func:`~memascend.train.swap_target.meter_swap_io`)."""
        self.swap_bandwidth = meter_swap_io(self.cfg, self.raw_store, self.swap_dir, self.resolved.ds_config,
                                            self.phases.line)

    def _total_steps(self) -> int:
        """Optimizer steps of the run (``--steps``, or ``--epochs`` over the training blocks)."""
        train = self.cfg.train
        self.global_batch_blocks = self.resolved.micro_batch * self.resolved.grad_accum * self.info.world_size
        if train.epochs is None:
            return int(train.steps)
        steps = max(1, math.floor(train.epochs * len(self.split.train) / self.global_batch_blocks))
        if steps > MAX_STEPS:
            raise UserError(
                f"--epochs {train.epochs:g} is {steps:,} optimizer steps over {len(self.split.train):,} training "
                f"blocks, more than the {MAX_STEPS:,} a run may take"
            )
        return steps

    def _resume(self) -> None:
        ck = self.resume_ck
        if ck is None:
            return
        self.sampler.phase("resume")
        self.start_step, self.client_state = ckpt.load_checkpoint(self.engine, ck, self.cfg.train,
                                                                  self.cfg.user_ds_config,
                                                                  swap_folder=self.raw_store is None)
        if self.start_step > self.steps:
            raise UserError(f"--resume {self.cfg.train.resume} is at step {self.start_step}, beyond --steps {self.steps}")

    # ---- evaluate and train ---------------------------------------------------------------------

    def evaluate(self) -> float | None:
        """Held-out loss (token-weighted mean cross-entropy; all ranks take part); ``None`` when
        there are fewer held-out blocks than ranks."""
        return evaluate_held_out(self.engine, self.split.eval, self.resolved.micro_batch, self.info, self.sampler)

    def _timed_eval(self, when: str) -> float | None:
        """:meth:`evaluate`, with its phase line (``when``: ``before training``, ``after step 5``)."""
        t0 = time.monotonic()
        loss = self.evaluate()
        if loss is not None:
            self.phases.line(f"held-out loss {when}: {loss:.4f} ({len(self.split.eval)} blocks, "
                             f"{time.monotonic() - t0:.1f}s)")
        return loss

    def train(self) -> None:
        """The training loop from the start step to the last, with the progress bar, periodic
        checkpoints and the non-finite loss check (a NaN/inf loss stops the run before anything is
        saved from that state).

        Raises:
            TrainingError: a non-finite loss without ``--allow-nonfinite-loss`` (exit code 5).
        """
        from memascend.data import BlockSampler

        cfg, info = self.cfg, self.info
        self.periodic = self._periodic_checkpointer()
        self.blocks = BlockSampler(len(self.split.train), self.resolved.micro_batch, info.world_size, info.rank,
                                   cfg.train.seed)
        # Every RNG the steps draw from (dropout): seeded with seed + rank, or a checkpoint's states.
        self.seeding = determinism.seed_training(cfg.train.seed, info.rank, info.world_size)
        self.seeding.update(self.deterministic)
        self.seeding["rng_from_checkpoint"] = determinism.restore_from_client_state(self.client_state, info.rank,
                                                                                    info.world_size)
        io0 = read_proc_io()
        store_io0 = self.raw_store.store.io_counters() if self.raw_store is not None else None
        self.tokens_per_step = self.global_batch_blocks * cfg.data.seq_len
        bar = console.progress_bar(self.steps, self.is_rank0)
        bar.update(self.start_step)
        train_t0 = time.monotonic()
        try:
            for step in range(self.start_step, self.steps):
                self._after_step(step, self.train_step(step), bar)
            step_overlap.join_all()  # the last step's sub-groups, where they run beside the forward
            if self.raw_store is None:
                self._sample_swap_folder()  # the last optimizer step's files are complete now
        finally:
            step_overlap.join_all(raise_errors=False)
            bar.close()
        self.train_s = time.monotonic() - train_t0
        io1 = read_proc_io()
        self.io_read_bytes = io1["read_bytes"] - io0["read_bytes"]
        self.io_write_bytes = io1["write_bytes"] - io0["write_bytes"]
        if self.raw_store is not None:
            self.raw_store.train_io = self.raw_store.store.io_counters() - store_io0
        self.skipped_steps = int(getattr(self.engine, "skipped_steps", 0))

    def train_step(self, step: int) -> StepRecord:
        """One optimizer step (``step`` 0-based): ``grad_accum`` micro-batches of forward, backward
        and ``engine.step()``; the mean loss over the ranks (collective)."""
        engine = self.engine
        t0 = time.monotonic()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        io0 = read_proc_io()
        lrs = engine.get_lr()  # the rate this step runs with: the scheduler moves it after engine.step()
        skipped_before = int(getattr(engine, "skipped_steps", 0))
        phase_s = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_step_s": 0.0}
        phase_io = {name: SwapIOTotals() for name in phase_s}
        phase_cpu = {"cpu": dict.fromkeys(phase_s, 0.0), "sys": dict.fromkeys(phase_s, 0.0)}
        grad_accum = self.resolved.grad_accum
        worker0 = METER.worker_totals()
        worker_s0 = step_overlap.worker_seconds(getattr(engine, "optimizer", None))
        losses = [self._micro_step(step * grad_accum + micro, phase_s, phase_io, phase_cpu) for micro in range(grad_accum)]
        # The optimizer step beside the forward (step_overlap): the previous step's swap I/O, done on
        # its worker during this step's forward, counts as the step's (without the worker's waits).
        worker = METER.worker_totals() - worker0
        phase_io["optimizer_step_s"] += dataclasses.replace(worker, wait_s=0.0)
        worker_s1 = step_overlap.worker_seconds(getattr(engine, "optimizer", None))
        loss_sum, n = all_reduce_sum([sum(losses), len(losses)])
        dt = time.monotonic() - t0
        end = self.sampler.sample()
        return StepRecord(
            step=step + 1,
            loss=loss_sum / n,
            rank_losses=tuple(losses),
            time_s=dt,
            phase_s=phase_s,
            tokens=self.tokens_per_step,
            tokens_per_s=self.tokens_per_step / dt,
            rss_bytes=end.rss_bytes,
            minor_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0,
            skipped=int(getattr(engine, "skipped_steps", 0)) > skipped_before,
            lr=float(lrs[0]) if lrs else self.cfg.train.lr,
            locked_bytes=end.locked_bytes,
            nvme_read_bytes=end.read_bytes - io0["read_bytes"],
            nvme_write_bytes=end.write_bytes - io0["write_bytes"],
            **report_mod.swap_io_fields(phase_s, {k: v.to_dict() for k, v in phase_io.items()}, self.swap_bandwidth),
            phase_cpu_s=phase_cpu["cpu"], phase_sys_s=phase_cpu["sys"],
            step_worker_s=None if worker_s1 is None else worker_s1 - (worker_s0 or 0.0),
        )

    def _micro_step(self, index: int, phase_s: dict[str, float], phase_io: dict[str, SwapIOTotals],
                    phase_cpu: dict[str, dict[str, float]]) -> float:
        """Forward, backward and ``engine.step()`` of micro-batch ``index``; adds each phase's wall
        seconds to ``phase_s``, its swap I/O to ``phase_io`` and its CPU and system seconds to
        ``phase_cpu["cpu"]`` and ``phase_cpu["sys"]``; returns this rank's loss."""
        engine = self.engine
        idx = self.blocks.indices(index)
        ids = self.split.train.input_ids[idx].to(engine.device)
        labels = self.split.train.labels[idx].to(engine.device)
        marks = [(time.monotonic(), METER.totals(), os.times())]
        self.sampler.phase("forward")
        loss = engine(input_ids=ids, labels=labels).loss
        marks.append((time.monotonic(), METER.totals(), os.times()))
        self.sampler.phase("backward")
        engine.backward(loss)
        marks.append((time.monotonic(), METER.totals(), os.times()))
        self.sampler.phase("step")
        engine.step()
        marks.append((time.monotonic(), METER.totals(), os.times()))
        for name, (t0, io0, cpu0), (t1, io1, cpu1) in zip(phase_s, marks, marks[1:], strict=False):
            phase_s[name] += t1 - t0
            phase_io[name] += io1 - io0
            phase_cpu["cpu"][name] += (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
            phase_cpu["sys"][name] += cpu1.system - cpu0.system
        return float(loss.detach().float())

    def _sample_swap_folder(self) -> None:
        """Keep the largest allocated size of the swap folder (:func:`folder_bytes`) seen so far in
        :attr:`peak_swap_bytes`. Sampled after every step and once the last step's optimizer step has
        finished: with the step beside the next forward (:mod:`~memascend.integrations.deepspeed.step_overlap`)
        a step's optimizer files are only written during the following step, so the folder after the
        first step alone misses the optimizer states the lean initialization never wrote."""
        if self.swap_dir is not None:
            self.peak_swap_bytes = max(self.peak_swap_bytes, folder_bytes(self.swap_dir))

    def _after_step(self, step: int, record: StepRecord, bar) -> None:
        every = self.cfg.train.eval_every
        if every and record.step % every == 0 and math.isfinite(record.loss):
            record = dataclasses.replace(record, eval_loss=self._timed_eval(f"after step {record.step}"))
        self.records.append(record)
        if self.run_log is not None:
            self.run_log.step(record.to_dict())
        if self.raw_store is not None:
            self.raw_store.sample_usage()
        else:
            self._sample_swap_folder()
        bar.set_postfix(loss=f"{record.loss:.4f}", tok_s=f"{record.tokens_per_s:.0f}",
                        rss=f"{record.rss_bytes / 2**30:.2f}GiB")
        bar.update(1)
        # fp16 excepted: a loss-scale overflow step that DeepSpeed skipped (bf16/fp32 steps that
        # DeepSpeed skips on a non-finite gradient norm are not excused).
        check_finite_loss(step + 1, record.loss, skipped=record.skipped and self.cfg.train.dtype == "fp16",
                               allow=self.cfg.train.allow_nonfinite_loss)
        self.periodic.maybe_checkpoint(step + 1)

    # ---- save -----------------------------------------------------------------------------------

    def _periodic_checkpointer(self) -> ckpt.PeriodicCheckpointer:
        self.ck_info = {"dtype": self.cfg.train.dtype, "world_size": self.info.world_size, "engine": self.cfg.engine,
                        "backend": self.nvme_backend, "param_shapes": self.layout,
                        "schedule": resume_schedule.schedule_record(self.cfg.train, self.cfg.user_ds_config)}
        train = self.cfg.train
        return ckpt.PeriodicCheckpointer(ckpt.periodic_root(self.out_dir), every_steps=train.checkpoint_every,
                                         every_minutes=train.checkpoint_every_minutes, keep=train.keep_checkpoints,
                                         save=self._save_checkpoint, rank=self.info.rank)

    def _save_checkpoint(self, root: Path) -> ckpt.Checkpoint:
        """Atomic checkpoint of this step into ``root`` (every rank calls it), timed."""
        t_save = time.monotonic()
        saved = ckpt.save_checkpoint(self.engine, root, run_id=self.run_id, info=self.ck_info, rank=self.info.rank,
                                     client_state=determinism.checkpoint_client_state(self.info.world_size))
        save_s = time.monotonic() - t_save
        self.ck_saves.append({"path": str(saved.path), "save_s": save_s, "manifest_s": saved.manifest_s,
                              "bytes": saved.total_bytes})
        self.phases.line(f"checkpoint saved: {saved.path} ({format_bytes(saved.total_bytes)}, {save_s:.1f}s)")
        return saved

    def save(self) -> None:
        """``--save-checkpoint`` (unless the last periodic checkpoint is that one) and the model."""
        self.sampler.phase("save")
        save_dir = self.cfg.train.save_checkpoint
        if save_dir is not None:
            self.checkpoint_tag = ckpt.tag_for_step(int(self.engine.global_steps))
            same = Path(save_dir).absolute() == self.periodic.root.absolute()
            if not (same and self.periodic.saved and self.periodic.saved[-1] == self.checkpoint_tag):
                self._save_checkpoint(Path(save_dir))
        if self.cfg.train.save_model:
            self._save_model()
        self.sampler.phase("done")

    def _save_model(self) -> None:
        """The fine-tuned model (:func:`memascend.train.model_save.save_model`; collective gather, rank
        0 writes)."""
        from memascend.train.model_save import save_model

        t_save = time.monotonic()
        saved = save_model(self.engine, self.out_dir, self.tokenizer, self.cfg.lora, is_rank0=self.is_rank0)
        if saved is not None:
            self.model_dir, what = saved
            self.phases.line(f"{what} ({time.monotonic() - t_save:.1f}s)")

    # ---- report and cleanup ---------------------------------------------------------------------

    def report(self) -> dict | None:
        """Gather every rank's peaks (collective), release the engine, and on rank 0 write
        ``report.json`` and the memory timeline (CSV, PNG); the report dict on rank 0."""
        from memascend.integrations.deepspeed.accounting import memory_breakdown

        summary = self.sampler.summary()
        breakdown = memory_breakdown(self.engine, summary, self.sampler.samples)
        breakdown["fixed_cost"] = footprint.fixed_cost(
            footprint.marks(), samples=self.sampler.samples,
            supervisor_bytes=footprint.parent_rss_bytes() if is_supervised() else None)
        rank_peaks, store_ranks = self._gather_ranks(summary)
        if hasattr(self.engine, "destroy"):
            self.engine.destroy()
        if not self.is_rank0:
            return None
        rep = report_mod.build_report(self._report_inputs(summary, breakdown, rank_peaks, store_ranks))
        self._write_outputs(rep)
        return rep

    def _gather_ranks(self, summary: dict) -> tuple[list[dict], list[dict] | None]:
        """Every rank's memory peaks, and every rank's raw store report (``None`` without one)."""
        ws = self.info.world_size
        # which node and swap target each rank used (several nodes: each has its own NVMe)
        rank_peaks = all_gather(report_mod.rank_record(self.info, summary, self.raw_store, self.swap_dir), ws)
        store_ranks = None
        if self.raw_store is not None:  # every rank has its own store: gather each one's report
            store_ranks = all_gather({"rank": self.info.rank, **self.info.node_record(), **self.raw_store.report()},
                                     ws)
        return rank_peaks, store_ranks

    def _report_inputs(self, summary: dict, breakdown: dict, rank_peaks: list[dict],
                       store_ranks: list[dict] | None) -> report_mod.ReportInputs:
        resolved, train = self.resolved, self.cfg.train
        return report_mod.ReportInputs(
            cfg=self.cfg, ds_config=resolved.ds_config, derived=resolved.derived_dicts(),
            engine_settings=self.engine_settings, user_ds_config=resolved.user_ds_config,
            device_type=self.info.device_type, world_size=self.info.world_size, split=self.split, shape=self.shape,
            param_dtype=self.param_dtype, per_step=[r.to_dict() for r in self.records],
            loss_before=self.loss_before, loss_after=self.loss_after, skipped_steps=self.skipped_steps,
            train_s=self.train_s, wall_s=time.time() - self.t_start, summary=summary, rank_peaks=rank_peaks,
            memory_breakdown=breakdown, io_read_bytes=self.io_read_bytes, io_write_bytes=self.io_write_bytes,
            swap_folder_bytes=self.peak_swap_bytes, nvme_backend=self.nvme_backend,
            store_report=self.raw_store.report() if self.raw_store is not None else None, store_ranks=store_ranks,
            seeding=self.seeding, model_dir=str(self.model_dir) if self.model_dir else None,
            resumed_from=str(self.resume_ck.path) if self.resume_ck is not None else None,
            start_step=self.start_step, periodic_saved=self.periodic.saved, checkpoint_saves=self.ck_saves,
            saved_to=train.save_checkpoint, saved_tag=self.checkpoint_tag, swap_bandwidth=self.swap_bandwidth,
            step_overlap=step_overlap.stats(getattr(self.engine, "optimizer", None)),
        )

    def _write_outputs(self, rep: dict) -> None:
        from memascend.telemetry.plot import plot_timelines

        if self.run_log is not None:
            self.run_log.close()
        csv = self.out_dir / "memory_timeline.csv"
        model = self.cfg.model
        with output_errors(self.out_dir, "report.json and the memory timeline"):
            self.sampler.write_csv(csv)
            plot_timelines({self.cfg.engine: csv}, self.out_dir / "memory_timeline.png",
                           title=f"{model.name_or_path if not model.from_scratch else 'from-scratch'} / {self.cfg.engine}")
            write_json_atomic(self.out_dir / "report.json", rep)

    def cleanup(self, *, failed: bool = False) -> None:
        """Undo what the run set up (:class:`memascend.train.cleanup.Cleanup`: swap folder and lock,
        seam, raw store; after a failure an output folder it created and left empty)."""
        self.ledger.run(failed=failed)

    def fail(self, exc: BaseException) -> None:
        """Record ``exc`` in the partial report (bad input found before the first step, a
        :class:`UserError`, leaves nothing behind; a crash, an interrupt, or any error once a step
        ran leaves its record: what the run produced is never deleted) and clean up. Raises nothing:
        the run's own error (e.g. a checksum mismatch naming tensor and offset) is what the user must see."""
        if self.run_log is not None:
            with contextlib.suppress(Exception):
                self.run_log.fail(exc, discard=isinstance(exc, UserError) and not self.records)
        with contextlib.suppress(Exception):
            self.cleanup(failed=True)
