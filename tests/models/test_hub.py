"""Hugging Face model ids (issue 23): resolved from a local HF cache built here, offline; the one-line
errors offline; only the files a run needs are asked for."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from memascend.config import FROM_SCRATCH_PRESETS, ModelConfig
from memascend.errors import UserError
from memascend.models import hub
from memascend.models.loading import hub_origin, load_tokenizer, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
REPO_ID = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A tiny Llama saved with ``save_pretrained`` (safetensors) and the built-in model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny") / "model"
    tok = smollm2_tokenizer
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def build_hf_cache(cache: Path, folder: Path, repo_id: str = REPO_ID, commit: str = COMMIT,
                   refs: tuple[str, ...] = ("main",)) -> Path:
    """The layout ``huggingface_hub`` keeps (``models--org--name/{refs/<ref>, snapshots/<commit>/...}``)
    with ``folder``'s files as the snapshot; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    shutil.copytree(folder, snap)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf-hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_model_id_resolves_to_the_cached_snapshot_offline(offline_cache, tiny_folder):
    snap = build_hf_cache(offline_cache, tiny_folder)
    src = resolve_model(ModelConfig(name_or_path=REPO_ID))
    assert src.hf_dir == snap and src.origin == REPO_ID
    assert (src.snapshot.repo_id, src.snapshot.revision, src.snapshot.commit) == (REPO_ID, "main", COMMIT)
    assert src.snapshot.downloaded is False
    assert len(load_tokenizer(src)) == json.loads((snap / "config.json").read_text())["vocab_size"]
    assert hub_origin(ModelConfig(name_or_path=REPO_ID)) == {"id": REPO_ID, "revision": "main", "commit": COMMIT}


def test_revision_picks_a_tag_or_a_commit(offline_cache, tiny_folder):
    build_hf_cache(offline_cache, tiny_folder)
    old = build_hf_cache(offline_cache, tiny_folder, commit=OLD_COMMIT, refs=("v1",))
    by_tag = resolve_model(ModelConfig(name_or_path=REPO_ID, revision="v1"))
    by_commit = resolve_model(ModelConfig(name_or_path=REPO_ID, revision=OLD_COMMIT))
    assert by_tag.hf_dir == old and by_tag.snapshot.commit == OLD_COMMIT
    assert by_commit.hf_dir == old and by_commit.snapshot.revision == OLD_COMMIT
    assert hub_origin(ModelConfig(name_or_path=REPO_ID, revision="v1"))["commit"] == OLD_COMMIT
    with pytest.raises(UserError, match=f"model not found: {REPO_ID} .*no snapshot of revision 'v2'.*HF_HUB_OFFLINE=1"):
        resolve_model(ModelConfig(name_or_path=REPO_ID, revision="v2"))


def test_uncached_id_offline_is_one_line_naming_it(offline_cache):
    with pytest.raises(UserError) as err:
        resolve_model(ModelConfig(name_or_path="no-org/no-model"))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("model not found: no-org/no-model is not a local path")
    assert str(offline_cache) in msg and "HF_HUB_OFFLINE=1" in msg
    assert hub_origin(ModelConfig(name_or_path="no-org/no-model"))["commit"] is None


def test_snapshot_without_weights_serves_from_scratch_only(offline_cache, tiny_folder):
    snap = build_hf_cache(offline_cache, tiny_folder)
    (snap / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"lacks weights \(\*\.safetensors\) in snapshot 0123456789ab"):
        resolve_model(ModelConfig(name_or_path=REPO_ID))
    src = resolve_model(ModelConfig(name_or_path=REPO_ID, from_scratch=FROM_SCRATCH_PRESETS["llama-tiny"]))
    assert src.hf_dir == snap


def test_revision_is_refused_for_local_models(tiny_folder):
    with pytest.raises(UserError, match="--revision v1 applies to a Hugging Face model id"):
        resolve_model(ModelConfig(name_or_path=str(tiny_folder), revision="v1"))
    assert hub_origin(ModelConfig(name_or_path=str(tiny_folder))) is None
    assert hub_origin(ModelConfig()) is None


def test_hub_id_or_path():
    assert hub.is_hub_id("Qwen/Qwen2.5-0.5B") and hub.is_hub_id("org/name_v1.2")
    for name in ("smollm2-135m", "./org/name", "/abs/path", "a/b/c", "org/model.gguf", "org/"):
        assert not hub.is_hub_id(name), name


def test_only_the_files_a_run_needs_are_downloaded(tmp_path, monkeypatch, tiny_folder):
    """Online path, with ``snapshot_download`` replaced by the Hub's own file filter over a repository
    listing: config, tokenizer and safetensors at the top level; no .bin duplicates, no sub-folders;
    .bin weights only when the repository has no safetensors."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError
    from huggingface_hub.utils import filter_repo_objects

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    repo_files = {"with-st": ["config.json", "generation_config.json", "model.safetensors", "pytorch_model.bin",
                              "tokenizer.json", "tokenizer_config.json", "merges.txt", "vocab.json", "README.md",
                              "onnx/model.onnx", "onnx/config.json", "original/consolidated.00.pth", ".gitattributes"],
                  "bin-only": ["config.json", "pytorch_model.bin", "tokenizer.json"]}
    fetched: list[set[str]] = []

    def fake_snapshot_download(repo_id, *, allow_patterns, ignore_patterns, local_files_only=False, **kw):
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        names = set(filter_repo_objects(repo_files[repo_id.split("/")[1]], allow_patterns=allow_patterns,
                                        ignore_patterns=ignore_patterns))
        fetched.append(names)
        folder = tmp_path / repo_id / COMMIT
        folder.mkdir(parents=True, exist_ok=True)
        for name in names:
            src = tiny_folder / ("model.safetensors" if name.endswith((".safetensors", ".bin")) else name)
            (folder / name).write_bytes(src.read_bytes() if src.is_file() else b"{}")
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    snap = hub.resolve_hub_model("org/with-st", None, need_weights=True)
    assert fetched == [{"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                        "tokenizer_config.json", "merges.txt", "vocab.json"}]
    assert snap.commit == COMMIT and snap.downloaded
    fetched.clear()
    hub.resolve_hub_model("org/bin-only", "main", need_weights=True)
    assert fetched == [{"config.json", "tokenizer.json"}, {"config.json", "tokenizer.json", "pytorch_model.bin"}]
    fetched.clear()
    hub.resolve_hub_model("org/with-st", "main", need_weights=False)  # --from-scratch: no weights
    assert not any(name.endswith((".safetensors", ".bin")) for name in fetched[0])
