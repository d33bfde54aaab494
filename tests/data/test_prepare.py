"""The data process (memascend.data.prepare): the blocks it sends are the ones tokenizing in this
process gives, the tokenizer's saved files are the ones ``save_pretrained`` writes, a token-cache hit
loads no tokenizer, and its errors come back as the same one-line errors."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from memascend.config import ModelConfig
from memascend.data import build_blocks, prepare, read_documents, token_cache
from memascend.errors import UserError
from memascend.models import loading


@pytest.fixture(scope="module")
def model_dir():
    return loading.resolve_model(ModelConfig()).hf_dir


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private token cache for this process and the children it starts."""
    monkeypatch.setenv("MEMASCEND_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(token_cache.ENV_SWITCH, raising=False)
    return tmp_path / "cache" / "tokens"


def _request(model_dir, **kw) -> prepare.DataRequest:
    base = dict(hf_dir=str(model_dir), origin="smollm2-135m", source="chitchat", max_documents=300,
                data_format="auto", columns={}, max_bytes=1 << 30, seq_len=64, eval_blocks=3, seed=1,
                save_tokenizer=False)
    return prepare.DataRequest(**{**base, **kw})


def _same(a, b) -> None:
    for x, y in ((a.train, b.train), (a.eval, b.eval)):
        assert x.input_ids.dtype == y.input_ids.dtype == torch.long
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
    assert (a.num_documents, a.num_tokens) == (b.num_documents, b.num_tokens)


def _in_child(request):
    with prepare.start(request) as child:
        tokenizer = child.tokenizer()
        split = child.split()
    return split, tokenizer, child.peak_rss_bytes


@pytest.mark.parametrize("source", ["chitchat", "shakespeare"])
def test_the_child_sends_the_blocks_tokenizing_here_gives(model_dir, cache, smollm2_tokenizer, source):
    request = _request(model_dir, source=source)
    split, tokenizer, peak = _in_child(request)
    want = build_blocks(read_documents(source, 300), smollm2_tokenizer, 64, 3, 1)
    _same(split, want)
    assert len(tokenizer) == len(smollm2_tokenizer) and tokenizer.files == {}
    assert peak > 0
    # plain text learns every token: its labels are its ids, one tensor here as in the child; chat
    # labels have -100 for the prompts
    text = source == "shakespeare"
    assert (want.train.labels is want.train.input_ids) == text == (split.train.labels is split.train.input_ids)
    assert bool((split.train.labels == -100).any()) != text
    # again, with the token cache the first child wrote: the same blocks
    assert list(cache.glob("*.pt"))
    _same(_in_child(request)[0], want)


def test_the_saved_tokenizer_files_are_what_save_pretrained_writes(model_dir, cache, smollm2_tokenizer, tmp_path):
    _, tokenizer, _ = _in_child(_request(model_dir, save_tokenizer=True))
    smollm2_tokenizer.save_pretrained(tmp_path / "want")
    written = tokenizer.save_pretrained(tmp_path / "got")
    want = {p.relative_to(tmp_path / "want").as_posix(): p.read_bytes()
            for p in sorted((tmp_path / "want").rglob("*")) if p.is_file()}
    got = {p.relative_to(tmp_path / "got").as_posix(): p.read_bytes()
           for p in sorted((tmp_path / "got").rglob("*")) if p.is_file()}
    assert got == want and "tokenizer.json" in got
    assert sorted(written) == sorted(str(tmp_path / "got" / rel) for rel in got)


def test_a_saved_tokenizer_without_files_refuses_to_save(tmp_path):
    with pytest.raises(RuntimeError, match="not kept"):
        prepare.SavedTokenizer(num_ids=3, files={}).save_pretrained(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_cache_hit_loads_no_tokenizer(model_dir, cache, monkeypatch):
    monkeypatch.setattr(token_cache, "MIN_CACHED_CHARS", 0)
    loads = []
    real = loading.load_tokenizer
    monkeypatch.setattr(loading, "load_tokenizer", lambda src: loads.append(src) or real(src))
    request = _request(model_dir)
    first = prepare.prepare(request)
    assert len(loads) == 1 and len(list(cache.glob("*.pt"))) == 1
    again = prepare.prepare(request)
    assert len(loads) == 1  # the tokens came from the cache: no tokenizer made
    _same(first.split, again.split)
    assert again.tokenizer.num_ids == first.tokenizer.num_ids == 49152 and again.tokenizer.files == {}
    # a run that saves the model needs the tokenizer's files: loaded for them only
    saved = prepare.prepare(dataclasses.replace(request, save_tokenizer=True))
    assert len(loads) == 2 and "tokenizer.json" in saved.tokenizer.files
    _same(first.split, saved.split)


def test_files_key_follows_the_tokenizer_files_not_the_weights_nor_the_folder(model_dir, tmp_path):
    names = ["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        for name in names:
            shutil.copyfile(model_dir / name, folder / name)
    assert token_cache.files_key(a) == token_cache.files_key(b)  # where the folder is does not matter
    (a / "model.safetensors").write_bytes(b"weights")
    (a / ".complete").write_text("hidden")
    assert token_cache.files_key(a) == token_cache.files_key(b)  # weights and hidden files are not keyed
    (b / "chat_template.jinja").write_text((b / "chat_template.jinja").read_text() + " ")
    assert token_cache.files_key(a) != token_cache.files_key(b)
    (a / "chat_template.jinja").write_text((a / "chat_template.jinja").read_text() + " ")
    assert token_cache.files_key(a) == token_cache.files_key(b)
    (a / "additional_chat_templates").mkdir()
    (a / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    assert token_cache.files_key(a) != token_cache.files_key(b)


def test_the_childs_user_error_comes_back_as_one(model_dir, cache, tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(UserError) as in_process:
        prepare.prepare(_request(model_dir, source=str(missing)))
    with pytest.raises(UserError) as from_child:
        _in_child(_request(model_dir, source=str(missing)))
    assert str(from_child.value) == str(in_process.value) and "missing.jsonl" in str(from_child.value)


def test_a_folder_without_tokenizer_files_is_a_user_error(model_dir, cache, tmp_path):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    shutil.copyfile(model_dir / "config.json", folder / "config.json")
    with pytest.raises(UserError, match="has no tokenizer"):
        _in_child(_request(folder))


def test_a_child_that_crashes_is_a_runtime_error(model_dir, cache, capfd):
    with pytest.raises(RuntimeError, match="exited with status 1 before sending its results"):
        _in_child(_request(model_dir, seq_len="sixty-four"))  # a TypeError in the child: a bug, not bad input
    assert "Traceback" in capfd.readouterr().err  # the child's own traceback says where
