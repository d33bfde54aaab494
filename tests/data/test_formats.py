"""Row formats (issue 23): text, messages, alpaca and sharegpt rows as documents; column mappings;
errors naming the row and the field."""

from __future__ import annotations

import pytest

from memascend.data.formats import check_columns, parse_columns, row_to_document
from memascend.errors import UserError

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def doc(row, fmt="auto", columns=None):
    return row_to_document(row, fmt, parse_columns(columns), "d.x row 3")


def test_text_and_messages_rows_are_todays_documents():
    assert doc({"text": "hello"}).text == "hello"
    assert doc({"messages": CHAT, "id": 7}).messages == tuple(CHAT)
    # extra keys of a message are dropped, as before
    assert doc({"messages": [{**m, "name": "x"} for m in CHAT]}).messages == tuple(CHAT)
    # a row with both: text wins (today's JSONL order)
    assert doc({"text": "t", "messages": CHAT}).text == "t"


def test_alpaca_rows_become_one_exchange():
    d = doc({"instruction": "Add the numbers.", "input": "2 3", "output": "5"})
    assert d.messages == ({"role": "user", "content": "Add the numbers.\n2 3"}, {"role": "assistant", "content": "5"})
    d = doc({"instruction": "Say hi.", "input": "", "output": "Hi.", "system": "Be terse.",
             "history": [["Who are you?", "A bot."]]})
    assert [m["role"] for m in d.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert d.messages[0]["content"] == "Be terse." and d.messages[3]["content"] == "Say hi."
    assert doc({"instruction": "x", "input": None, "output": "y"}).messages[0]["content"] == "x"


def test_sharegpt_roles_are_mapped():
    d = doc({"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                               {"from": "gpt", "value": "A"}, {"from": "user", "value": "Q2"},
                               {"from": "assistant", "value": "A2"}]})
    assert [m["role"] for m in d.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in d.messages] == ["S", "Q", "A", "Q2", "A2"]
    d = doc({"conversations": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
             "system": "Sys"})
    assert d.messages[0] == {"role": "system", "content": "Sys"} and d.messages[2]["content"] == "A"


def test_column_mapping_and_explicit_format():
    assert doc({"body": "b"}, "text", "text=body").text == "b"
    qa = doc({"q": "Q?", "a": "A."}, "auto", "prompt=q,response=a")
    assert qa.messages == ({"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."})
    assert doc({"dialog": CHAT}, "chat", {"messages": "dialog"}).messages == tuple(CHAT)
    assert parse_columns("prompt=q, response=a") == {"instruction": "q", "output": "a"}
    assert parse_columns(None) == {} and parse_columns({"text": "body"}) == {"text": "body"}


@pytest.mark.parametrize("row, fmt, columns, match", [
    ({"title": "x"}, "auto", None, "d.x row 3: expected a 'text' string or a 'messages' list"),
    ({"text": 5}, "text", None, r"d.x row 3: 'text' must be a string, got int"),
    ({"body": None}, "text", "text=body", r"d.x row 3: 'text' \(column 'body'\) must be a string, got null"),
    ({"instruction": "i"}, "alpaca", None, "d.x row 3: no 'output' field"),
    ({"instruction": "i", "output": ["o"]}, "auto", None, "d.x row 3: 'output' must be a string, got list"),
    ({"instruction": "i", "output": "o", "history": [["q"]]}, "auto", None, "'history' must be a list of"),
    ({"conversations": "hi"}, "auto", None, "'conversations' must be a list, got str"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, "auto", None, "message 1: 'from' must be one of"),
    ({"conversations": [{"from": "human", "value": "x"}]}, "auto", None, "no assistant message to learn from"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "chat", None, "each message needs 'role'"),
    ({"text": "t"}, "chat", None, "'messages' must be a list, got null"),
])
def test_bad_rows_name_the_row_and_the_field(row, fmt, columns, match):
    with pytest.raises(UserError, match=match):
        doc(row, fmt, columns)


@pytest.mark.parametrize("spec, match", [
    ("text", "'text' is not FIELD=COLUMN"),
    ("body=text", "unknown field 'body'"),
    ("text=", "field 'text' needs a column name"),
    ("prompt=q,instruction=r", "field 'instruction' is given twice"),
])
def test_bad_column_mappings(spec, match):
    with pytest.raises(UserError, match=match):
        parse_columns(spec)


def test_columns_are_checked_before_the_rows():
    check_columns(["q", "a"], "alpaca", {"instruction": "q", "output": "a"}, "f.csv")
    with pytest.raises(UserError, match=r"f.csv: --data-format alpaca needs a column 'output' \(columns: q, a;"):
        check_columns(["q", "a"], "alpaca", {"instruction": "q"}, "f.csv")
    with pytest.raises(UserError, match="f.csv: --data-columns text=body: no column 'body'"):
        check_columns(["q"], "auto", {"text": "body"}, "f.csv")
    with pytest.raises(UserError, match="f.csv: columns q, a match no known format"):
        check_columns(["q", "a"], "auto", {}, "f.csv")
