"""memascend/errors.py: the one reader of user-named text files and its messages."""

import os

import pytest

from memascend.config import load_config_file
from memascend.config.user_ds import read_ds_config
from memascend.errors import UserError, read_user_text


def test_read_user_text_names_the_file_and_the_problem(tmp_path):
    good = tmp_path / "a.toml"
    good.write_text("x = 1\n", encoding="utf-8")
    assert read_user_text(good, "config file") == "x = 1\n"
    with pytest.raises(UserError, match=r"^config file not found: .*missing\.toml$"):
        read_user_text(tmp_path / "missing.toml", "config file")
    latin = tmp_path / "l.json"
    latin.write_bytes(b'{"a": "caf\xe9"}')
    with pytest.raises(UserError, match=r"^DeepSpeed config .*l\.json is not UTF-8 text \(byte 10\)$"):
        read_user_text(latin, "DeepSpeed config")
    with pytest.raises(UserError, match=r"^cannot read config file .*: Is a directory$"):
        read_user_text(tmp_path, "config file")


def test_config_files_and_deepspeed_json_share_the_reader(tmp_path):
    latin = tmp_path / "l.toml"
    latin.write_bytes(b'engine = "caf\xe9"\n')
    with pytest.raises(UserError, match=r"config file .*l\.toml is not UTF-8 text \(byte 13\)"):
        load_config_file(latin)
    ds = tmp_path / "ds.json"
    ds.write_bytes(b'{"a": "caf\xe9"}')
    with pytest.raises(UserError, match=r"DeepSpeed config .*ds\.json is not UTF-8 text \(byte 10\)"):
        read_ds_config(ds)
    ds.write_text('{"a": 1,}\n')
    with pytest.raises(UserError, match="is not valid JSON: line 1"):
        read_ds_config(ds)
    assert os.path.exists(ds)  # a refused file is left as it was
