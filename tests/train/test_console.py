"""Phase lines and DeepSpeed's chatter (issue 23): one line per phase with the seconds since the
command started; DeepSpeed's logger passes errors only and cached-op prints are held back, unless
--verbose; held-back prints come out when the block fails."""

from __future__ import annotations

import logging
import time

import pytest

from memascend.train import console


def test_phase_line_has_the_elapsed_seconds(capsys):
    lines = console.PhaseLines(True, start_s=time.time() - 28.1)
    lines.line("model loaded (134.5M params, bf16)")
    err = capsys.readouterr().err
    assert err.startswith("[  28.") and err.endswith("s] model loaded (134.5M params, bf16)\n"), err
    assert lines.lines == [err.rstrip("\n")]
    quiet = console.PhaseLines(False, start_s=0.0)
    quiet.line("not on this rank")
    assert capsys.readouterr().err == "" and quiet.lines == []


def test_run_start_is_the_commands(monkeypatch):
    monkeypatch.setattr(console, "_run_start_s", None)  # restored after the test
    assert 0 < time.time() - console.run_start_s() < 3600  # not marked: this process's start
    console.mark_run_start(1000.5)  # the supervising parent's start, from the run's handover
    assert console.run_start_s() == 1000.5
    console.mark_run_start()
    assert 0 < time.time() - console.run_start_s() < 3600


def _ds_logger_output(verbose: bool) -> str:
    """What a logger set up as DeepSpeed's LoggerFactory does prints for a warning and an error."""
    import io

    logger = logging.getLogger(console.DEEPSPEED_LOGGER)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    undo = console.quiet_deepspeed_logger(verbose)
    try:
        logger.setLevel(logging.WARNING)  # LoggerFactory sets its level after the filter is in place
        logger.warning("Offloading to NVMe can generate heavy write traffic")
        logger.error("a real problem")
    finally:
        undo()
        logger.removeHandler(handler)
    return stream.getvalue()


def test_deepspeed_logger_passes_errors_only_unless_verbose():
    assert _ds_logger_output(False) == "a real problem\n"
    assert _ds_logger_output(True) == "Offloading to NVMe can generate heavy write traffic\na real problem\n"
    assert not logging.getLogger(console.DEEPSPEED_LOGGER).filters  # undone


def test_prints_are_held_back_unless_verbose_or_the_block_fails(capsys):
    with console.quiet_prints(False):
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
    assert capsys.readouterr() == ("", "")
    with console.quiet_prints(True):
        print("shown")
    assert capsys.readouterr().out == "shown\n"
    with pytest.raises(RuntimeError), console.quiet_prints(False):
        print("what the op printed before it failed")
        raise RuntimeError("op failed")
    out = capsys.readouterr()
    assert out.out == "" and out.err == "what the op printed before it failed\n"


@pytest.mark.parametrize("numel,text", [(134_515_008, "134.5M"), (3_300_000_000, "3.30B"), (850_000, "850.0K"),
                                        (12, "12")])
def test_format_params(numel, text):
    assert console.format_params(numel) == text
