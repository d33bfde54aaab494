import json

import pytest

from memascend.data import read_documents
from memascend.errors import UserError


def test_jsonl_text_and_messages(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(
        json.dumps({"text": "hello world"})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
    )
    docs = read_documents(str(f))
    assert docs[0].text == "hello world"
    assert docs[1].messages[1] == {"role": "assistant", "content": "yo"}


@pytest.mark.parametrize(
    "bad_line, match",
    [
        ('{"text": "unterminated', "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"title": "x"}', "expected a 'text' string"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "role"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant"),
    ],
)
def test_malformed_jsonl_line_reports_its_line_number(tmp_path, bad_line, match):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok"}\n{"text": "ok too"}\n' + bad_line + "\n")
    with pytest.raises(UserError, match=rf"d\.jsonl:3: .*{match}"):
        read_documents(str(f))


def test_text_folder_and_missing_paths(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("beta")
    (tmp_path / "ignored.bin").write_bytes(b"\x00")
    docs = read_documents(str(tmp_path))
    assert sorted(d.text for d in docs) == ["alpha", "beta"]
    with pytest.raises(UserError, match="data not found"):
        read_documents(str(tmp_path / "nope.jsonl"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no .txt or .md"):
        read_documents(str(empty))


def test_non_utf8_text_is_a_user_error(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8"):
        read_documents(str(f))


def test_builtin_corpora_are_real():
    plays = read_documents("shakespeare")
    assert len(plays) == 38
    assert any("Hamlet" in d.text or "HAMLET" in d.text for d in plays)
    chats = read_documents("chitchat", max_documents=50)
    assert len(chats) == 50
    for doc in chats:
        roles = [m["role"] for m in doc.messages]
        assert roles[0] == "user" and "assistant" in roles
        assert all(a != b for a, b in zip(roles, roles[1:]))  # turns alternate


def _peak_rss_growth_bytes(fn) -> int:
    """How far this process's peak RSS rose while ``fn()`` ran (bytes)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024


def _refused(source: str, match: str, **kw) -> float:
    """Seconds until ``read_documents(source)`` is refused with ``match``; the refusal must not raise
    the process's peak RSS by more than 64 MiB."""
    import time

    start = time.perf_counter()

    def call():
        with pytest.raises(UserError, match=match):
            read_documents(source, **kw)

    assert _peak_rss_growth_bytes(call) < 64 << 20
    return time.perf_counter() - start


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".csv"])
def test_data_larger_than_the_cap_is_refused_before_it_is_read(tmp_path, suffix):
    """A sparse file far past the cap is refused from its size, naming the file and the cap: with the
    default cap (1 GiB) for a 2 GiB file, and with a small cap set through max_bytes."""
    import os

    big = tmp_path / f"big{suffix}"
    with open(big, "wb") as f:
        f.truncate(2 << 30)
    assert os.stat(big).st_blocks == 0  # sparse: nothing allocated
    assert _refused(str(big), rf"^{big}: --data holds more than --max-data-bytes 1.00 GiB \(1,073,741,824 bytes") < 1
    small = tmp_path / f"small{suffix}"
    with open(small, "wb") as f:
        f.truncate(64 << 20)
    ok = tmp_path / "ok.txt"
    ok.write_text("a few words\n")
    match = rf"^{small}: --data holds more than --max-data-bytes 1.00 MiB \(1,048,576 bytes; \[data\] max_bytes"
    assert _refused(f"{ok},{small}", match, max_bytes=1 << 20) < 1
    assert [d.text for d in read_documents(str(ok), max_bytes=12)] == ["a few words\n"]
    with pytest.raises(UserError, match="more than --max-data-bytes 11 B"):
        read_documents(str(ok), max_bytes=11)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".parquet"])
def test_a_fifo_or_a_device_as_data_is_refused(tmp_path, suffix):
    """A FIFO, and /dev/zero behind a symlink, are refused at once, naming the file (reading either
    would block for ever or fill the memory)."""
    import os
    import threading
    import time

    fifo = tmp_path / f"pipe{suffix}"
    os.mkfifo(fifo)
    stop = threading.Event()

    def unblock():
        """Give a reader that blocked in open() an end of file, so that the test fails, not hangs."""
        deadline = time.monotonic() + 5
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                time.sleep(0.05)

    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    try:
        assert _refused(str(fifo), rf"^data file {fifo} is a FIFO \(named pipe\), not a regular file") < 1
    finally:
        stop.set()
        thread.join()
    zero = tmp_path / f"zero{suffix}"
    zero.symlink_to("/dev/zero")
    assert _refused(str(zero), rf"^data file {zero} \(-> /dev/zero\) is a character device, not a regular file") < 1
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("alpha")
    (folder / "z.txt").symlink_to("/dev/zero")
    assert _refused(str(folder), r"z.txt \(-> /dev/zero\) is a character device") < 1


def test_text_and_jsonl_are_read_in_bounded_pieces(tmp_path):
    """The readers count what they read against the budget as they go: a file holding more than the
    budget leaves (whatever its size said) is stopped after at most the budget plus one piece."""
    from memascend.data.readers import DataBudget, read_jsonl, read_text_file

    text = tmp_path / "t.txt"
    text.write_text("word " * 1000)
    assert read_text_file(text, DataBudget(5000)) == "word " * 1000
    budget = DataBudget(4000)
    with pytest.raises(UserError, match=rf"^{text}: --data holds more than --max-data-bytes 3.91 KiB"):
        read_text_file(text, budget)
    assert budget.used_bytes <= 4001
    one_line = tmp_path / "d.jsonl"
    one_line.write_text(json.dumps({"text": "x" * 10_000}) + "\n")
    budget = DataBudget(100)
    with pytest.raises(UserError, match=rf"^{one_line}: --data holds more than"):
        list(read_jsonl(one_line, budget=budget))
    assert budget.used_bytes <= 101
    split = tmp_path / "split.txt"  # a multi-byte character across the boundary of two pieces
    split.write_bytes(b"a" * ((4 << 20) - 1) + "\u00e9t\u00e9".encode())
    assert read_text_file(split) == "a" * ((4 << 20) - 1) + "\u00e9t\u00e9"
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a" * ((4 << 20) + 3) + b"\xe9 x")
    with pytest.raises(UserError, match=rf"bad.txt: not UTF-8 text \(invalid continuation byte at byte {(4 << 20) + 3}\)"):
        read_text_file(bad)


def test_plan_refuses_the_data_finetune_would_refuse(tmp_path):
    """plan reads no data, but refuses a device, a FIFO or data past --max-data-bytes from their sizes."""
    import os

    from click.testing import CliRunner

    from memascend.cli.main import cli

    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "pipe.jsonl")
    (tmp_path / "big.txt").write_text("x" * 2000)
    for data, extra, message in (("zero.txt", [], "(-> /dev/zero) is a character device"),
                                 ("pipe.jsonl", [], "is a FIFO (named pipe)"),
                                 ("big.txt", ["--max-data-bytes", "1KiB"], "--data holds more than --max-data-bytes 1.00 KiB")):
        res = CliRunner().invoke(cli, ["plan", "--from-scratch", "llama-tiny", "--data", str(tmp_path / data), *extra])
        assert res.exit_code == 2 and message in res.output, res.output
    res = CliRunner().invoke(cli, ["plan", "--from-scratch", "llama-tiny", "--data", str(tmp_path / "big.txt")])
    assert res.exit_code == 0, res.output
