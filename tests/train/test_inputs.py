"""A run's inputs (memascend.train.inputs.load_inputs): the data process makes the blocks, so the
training process never loads a tokenizer; a run that saves its model keeps the tokenizer's files, one
that does not keeps nothing of it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memascend.config import DataConfig, RunConfig
from memascend.config.presets import FROM_SCRATCH_PRESETS
from memascend.data import build_blocks, read_documents
from memascend.errors import UserError
from memascend.models import loading
from memascend.telemetry import footprint
from memascend.train.inputs import load_inputs


@pytest.fixture
def no_tokenizer_here(tmp_path, monkeypatch):
    """A private token cache; loading a tokenizer in this process fails the test."""
    monkeypatch.setenv("MEMASCEND_CACHE", str(tmp_path / "cache"))

    def refuse(src):
        raise AssertionError("the training process loaded a tokenizer")

    monkeypatch.setattr(loading, "load_tokenizer", refuse)
    footprint.reset()
    yield
    footprint.reset()


def _cfg(save_model: bool, **model) -> RunConfig:
    cfg = RunConfig(data=DataConfig(source="chitchat", max_documents=200, seq_len=64, eval_blocks=2))
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, save_model=save_model),
                               model=dataclasses.replace(cfg.model, **model))


def test_the_training_process_loads_no_tokenizer(no_tokenizer_here, tmp_path, smollm2_tokenizer):
    cfg = _cfg(save_model=True)
    inputs = load_inputs(cfg, tmp_path / "out")
    want = build_blocks(read_documents("chitchat", 200), smollm2_tokenizer, 64, 2, cfg.train.seed)
    for got, exp in ((inputs.split.train, want.train), (inputs.split.eval, want.eval)):
        assert torch.equal(got.input_ids, exp.input_ids) and torch.equal(got.labels, exp.labels)
    # the saved model gets the files the tokenizer's own save_pretrained writes
    smollm2_tokenizer.save_pretrained(tmp_path / "want")
    inputs.tokenizer.save_pretrained(tmp_path / "got")
    for path in (tmp_path / "want").iterdir():
        assert (tmp_path / "got" / path.name).read_bytes() == path.read_bytes()
    assert sorted(p.name for p in (tmp_path / "got").iterdir()) == sorted(p.name for p in (tmp_path / "want").iterdir())
    assert len(inputs.tokenizer) == len(smollm2_tokenizer)
    # the start-up points are marked; the child's peak is recorded beside them
    assert {"tokenizer", "data"} <= set(footprint.marks())
    assert footprint.child_peaks()["data"] > 0
    assert not (tmp_path / "out").exists()


def test_a_run_that_saves_no_model_keeps_no_tokenizer(no_tokenizer_here, tmp_path):
    inputs = load_inputs(_cfg(save_model=False), tmp_path / "out")
    assert inputs.tokenizer is None and len(inputs.split.train) > 0


def test_a_from_scratch_vocabulary_under_the_tokenizers_is_refused(no_tokenizer_here, tmp_path):
    small = dataclasses.replace(FROM_SCRATCH_PRESETS["llama-tiny"], vocab_size=1000)
    with pytest.raises(UserError, match="vocab_size 1000 is smaller than the tokenizer's 49152"):
        load_inputs(_cfg(save_model=False, from_scratch=small), tmp_path / "out")
