"""Bad input: one clear line on stderr, exit code 2, no traceback, nothing left behind."""

import json

import pytest

from tests.conftest import run_cli

TINY = ["--from-scratch", "llama-tiny", "--steps", "1", "--seq-len", "32", "--micro-batch", "1", "--eval-blocks", "1"]


def _assert_clean_failure(proc, match, tmp_path):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    err_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert len(err_lines) == 1 and match in err_lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()
    swap = tmp_path / "swap"
    assert not swap.exists() or not any(swap.iterdir())


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--model", "/nonexistent/model"], "model not found: /nonexistent/model"),
        (["--data", "/nonexistent/data.jsonl"], "data not found"),
        (["--seq-len", "100000"], "exceeds the model's limit of 8192"),
        (["--nvme-path", "/proc/memascend-swap"], "--nvme-path"),
        (["--config", "/nonexistent.toml"], "config file not found"),
    ],
)
def test_bad_paths_and_limits(tmp_path, extra, match):
    args = ["finetune", *TINY, "--output", str(tmp_path / "out"), "--nvme-path", str(tmp_path / "swap"), *extra]
    _assert_clean_failure(run_cli(args, tmp_path, timeout_s=300), match, tmp_path)


def test_malformed_jsonl_names_the_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": oops}\n')
    args = ["finetune", *TINY, "--data", str(data), "--output", str(tmp_path / "out"), "--nvme-path", str(tmp_path / "swap")]
    _assert_clean_failure(run_cli(args, tmp_path, timeout_s=300), "d.jsonl:2: malformed JSON", tmp_path)


def test_fp16_on_cpu_is_refused(tmp_path):
    args = ["finetune", *TINY, "--dtype", "fp16", "--output", str(tmp_path / "out"), "--nvme-path", str(tmp_path / "swap")]
    _assert_clean_failure(run_cli(args, tmp_path, timeout_s=300), "fp16 is not supported on this device", tmp_path)


def test_help_shows_units_and_defaults(tmp_path):
    proc = run_cli(["finetune", "--help"], tmp_path, timeout_s=120)
    assert proc.returncode == 0
    flat = " ".join(proc.stdout.split())
    for text in ("--nvme-path", "--micro-batch", "[default: 4]", "--deepspeed-config", "--from-scratch", "Tokens per sequence"):
        assert text in flat
