"""The memory model: peak host RSS, locked memory and NVMe space of a run, predicted without running it.

:mod:`memascend.plan.model` adds up what each engine allocates (:func:`plan_run`; the optimizer's
terms in :mod:`memascend.plan.optimizer_terms`, where each rank's swappable state lives and the NVMe
bytes of a step in :mod:`memascend.plan.placement`, the host-memory budget's choice in
:mod:`memascend.plan.budget`),
:mod:`memascend.plan.shapes` lays out the model and its activations, :mod:`memascend.plan.calibration`
holds the DeepSpeed defaults and calibrated constants, and :mod:`memascend.plan.recorded` checks the
model against recorded ``report.json`` files (``python -m memascend.plan``).
"""

from memascend.plan.model import (
           Component,
           EnginePlan,
           largest_preset_under_cap,
           plan_engine,
           plan_for_report,
           plan_presets,
           plan_run,
)
from memascend.plan.shapes import ModelDims, activation_parts, model_dims

__all__ = ["Component", "EnginePlan", "ModelDims", "activation_parts", "largest_preset_under_cap", "model_dims",
           "plan_engine", "plan_for_report", "plan_presets", "plan_run"]
