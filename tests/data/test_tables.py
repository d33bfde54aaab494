"""``--data`` read with the ``datasets`` library (issue 23): alpaca and sharegpt files, parquet, CSV,
arrow, ``save_to_disk`` folders, Hub ids offline; errors name the file and the row."""

from __future__ import annotations

import json

import pytest

from memascend.data import build_blocks, read_documents
from memascend.data.blocks import IGNORE_INDEX
from memascend.errors import UserError

ALPACA = [{"instruction": f"Repeat the number {i}.", "input": "" if i % 2 else f"context {i}",
           "output": f"The number is {i}."} for i in range(40)]
SHAREGPT = [{"conversations": [{"from": "system", "value": "You count."}, {"from": "human", "value": f"Count to {i}."},
                               {"from": "gpt", "value": " ".join(str(k) for k in range(i + 1))}]} for i in range(40)]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """The ``datasets`` cache in the test's folder; the Hub offline."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "ds-cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _dataset(rows):
    import datasets

    return datasets.Dataset.from_list(rows)


def test_alpaca_json_and_sharegpt_jsonl_train_on_the_assistant_only(tmp_path, smollm2_tokenizer):
    (tmp_path / "alpaca.json").write_text(json.dumps(ALPACA))
    with open(tmp_path / "sharegpt.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in SHAREGPT)
    alpaca = read_documents(str(tmp_path / "alpaca.json"))
    assert len(alpaca) == 40 and alpaca[0].messages[0] == {"role": "user", "content": "Repeat the number 0.\ncontext 0"}
    assert alpaca[0].origin.endswith("alpaca.json row 1")
    sharegpt = read_documents(str(tmp_path / "sharegpt.jsonl"))
    assert sharegpt[3].messages[2] == {"role": "assistant", "content": "0 1 2 3"}
    split = build_blocks(alpaca + sharegpt, smollm2_tokenizer, 32, 1, 0)
    learned = smollm2_tokenizer.decode(split.train.labels[split.train.labels != IGNORE_INDEX])
    assert "The number is" in learned and "Repeat the number" not in learned and "You count." not in learned


def test_parquet_csv_arrow_and_saved_folders(tmp_path):
    import datasets

    ds = _dataset(SHAREGPT)
    ds.to_parquet(str(tmp_path / "sharegpt.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": _dataset(ALPACA), "test": _dataset(ALPACA[:2])}).save_to_disk(str(tmp_path / "dd"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    (tmp_path / "sharegpt.arrow").write_bytes(arrow.read_bytes())
    (tmp_path / "qa.csv").write_text('q,a\n"What, exactly?",0012\nNA,"two\nlines"\n')
    want = read_documents(str(tmp_path / "sharegpt.parquet"))
    assert [d.messages for d in want] == [d.messages for d in read_documents(str(tmp_path / "saved"))]
    assert [d.messages for d in want] == [d.messages for d in read_documents(str(tmp_path / "sharegpt.arrow"))]
    assert len(read_documents(str(tmp_path / "dd"))) == 40  # the train split of a DatasetDict
    qa = read_documents(str(tmp_path / "qa.csv"), columns="prompt=q,response=a")
    # every CSV cell is text: no 0012 -> 12, no NA -> missing
    assert [[m["content"] for m in d.messages] for d in qa] == [["What, exactly?", "0012"], ["NA", "two\nlines"]]
    (tmp_path / "alpaca.json").write_text(json.dumps(ALPACA))
    both = read_documents(f"{tmp_path / 'sharegpt.parquet'},{tmp_path / 'alpaca.json'}", max_documents=41)
    assert len(both) == 41 and both[-1].origin.endswith("alpaca.json row 1")


def test_bad_rows_and_columns_name_the_file_and_the_row(tmp_path):
    rows = [dict(r) for r in ALPACA[:20]]
    rows[16]["output"] = None
    _dataset(rows).to_parquet(str(tmp_path / "data.parquet"))
    with pytest.raises(UserError, match=r"data\.parquet row 17: 'output' must be a string, got null"):
        read_documents(str(tmp_path / "data.parquet"))
    mixed = [dict(r) for r in ALPACA[:3]]
    mixed[1]["output"] = 5
    (tmp_path / "mixed.json").write_text(json.dumps(mixed))
    with pytest.raises(UserError, match=r"mixed\.json row 2: 'output' must be a string, got int"):
        read_documents(str(tmp_path / "mixed.json"))
    with pytest.raises(UserError, match=r"data\.parquet: --data-format sharegpt needs a column 'conversations'"):
        read_documents(str(tmp_path / "data.parquet"), data_format="sharegpt")
    with pytest.raises(UserError, match=r"data\.parquet: --data-columns text=body: no column 'body'"):
        read_documents(str(tmp_path / "data.parquet"), columns="text=body")
    (tmp_path / "broken.json").write_text('[{"text": "a"}, {"text": ')
    with pytest.raises(UserError, match=r"broken\.json: cannot read it as json data"):
        read_documents(str(tmp_path / "broken.json"))
    (tmp_path / "n.txt").write_text("plain")
    with pytest.raises(UserError, match="plain text: --data-format alpaca"):
        read_documents(str(tmp_path / "n.txt"), data_format="alpaca")
    with pytest.raises(UserError, match="not to the built-in corpus shakespeare"):
        read_documents("shakespeare", data_format="text")
    with pytest.raises(UserError, match="--data-format must be one of"):
        read_documents(str(tmp_path / "data.parquet"), data_format="xml")


def test_uncached_hub_data_set_offline_is_one_line(tmp_path):
    with pytest.raises(UserError) as err:
        read_documents("no-org/no-data")
    assert str(err.value).startswith("data not found: no-org/no-data is not a local path")
    assert "HF_HUB_OFFLINE=1" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="data not found: no-org/missing.parquet"):
        read_documents("no-org/missing.parquet")  # a data file's path, not an id
