"""The example tests' axolotl plugin: rank 0 prints ``AXOLOTL_RESULT {json}`` when training ends.

An observer only, added by tests/examples/pairs.py to both commands of an axolotl pair alike (the
``plugins`` key, axolotl's own extension point): the per-step training losses at full precision
(axolotl's log lines round them) and their ``float.hex``, the ranks and precision the HF Trainer ran
with, and what the DeepSpeed engine ran: whether memascend was applied and the parameter swapper's
class. It changes nothing in training. Imported by axolotl in the framework's venv only.
"""

from __future__ import annotations

import json
import sys

from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback

MARKER = "AXOLOTL_RESULT"


class _PrintResult(TrainerCallback):
    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        engine = self.trainer.model_wrapped
        seam = sys.modules.get("memascend.integrations.deepspeed")  # loaded only where memascend run applied it
        swapper = getattr(next(engine.module.parameters()), "nvme_swapper", None)
        losses = [float(e["loss"]) for e in state.log_history if "loss" in e]
        result = {"losses": losses, "losses_hex": [x.hex() for x in losses], "world_size": args.world_size,
                  "bf16": bool(args.bf16), "use_cpu": bool(args.use_cpu),
                  "applied": seam is not None and seam.applied_settings() is not None,
                  "param_swapper": type(swapper).__name__}
        print(f"{MARKER} {json.dumps(result)}", flush=True)


class ResultPlugin(BasePlugin):
    """Adds :class:`_PrintResult` to the trainer axolotl builds."""

    def add_callbacks_post_trainer(self, cfg, trainer) -> list:
        return [_PrintResult(trainer)]
