"""What the run takes from elsewhere is said, and what the user asks for is never silently dropped:
a ``--deepspeed-config`` value that becomes the run's prints its ``memascend: note:`` line also when
it equals memascend's default, and a ``--data-columns`` mapping that names a column no row has is
refused with one line instead of being ignored."""

from __future__ import annotations

import json
import os

from tests.conftest import run_cli


class _ReachedTheJob(Exception):
    """Raised in place of starting the training process."""


def _first_process_stderr(args: list[str], cwd, monkeypatch, capsys) -> str:
    """stderr of ``memascend ARGS`` in this process, up to where the first process would start the job."""
    from memascend.cli.main import cli
    from memascend.train import supervisor

    def reached(*_args, **_kwargs):
        raise _ReachedTheJob

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", supervisor.SUPERVISED_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(supervisor, "supervise", reached)
    monkeypatch.chdir(cwd)
    env = dict(os.environ)
    capsys.readouterr()
    try:
        cli.main(args=args, prog_name="memascend")
    except _ReachedTheJob:
        pass
    finally:
        os.environ.clear()
        os.environ.update(env)
    return capsys.readouterr().err


def test_a_json_value_equal_to_the_default_is_noted_too(tmp_path, monkeypatch, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}))
    err = _first_process_stderr(["finetune", "--from-scratch", "llama-tiny", "--deepspeed-config", str(ds),
                                 "--output", str(tmp_path / "out")], tmp_path, monkeypatch, capsys)
    notes = [ln for ln in err.splitlines() if ln.startswith("memascend: note:")]
    assert f"memascend: note: {ds}: train_micro_batch_size_per_gpu = 4 is the run's --micro-batch " \
           "(the default as well)" in notes, err
    assert f"memascend: note: {ds}: gradient_accumulation_steps = 2 is the run's --grad-accum (default 1)" in notes
    assert len(notes) == 2, err


def test_data_columns_naming_no_column_of_the_rows_is_refused(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i} " * 20}]} for i in range(40)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    proc = run_cli(["finetune", "--from-scratch", "llama-tiny", "--seq-len", "32", "--data", str(data),
                    "--data-columns", "text=nope", "--output", str(out), "--nvme-path", str(tmp_path / "swap")],
                   tmp_path, timeout_s=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend: error:")]
    assert errors == [f"memascend: error: {data}: --data-columns text=nope: no row has a column 'nope'; map a "
                      "column the rows have, or drop it"], proc.stderr[-3000:]
    assert not out.exists() and not (tmp_path / "swap").exists()


def test_data_columns_naming_a_column_some_rows_have_is_read(tmp_path):
    """A mixed file: the mapped column is on the text rows; the chat rows keep their own format."""
    from memascend.data.readers import read_jsonl

    data = tmp_path / "mixed.jsonl"
    data.write_text(json.dumps({"body": "plain text"}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n")
    docs = list(read_jsonl(data, "auto", {"text": "body"}))
    assert docs[0].text == "plain text" and docs[1].messages is not None
