"""fp16 dynamic loss scaling with injected inf/nan gradients: memascend must handle overflow exactly as stock.

Issue target: fp16 overflow handling identical to stock DeepSpeed 0.19.8 ZeRO-3 with params and
optimizer state offloaded to NVMe (a temporary folder), on CUDA. memascend replaces stage 3's
``has_overflow`` / ``_has_inf_or_nan`` with a fused check and moves the gradient I/O, so the
measured behaviour is the whole chain: overflow detected, step skipped, loss scale lowered, the
next steps unchanged.

Each engine runs in its own process (``equal_loss_worker.py --device cuda --dtype fp16``): the tiny
Llama for 6 steps, dynamic loss scaling from 2**8 with hysteresis 1, every gradient of step 2 made
inf and every gradient of step 4 nan (the loss is multiplied by inf / nan before
``engine.backward``). Checked per step: the skipped steps (``engine.skipped_steps`` delta and
``engine.optimizer.overflow``), the loss scale after the step (``engine.optimizer.loss_scale``,
``loss_scaler.cur_scale`` of ``DeepSpeedZeroOptimizer_Stage3``) and the losses of the applied steps
(bit for bit, ``float.hex``).

Needs a CUDA device (and DeepSpeed's async_io op); skipped otherwise.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from tests.integrations.test_ds_equal_loss import aio_available, run_worker  # noqa: E402, F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (torch.cuda.is_available() is False): fp16 loss scaling "
                              "is compared on the CUDA accelerator only"),
    pytest.mark.usefixtures("aio_available"),
]

STEPS = 6
INJECT = {2: "inf", 4: "nan"}
INITIAL_SCALE_POWER = 8  # equal_loss_worker.ds_config's fp16 section


def run_fp16(tmp_path, engine: str) -> dict:
    inject = [arg for step, kind in INJECT.items() for arg in ("--inject", f"{step}:{kind}")]
    return run_worker(tmp_path, engine, "fp16", "--device", "cuda", "--steps", str(STEPS), *inject)


def test_fp16_overflow_skips_and_loss_scale_match_stock(tmp_path):
    baseline = run_fp16(tmp_path, "baseline")
    pooled = run_fp16(tmp_path, "memascend")
    keys = ("losses_hex", "initial_loss_scale", "loss_scales", "overflows", "skipped", "skipped_steps")
    print(json.dumps({name: {k: r[k] for k in keys} for name, r in (("baseline", baseline), ("memascend", pooled))}))

    expected_skipped = [step in INJECT for step in range(1, STEPS + 1)]
    for report in (baseline, pooled):
        assert report["device"] == "cuda" and report["dtype"] == "fp16"
        assert len(report["losses_hex"]) == STEPS
        # Exactly the injected steps are skipped, by the optimizer and by the engine's count.
        assert report["skipped"] == expected_skipped, report["engine"]
        assert report["overflows"] == expected_skipped, report["engine"]
        assert report["skipped_steps"] == len(INJECT)
        # Hysteresis 1: each injected step halves the scale; the 1000-step window never doubles it.
        assert report["initial_loss_scale"] == 2.0**INITIAL_SCALE_POWER
        scale = report["initial_loss_scale"]
        expected_scales = []
        for step in range(1, STEPS + 1):
            scale = scale / 2 if step in INJECT else scale
            expected_scales.append(scale)
        assert report["loss_scales"] == expected_scales, report["engine"]

    assert pooled["loss_scales"] == baseline["loss_scales"]
    applied = [i for i, was_skipped in enumerate(expected_skipped) if not was_skipped]
    assert [pooled["losses_hex"][i] for i in applied] == [baseline["losses_hex"][i] for i in applied]
