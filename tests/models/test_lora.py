"""LoRA through PEFT (memascend/models/lora.py, memascend/train/model_save.py): the settings, the checks
against the model, the merge (PEFT's own merge_and_unload is the oracle) and the stock DeepSpeed JSON
of a run with frozen parameters."""

from __future__ import annotations

import re

import pytest
import torch

from memascend.config import LoraConfig, build_run_config
from memascend.config.render import ModelShape, model_shape, render_ds_config
from memascend.errors import UserError
from memascend.models.lora import adapted_layers, apply_lora, trainable_numels
from memascend.train.model_save import merged_state_dict


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        tie_word_embeddings=True))


def test_the_settings_are_checked():
    assert not LoraConfig().enabled
    assert LoraConfig(rank=8).lora_alpha == 16.0 and LoraConfig(rank=8, alpha=4).lora_alpha == 4.0
    for bad, text in (({"rank": 0}, "must be at least 1, got 0"), ({"rank": 4, "dropout": 1.0}, "in [0, 1)"),
                      ({"rank": 4, "alpha": -1}, "must be positive"), ({"alpha": 8}, "needs --lora-rank"),
                      ({"merge": True}, "needs --lora-rank"),
                      ({"rank": 4, "target_modules": ("all-linear", "q_proj")}, "cannot be combined")):
        with pytest.raises(UserError, match=re.escape(text)):
            LoraConfig(**bad)


def test_flags_and_config_keys_build_the_section():
    cfg = build_run_config({"lora": {"rank": 4, "target_modules": ["q_proj", "k_proj"]}},
                           {"lora": {"dropout": 0.1}})
    assert cfg.lora == LoraConfig(rank=4, dropout=0.1, target_modules=("q_proj", "k_proj"))
    assert cfg.to_dict()["lora"]["rank"] == 4
    with pytest.raises(UserError, match="lora.rank"):
        build_run_config({"lora": {"rank": "8"}}, {})


def test_only_the_adapters_train_and_the_shape_knows_it():
    model = apply_lora(_tiny_llama(), LoraConfig(rank=4, target_modules=("q_proj", "v_proj")), origin="tiny")
    assert set(adapted_layers(model)) == {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")}
    # q_proj: A (4, 32) + B (32, 4); v_proj (32 -> 16): A (4, 32) + B (16, 4); two layers
    assert sum(trainable_numels(model)) == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    shape = model_shape(model)
    assert shape.trainable_numels == trainable_numels(model) and shape.trainable_numel == sum(trainable_numels(model))
    assert shape.total_numel == sum(p.numel() for p in model.parameters())
    full = model_shape(_tiny_llama())
    assert full.trainable_numels is None and full.optimizer_numels == full.param_numels


def test_the_adapters_take_the_base_dtype_and_the_seed():
    a = apply_lora(_tiny_llama().to(torch.bfloat16), LoraConfig(rank=2), origin="tiny", seed=5)
    b = apply_lora(_tiny_llama().to(torch.bfloat16), LoraConfig(rank=2), origin="tiny", seed=5)
    wa = a.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    wb = b.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    assert wa.dtype == torch.bfloat16 and torch.equal(wa, wb)


@pytest.mark.parametrize("cfg,text", [
    (LoraConfig(rank=4, target_modules=("nope_proj",)), "--lora-target-modules nope_proj: no such module in tiny"),
    (LoraConfig(rank=17, target_modules=("v_proj",)),
     r"--lora-rank 17 is above the width of model.layers.0.self_attn.v_proj in tiny \(32 -> 16\)"),
])
def test_what_the_model_refuses_is_one_user_error(cfg, text):
    with torch.device("meta"):
        model = _tiny_llama()
    with pytest.raises(UserError, match=text):
        apply_lora(model, cfg, origin="tiny")


def test_the_merge_is_peft_merge_and_unload():
    model = apply_lora(_tiny_llama(), LoraConfig(rank=4, alpha=12, target_modules=("all-linear",)), origin="tiny")
    with torch.no_grad():  # lora_B starts at zero: give the adapters something to merge
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    ours = merged_state_dict(model.state_dict(), 12 / 4)  # new tensors for merged weights only
    assert ours["lm_head.weight"].data_ptr() == ours["model.embed_tokens.weight"].data_ptr()  # tied: one storage
    oracle = model.merge_and_unload().state_dict()
    assert set(ours) == set(oracle)
    for name, tensor in oracle.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def _shape(frozen: bool) -> ModelShape:
    numels = (1000, 64, 64)
    return ModelShape(total_numel=sum(numels), param_numels=numels, module_param_counts=(1, 1, 1),
                      trainable_numels=(64,) if frozen else None)


@pytest.mark.parametrize("engine,frozen,prefetch_off,reuse_off", [
    ("baseline", True, True, True), ("baseline", False, False, False), ("memascend", True, False, True),
    ("memascend", False, False, False)])
def test_frozen_parameters_run_without_reuse_distance_and_stock_without_prefetch(engine, frozen, prefetch_off,
                                                                                  reuse_off):
    cfg = build_run_config({}, {"engine": engine})
    ds, derived = render_ds_config(cfg, _shape(frozen), 1, "/swap")
    keys = {d.key for d in derived}
    for key, off in (("stage3_prefetch_bucket_size", prefetch_off), ("stage3_max_reuse_distance", reuse_off)):
        assert ds["zero_optimization"].get(key) == (0 if off else None)
        assert (f"zero_optimization.{key}" in keys) == off


def test_a_users_prefetch_setting_wins(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text('{"zero_optimization": {"stage3_prefetch_bucket_size": 1000}}')
    cfg = build_run_config({}, {"engine": "baseline", "deepspeed_config": str(user)})
    ds, _ = render_ds_config(cfg, _shape(True), 1, "/swap")
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] == 1000
    assert ds["zero_optimization"]["stage3_max_reuse_distance"] == 0
