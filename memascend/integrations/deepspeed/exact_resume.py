"""``fix_exact_resume``: a ZeRO-3 checkpoint resumes to the same optimizer state it was saved from.

Stock DeepSpeed 0.19.8 loses two pieces of state on ``load_checkpoint`` (measured: llama-tiny,
4 steps straight vs 2 + save + resume to 4, step 3's loss equal, step 4's not, both engines):

* With the optimizer on NVMe, ``DeepSpeedEngine.load_checkpoint`` skips
  ``_load_zero_checkpoint`` altogether (``if load_zero_checkpoint and not
  self.zero_nvme_offload_optimizer()``) and only copies the swap files back. The ZeRO optimizer
  state file (``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt``) is never read: the optimizer's
  per-partition ``state`` (Adam's ``step``) starts empty, so the first resumed step counts from 1
  and ``DeepSpeedCPUAdam`` creates zero moments (the swapped ``exp_avg``/``exp_avg_sq`` files are
  copied back but never registered with the swapper, so never read); ``param_groups``
  hyper-parameters, the loss scaler and the fp32 master of sub-groups too small to be swapped
  (``min_aio_bytes``) keep their fresh values.
* ``DeepSpeedCPUAdam``'s C++ op keeps ``beta^t`` as a float32 running product while the step
  grows by one, and recomputes it with ``pow`` when the step jumps (``Adam_Optimizer::IncrementStep``,
  csrc/includes/cpu_adam.h). The first step after a resume jumps from 0 to ``t + 1``: ``pow`` and
  the product differ in the last bit (``0.999f``: from ``t = 3`` on), so the bias correction, and the
  update, differ in the last bit, with the optimizer on the CPU too (llama-tiny's losses did not
  show it over 4 resumed steps; the parameters of a ``DeepSpeedCPUAdam`` test do).

The fix patches ``DeepSpeedEngine._load_checkpoint`` (the part of ``load_checkpoint`` that reads the
module and engine state, before the NVMe swap files are copied back): after it, with the optimizer
on NVMe, this rank's ZeRO optimizer state file is read and restored into the optimizer as stock
``DeepSpeedZeroOptimizer_Stage3._rigid_load_state_dict`` restores it for a CPU optimizer: loss
scaler, ``param_groups`` hyper-parameters, each partition's non-tensor state (``step``), the fp32
master and state of sub-groups kept in DRAM; the swapped state tensors are registered with the
optimizer swapper as placeholders, as an uninterrupted run has them after its first step, so the
next swap-in reads them from the copied files. A sub-group the checkpoint placed otherwise than this
run (another ``optimizer_dram_numel`` or host-memory budget) is moved where this run keeps it
(:mod:`.resume_placement`): read from the checkpoint's swap copies into DRAM, or written to this
run's swap files when ``reset_swap_buffers`` runs. Then, for ``DeepSpeedCPUAdam``, the C++ op's step
counter is replayed ``1 .. t`` on a one-element scratch tensor, so ``beta^t`` is the same running
product as in the uninterrupted run.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from memascend.errors import UserError
from memascend.integrations.deepspeed.resume_placement import (
    CheckpointSwapFiles,
    defer_swap_out,
    load_swapped_into_dram,
)


def make_load_checkpoint(original):
    """Wrap ``DeepSpeedEngine._load_checkpoint`` (0.19.8) so that ZeRO-3's optimizer state is exact.

    Args:
        original: stock ``DeepSpeedEngine._load_checkpoint``.

    Returns:
        The replacement; same signature and return value (``(load_path, client_state)``).
        It raises what stock raises, and :class:`memascend.errors.UserError` when the
        checkpoint's optimizer state does not fit this optimizer (another data-parallel world
        size, another number of parameter groups or sub-groups).
    """

    @functools.wraps(original)
    def _load_checkpoint(self, load_dir, tag, load_module_strict=True, load_optimizer_states=True,
                         load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        result = original(self, load_dir, tag, load_module_strict=load_module_strict,
                          load_optimizer_states=load_optimizer_states,
                          load_lr_scheduler_states=load_lr_scheduler_states,
                          load_module_only=load_module_only, custom_load_fn=custom_load_fn)
        if (result[0] is not None and load_optimizer_states and not load_module_only
                and _is_zero3(self) and not self.load_universal_checkpoint()):
            restore_optimizer_state(self, load_dir, tag)
        return result

    return _load_checkpoint


def _is_zero3(engine: Any) -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return isinstance(getattr(engine, "optimizer", None), DeepSpeedZeroOptimizer_Stage3)


def restore_optimizer_state(engine: Any, load_dir: str | os.PathLike, tag: str) -> int:
    """Restore what stock ``load_checkpoint`` leaves out of a ZeRO-3 optimizer (module doc).

    With the optimizer on NVMe: loss scaler, ``param_groups`` hyper-parameters, each fp32
    partition's state (non-tensor values such as ``step`` as saved; swapped tensors registered as
    swapper placeholders; tensors kept in DRAM copied) and the fp32 master of sub-groups that are
    not swapped, all from this rank's ``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt``. With any
    offload: ``DeepSpeedCPUAdam``'s C++ step counter replayed up to the saved step.

    Args:
        engine: a ``DeepSpeedEngine`` whose optimizer is ``DeepSpeedZeroOptimizer_Stage3``.
        load_dir: the checkpoint folder given to ``load_checkpoint``.
        tag: the checkpoint tag (sub-folder) being loaded.

    Returns:
        The optimizer step the state was saved at (the largest partition ``step``; 0 if none).

    Raises:
        UserError: the file's state does not fit this optimizer (data-parallel world size,
            parameter groups, sub-groups), or a sub-group saved swapped and kept in DRAM here has
            no copy of its swap files in the checkpoint.
        IntegrityError, ChecksumError: such a copy is short or corrupt.
        FileNotFoundError: this rank's optimizer state file is missing.
    """
    import torch
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    zero_opt = engine.optimizer
    swapped = zero_opt.swap_optimizer  # the NVMe path that stock skips
    if not swapped and not isinstance(zero_opt.optimizer, DeepSpeedCPUAdam):
        return 0
    loaded_dp = getattr(engine, "loaded_checkpoint_dp_world_size", None)
    if loaded_dp is not None and loaded_dp != engine.seq_dp_world_size:
        raise UserError(f"checkpoint {load_dir}/{tag} was saved by {loaded_dp} data-parallel ranks, this run has "
                        f"{engine.seq_dp_world_size}: resume it with the same --nproc")
    path = engine._get_zero_ckpt_name(load_dir, tag)
    sd = torch.load(path, map_location="cpu", weights_only=False, mmap=True)[OPTIMIZER_STATE_DICT]
    saved = sd[OPTIMIZER_STATE_DICT]
    base = zero_opt.optimizer
    n_sub = len(zero_opt.fp32_partitioned_groups_flat)
    by_group: list[list[int]] = [[] for _ in base.param_groups]
    for sub_group_id in range(n_sub):
        by_group[zero_opt.sub_group_to_group_id[sub_group_id]].append(sub_group_id)
    if len(saved["param_groups"]) != len(base.param_groups) or len(sd[FP32_FLAT_GROUPS]) != n_sub or any(
            len(g["params"]) != len(ids) for g, ids in zip(saved["param_groups"], by_group)):
        raise UserError(f"checkpoint {path}: its optimizer state has other parameter groups or sub-groups than "
                        "this run's ZeRO-3 optimizer (another model or --deepspeed-config sub_group_size)")

    files = CheckpointSwapFiles(engine, load_dir, tag) if swapped else None
    if swapped:
        zero_opt.loss_scaler = sd[LOSS_SCALER]
        zero_opt.dynamic_loss_scale = sd["dynamic_loss_scale"]
        zero_opt.overflow = sd["overflow"]
    step = 0
    for group, saved_group, sub_group_ids in zip(base.param_groups, saved["param_groups"], by_group):
        if swapped:
            for key, value in saved_group.items():
                if key != "params":
                    group[key] = value
        for index, sub_group_id in zip(saved_group["params"], sub_group_ids):
            saved_state = saved["state"].get(index, {})
            step = max(step, _as_int(saved_state.get("step", 0)))
            if swapped:
                _restore_sub_group(zero_opt, sub_group_id, saved_state, sd[FP32_FLAT_GROUPS][sub_group_id], files)
    _replay_cpu_adam_steps(base, step)
    return step


def _as_int(value: Any) -> int:
    return int(value.item()) if hasattr(value, "item") else int(value)


def _restore_sub_group(zero_opt: Any, sub_group_id: int, saved_state: dict, saved_fp32: Any,
                       files: CheckpointSwapFiles) -> None:
    """Restore one sub-group where this run keeps it (:mod:`.resume_placement` for a sub-group the
    checkpoint placed otherwise: saved in DRAM iff its saved fp32 master is not empty)."""
    import torch
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper

    fp32 = zero_opt.fp32_partitioned_groups_flat[sub_group_id]
    state = zero_opt.optimizer.state[fp32]
    saved_in_dram = saved_fp32.numel() > 0
    if not zero_opt._swappable_optimizer_subgroup(sub_group_id):
        if not saved_in_dram:
            load_swapped_into_dram(zero_opt, sub_group_id, saved_state, files)
            return
        # Kept in DRAM: the saved tensors are the real ones (stock's _rigid_load_state_dict path).
        fp32.data.copy_(saved_fp32.data)
        for key, value in saved_state.items():
            state[key] = value.clone() if torch.is_tensor(value) else value
        return
    swap_info = zero_opt.optimizer_swapper.swap_params_info.get(OptimizerSwapper.parameter_id(fp32))
    if swap_info is None:
        raise RuntimeError(f"optimizer sub-group {sub_group_id} is swappable but has no swap entry")
    if saved_in_dram:
        defer_swap_out(zero_opt, sub_group_id, saved_state, saved_fp32)
        return
    placeholders = []
    for key, value in saved_state.items():
        if torch.is_tensor(value) and value.numel() == 0:
            # Swapped at save time: the values are the copied '<key>-<ds_id>.tensor.swp' files.
            if swap_info.has_state_tensors:
                continue  # this engine has stepped already: its placeholders are registered
            placeholder = torch.empty(0, dtype=value.dtype)
            placeholder.ds_id = f"{key}-{fp32.ds_id}"
            state[key] = placeholder
            placeholders.append(placeholder)
        else:
            state[key] = value.clone() if torch.is_tensor(value) else value
    if placeholders:
        swap_info.add_state_tensors(placeholders)


def _replay_cpu_adam_steps(optimizer: Any, step: int) -> None:
    """Bring ``DeepSpeedCPUAdam``'s C++ ``beta^t`` running products to where ``step`` consecutive
    steps leave them (the real tensors are not touched: a one-element scratch tensor is updated)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not isinstance(optimizer, DeepSpeedCPUAdam) or step <= 0:
        return
    import torch

    groups = optimizer.param_groups
    scratch = [torch.zeros(1, dtype=torch.float32) for _ in range(4)]
    # IncrementStep(1) sets beta^1 = beta exactly from any prior state; later ones multiply.
    for s in range(1, step + 1):
        for group in groups:
            beta1, beta2 = group["betas"]
            optimizer.ds_opt_adam.adam_update(optimizer.opt_id, s, group["lr"], beta1, beta2, group["eps"],
                                              group["weight_decay"], group["bias_correction"], *scratch)
