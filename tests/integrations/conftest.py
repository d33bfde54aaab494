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


@pytest.fixture(scope="module")
def aio_ok():
    """Skips the module's tests where DeepSpeed's async_io op cannot be built (libaio missing)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed async_io op is not buildable here (libaio missing)")


@pytest.fixture
def single_rank(monkeypatch):
    """``deepspeed.comm.get_rank`` answers 0 without a process group (swapper code run as one rank)."""
    from deepspeed import comm

    monkeypatch.setattr(comm, "get_rank", lambda *a, **k: 0)
