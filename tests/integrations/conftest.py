"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def baseline_losses_hex(tmp_path_factory) -> list[str]:
    """Stock DeepSpeed's per-step losses for ``test_grad_stream_e2e.ARGS`` on this host: recorded for
    its CPU kernel level (``RECORDED_BASELINE_LOSSES_HEX``), else measured live (one ``--engine
    baseline`` run)."""
    from memascend.regress.golden import cpu_isa
    from tests.integrations.test_grad_stream_e2e import RECORDED_BASELINE_LOSSES_HEX, _finetune

    recorded = RECORDED_BASELINE_LOSSES_HEX.get(cpu_isa())
    if recorded is not None:
        return recorded
    return _finetune(tmp_path_factory.mktemp("grad-stream-baseline"), "baseline", "--engine", "baseline")["losses_hex"]
