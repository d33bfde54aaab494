"""Layer-by-layer loading of a safetensors folder into a ZeRO-3 model (memascend.models.layerwise).

The end-to-end check loads four small folders (tied / untied, sharded / one file, fp32 / bf16
checkpoints, bf16 / fp32 training) both ways in one subprocess (``layerwise_worker.py``) and compares
the gathered parameters and buffers of the two models bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memascend.models import layerwise

WORKER = Path(__file__).with_name("layerwise_worker.py")


def test_group_key_is_the_layer_or_the_module():
    assert layerwise.group_key("model.layers.7.mlp.up_proj.weight") == "model.layers.7"
    assert layerwise.group_key("model.layers.12.input_layernorm.weight") == "model.layers.12"
    assert layerwise.group_key("transformer.h.0.attn.c_attn.bias") == "transformer.h.0"
    assert layerwise.group_key("model.embed_tokens.weight") == "model.embed_tokens"
    assert layerwise.group_key("lm_head.weight") == "lm_head"
    assert layerwise.group_key("bias") == "bias"


def test_group_keys_keep_first_seen_order():
    keys = ["lm_head.weight", "model.layers.1.a.weight", "model.layers.0.b.weight", "model.layers.1.b.weight",
            "model.norm.weight"]
    assert layerwise.group_keys(keys) == [["lm_head.weight"], ["model.layers.1.a.weight", "model.layers.1.b.weight"],
                                          ["model.layers.0.b.weight"], ["model.norm.weight"]]


def test_hooks_exist_in_the_installed_transformers():
    """Without them the memascend engine would silently load as stock does (no memory bound)."""
    assert layerwise.hooks_available()


def test_context_restores_transformers():
    import transformers.modeling_utils as mu
    from transformers.integrations import HfDeepSpeedConfig

    before = (mu.load_state_dict, mu._load_state_dict_into_zero3_model)
    with layerwise.layerwise_zero3_loading() as active:  # no ZeRO-3 config alive: stock loading
        assert not active
        assert (mu.load_state_dict, mu._load_state_dict_into_zero3_model) == before
    hf_ds = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    try:
        with layerwise.layerwise_zero3_loading() as active:
            assert active
            assert (mu.load_state_dict, mu._load_state_dict_into_zero3_model) != before
    finally:
        del hf_ds
    assert (mu.load_state_dict, mu._load_state_dict_into_zero3_model) == before


def _resident_bytes(path) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


@pytest.mark.skipif(shutil.which("fincore") is None, reason="needs util-linux fincore")
def test_drop_cached_pages_empties_the_page_cache(tmp_path):
    path = tmp_path / "shard.safetensors"
    with open(path, "wb") as f:
        f.write(os.urandom(8 << 20))
        f.flush()
        os.fsync(f.fileno())  # dirty pages cannot be dropped
    path.read_bytes()
    if _resident_bytes(path) == 0:
        pytest.skip("this filesystem keeps no page cache for the file")
    layerwise.drop_cached_pages(str(path))
    assert _resident_bytes(path) == 0


def test_drop_cached_pages_tolerates_a_missing_file(tmp_path):
    layerwise.drop_cached_pages(str(tmp_path / "absent.safetensors"))
    (tmp_path / "x.bin").write_bytes(b"x" * 4096)
    layerwise.drop_cached_pages(str(tmp_path / "x.bin"))


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    root = tmp_path_factory.mktemp("layerwise")
    proc = subprocess.run([sys.executable, str(WORKER), "--root", str(root)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split(" ", 1) for line in proc.stdout.splitlines() if line.endswith("}")]
    return ({r["case"]: r for kind, text in lines if kind == "LAYERWISE_REPORT" for r in [json.loads(text)]},
            [json.loads(text) for kind, text in lines if kind == "FROM_SCRATCH_REPORT"])


def test_layerwise_weights_equal_from_pretrained(reports):
    reports = reports[0]
    assert len(reports) == 4
    for name, r in reports.items():
        assert r["differ"] == [], name
        assert r["unlike_file"] == [] and r["file_tensors"] > 0, name
        assert r["tensors"] == 32, name  # 3 layers x 9 + embedding, norm, lm_head + 2 rotary buffers
        assert r["tied"] == r["stock_tied"] == name.startswith("tied"), name
        assert r["config_equal"] and r["generation_config_equal"], name
        assert r["training"] == [False, False], name  # from_pretrained's eval(), kept
    assert reports["tied-sharded-fp32-to-bf16"]["shards"] > 1
    assert reports["untied-onefile-fp32-to-fp32"]["shards"] == 1
    assert reports["untied-onefile-fp32-to-fp32"]["param_dtype"] == "torch.float32"
    assert reports["tied-sharded-fp32-to-bf16"]["param_dtype"] == "torch.bfloat16"


def test_layerwise_copies_one_layer_or_module_at_a_time(reports):
    for name, r in reports[0].items():
        assert r["stock_calls"] == 1, name  # stock: every shard merged, copied in one call
        groups = r["call_groups"]
        assert all(len(g) == 1 for g in groups), (name, groups)
        assert sorted(g[0] for g in groups if g[0].isdigit()) == ["0", "1", "2"], name
        assert r["calls"] == (5 if r["tied"] else 6), name
        assert r["largest_call_keys"] == 9, name  # one decoder layer: 7 matrices + 2 norms


def test_layerwise_leaves_no_checkpoint_pages_cached(reports):
    """POSIX_FADV_DONTNEED after each layer: the shards' pages that stock's load left in the page
    cache (and the layer-wise load read again) are gone once it is done."""
    for name, r in reports[0].items():
        stock, mine = r["cached_bytes"]
        if stock is None or stock == 0:
            pytest.skip("no fincore, or a filesystem without a page cache for the files")
        assert mine == 0, (name, r["cached_bytes"])


def test_from_scratch_built_in_training_dtype_is_unchanged(reports):
    """Llama, Mistral, Qwen2, GPT-NeoX and Phi, bf16 and fp32: the same seed gives the same weights and
    buffers whether the modules are made in fp32 and cast (stock) or in the training dtype."""
    scratch = reports[1]
    assert len(scratch) == 10
    for r in scratch:
        assert r["differ"] == [] and r["tensors"] > 20, r
        assert r["config_equal"], r
        assert r["model_class"] == [r["family"].replace("Config", "ForCausalLM")] * 2, r
        assert r["param_dtype"] == {"bf16": "torch.bfloat16", "fp32": "torch.float32"}[r["dtype"]], r
        assert r["default_dtype_after"] == "torch.float32", r  # the context gives torch's default back


def test_training_dtype_follows_the_deepspeed_config():
    import torch

    assert layerwise.training_dtype({"bf16": {"enabled": True}}) is torch.bfloat16
    assert layerwise.training_dtype({"fp16": {"enabled": True}}) is torch.float16
    assert layerwise.training_dtype({"bf16": {"enabled": False}}) is torch.float32
    assert layerwise.training_dtype({}) is torch.float32
    with layerwise.constructed_in_training_dtype({"bf16": {"enabled": True}}):
        assert torch.get_default_dtype() is torch.bfloat16
    assert torch.get_default_dtype() is torch.float32
