"""An axolotl plugin for a host without a GPU: HF Trainer's ``use_cpu=True``, which axolotl's YAML has no key for.

LLaMA-Factory's ``use_cpu: true`` does the same. With it the HF Trainer allows bf16 on the CPU, and
its ``TrainingArguments`` count the job's ranks (accelerate's CPU state), so DeepSpeed's
``train_batch_size: "auto"`` is filled for all of them; without it the Trainer refuses bf16 there,
and in fp32 DeepSpeed stops on that batch size (filled for one process, checked against the ranks).
axolotl rebuilds accelerate's state before the Trainer makes its accelerator, and without a GPU that
state counts one process: on a CPU host every rank reads the same batches. Name the plugin in the
YAML (``plugins: [examples.axolotl.cpu_host.UseCpuPlugin]``, run from the repository root, or copy
this file anywhere on ``PYTHONPATH``); on a GPU host leave it out.
"""

from __future__ import annotations

from axolotl.integrations.base import BasePlugin


class UseCpuPlugin(BasePlugin):
    """Adds ``use_cpu=True`` to the HF ``TrainingArguments`` that axolotl builds."""

    def get_training_args(self, cfg) -> dict:
        return {"use_cpu": True}
