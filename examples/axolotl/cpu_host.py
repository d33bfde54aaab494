"""An axolotl plugin for a host without a GPU: HF Trainer's ``use_cpu=True``, which axolotl's YAML has no key for.

LLaMA-Factory's ``use_cpu: true`` does the same: with it, the HF Trainer's distributed state is
accelerate's CPU state (gloo, one process per rank, each rank its own share of the data) while
accelerate still hands the model to DeepSpeed, and bf16 training is allowed on the CPU. Name it in
the YAML (``plugins: [examples.axolotl.cpu_host.UseCpuPlugin]``, run from the repository root, or
copy this file anywhere on ``PYTHONPATH``); on a GPU host leave it out.
"""

from __future__ import annotations

from axolotl.integrations.base import BasePlugin


class UseCpuPlugin(BasePlugin):
    """Adds ``use_cpu=True`` to the HF ``TrainingArguments`` that axolotl builds."""

    def get_training_args(self, cfg) -> dict:
        return {"use_cpu": True}
