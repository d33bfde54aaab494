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
