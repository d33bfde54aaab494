"""memascend.config.families: the architectures ``--from-scratch`` builds, their parameter counts (checked
against meta-device instances of the real ``transformers`` models), their configs and bad values."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from memascend.config import FROM_SCRATCH_PRESETS, FromScratchConfig, families, parse_from_scratch
from memascend.errors import UserError
from memascend.models.loading import from_scratch_config

MODEL_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gpt_neox": "GPTNeoXForCausalLM", "phi": "PhiForCausalLM", "gpt2": "GPT2LMHeadModel"}


def _meta(fs: FromScratchConfig):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(from_scratch_config(fs))


def _unique_numel(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_every_family_has_a_model_class():
    assert set(families.FAMILIES) == set(MODEL_CLASSES)


@pytest.mark.parametrize("arch", sorted(MODEL_CLASSES))
@pytest.mark.parametrize("tied", [True, False])
def test_param_numel_is_the_real_models(arch, tied):
    """The closed form (the planner's NVMe sizes, the regression suite's x axis) counts what
    ``transformers`` builds, tied or untied, with and without grouped-query attention."""
    kv = None if arch in ("gpt_neox", "gpt2") else 2
    fs = FromScratchConfig(arch=arch, hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=kv,
                           vocab_size=1000, max_position_embeddings=160, tie_word_embeddings=tied)
    model = _meta(fs)
    assert type(model).__name__ == MODEL_CLASSES[arch]
    assert _unique_numel(model) == fs.param_numel
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    assert (out.weight is inp.weight) == tied


def test_default_mlp_width_per_family():
    gated = FromScratchConfig(arch="mistral", hidden_size=576, num_layers=1, num_heads=9)
    plain = FromScratchConfig(arch="gpt_neox", hidden_size=576, num_layers=1, num_heads=9)
    assert (gated.mlp_size, plain.mlp_size) == (1536, 4 * 576)
    assert _meta(plain).config.intermediate_size == 4 * 576


def test_llama_config_is_unchanged():
    """The default family builds the same LlamaConfig as before the arch key (same losses)."""
    tiny = FROM_SCRATCH_PRESETS["llama-tiny"]
    old = LlamaConfig(vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size, intermediate_size=tiny.mlp_size,
                      num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads,
                      num_key_value_heads=tiny.kv_heads, max_position_embeddings=tiny.max_position_embeddings,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    assert tiny.arch == "llama" and tiny.dropout == 0.0
    assert from_scratch_config(tiny).to_dict() == old.to_dict()


@pytest.mark.parametrize("arch,keys", [
    ("llama", {"attention_dropout"}),
    ("qwen2", {"attention_dropout"}),
    ("gpt_neox", {"attention_dropout", "hidden_dropout"}),
    ("phi", {"attention_dropout", "resid_pdrop", "embd_pdrop"}),
    ("gpt2", {"attn_pdrop", "resid_pdrop", "embd_pdrop"}),
])
def test_dropout_reaches_every_dropout_of_the_family(arch, keys):
    fs = FromScratchConfig(arch=arch, hidden_size=64, num_layers=1, num_heads=4, dropout=0.25)
    cfg = from_scratch_config(fs)
    assert {k: getattr(cfg, k) for k in keys} == dict.fromkeys(keys, 0.25)
    plain = from_scratch_config(dataclasses.replace(fs, dropout=0.0))
    assert all(getattr(plain, k) == 0.0 for k in keys)


def test_gpt2_layout():
    """GPT-2: learned positions counted, the MLP width reaching ``n_inner``, and no dropout unless
    asked for (its config class defaults every dropout to 0.1)."""
    fs = FromScratchConfig(arch="gpt2", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=96,
                           max_position_embeddings=48, vocab_size=500)
    model = _meta(fs)
    assert model.transformer.wpe.weight.shape == (48, 64)
    assert model.transformer.h[0].mlp.c_fc.weight.shape == (64, 96)
    assert _unique_numel(model) == fs.param_numel
    cfg = from_scratch_config(fs)
    assert (cfg.n_inner, cfg.attn_pdrop, cfg.resid_pdrop, cfg.embd_pdrop) == (96, 0.0, 0.0, 0.0)


def test_gpt2_checkpointing_and_chunked_loss_give_the_plain_loss_and_gradients():
    """One training step of a from-scratch GPT-2 with dropout, as ``--activation-checkpointing
    --loss-chunk-tokens`` set it up (``gradient_checkpointing_enable``, then the chunked loss):
    the recompute replays the same dropout masks, so loss and gradients are the plain step's (fp32,
    within the chunked loss's reduction order)."""
    from memascend.train import chunked_loss

    fs = FromScratchConfig(arch="gpt2", hidden_size=64, num_layers=2, num_heads=4, vocab_size=300,
                           max_position_embeddings=64, dropout=0.1)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(from_scratch_config(fs)).train()
    lean = AutoModelForCausalLM.from_config(from_scratch_config(fs)).train()
    lean.load_state_dict(plain.state_dict())
    lean.gradient_checkpointing_enable()
    chunked_loss.install(lean, 24)
    ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (plain, lean):
        torch.manual_seed(7)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[1] - losses[0]) <= 2e-6 * abs(losses[0])
    for (name, a), b in zip(plain.named_parameters(), lean.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=2e-6 * float(a.grad.abs().max())), name


def test_family_presets():
    """The regression suite's families: an untied ~67 M Mistral (the issue's case), a tied Qwen2 and
    an untied GPT-NeoX with dropout, each built as its own architecture."""
    shapes = {name: FROM_SCRATCH_PRESETS[name] for name in families.PRESETS}
    assert {n: (p.arch, p.tie_word_embeddings) for n, p in shapes.items()} == {
        "mistral-0.07b": ("mistral", False), "qwen2-0.1b": ("qwen2", True),
        "gpt-neox-0.1b": ("gpt_neox", False), "phi-0.1b": ("phi", False), "gpt2-16m": ("gpt2", True)}
    assert 60e6 < shapes["mistral-0.07b"].param_numel < 70e6
    gpt2 = shapes.pop("gpt2-16m")
    assert round(gpt2.param_numel / 1e6, 1) == 16.0 and gpt2.dropout == 0.1
    assert (gpt2.hidden_size, gpt2.num_layers, gpt2.num_heads) == (256, 4, 4) and gpt2.max_position_embeddings >= 1024
    assert gpt2.param_numel == _unique_numel(_meta(gpt2))
    assert shapes["mistral-0.07b"].kv_heads < shapes["mistral-0.07b"].num_heads
    assert all(90e6 < p.param_numel < 110e6 for n, p in shapes.items() if n != "mistral-0.07b")
    assert shapes["gpt-neox-0.1b"].dropout > 0 and shapes["phi-0.1b"].dropout > 0
    assert parse_from_scratch("qwen2-0.1b") is FROM_SCRATCH_PRESETS["qwen2-0.1b"]


def test_parse_arch_and_dropout(tmp_path):
    fs = parse_from_scratch("arch=gpt_neox,hidden=64,layers=2,heads=4,dropout=0.1,tie_word_embeddings=false")
    assert (fs.arch, fs.dropout, fs.tie_word_embeddings) == ("gpt_neox", 0.1, False)
    assert parse_from_scratch("hidden=64,layers=2,heads=4").arch == "llama"
    toml = tmp_path / "m.toml"
    toml.write_text('arch = "phi"\nhidden = 64\nlayers = 2\nheads = 4\ndropout = 0.05\n')
    assert (parse_from_scratch(str(toml)).arch, parse_from_scratch(str(toml)).dropout) == ("phi", 0.05)


@pytest.mark.parametrize("spec,message", [
    ("arch=bert,hidden=64,layers=2,heads=4", r"unknown arch 'bert' \(known: llama, mistral, qwen2, gpt_neox, phi, gpt2\)"),
    ("arch=gpt_neox,hidden=64,layers=2,heads=4,kv_heads=2", "gpt_neox has no grouped-query attention"),
    ("hidden=64,layers=2,heads=4,dropout=1", r"dropout must be in \[0, 1\), got 1.0"),
    ("hidden=64,layers=2,heads=4,dropout=-0.1", r"dropout must be in \[0, 1\), got -0.1"),
    ("hidden=64,layers=2,heads=4,dropout=nan", "value of 'dropout' is not a finite number"),
    ("hidden=64,layers=2,heads=4,dropout=lots", "value of 'dropout' is not a finite number"),
])
def test_bad_family_values_are_user_errors(spec, message):
    with pytest.raises(UserError, match=message):
        parse_from_scratch(spec)


def _finetune(tmp, name: str, spec: str, *extra: str) -> dict:
    import json

    from tests.conftest import run_cli

    out = tmp / name
    proc = run_cli(["finetune", "--from-scratch", spec, "--seq-len", "32", "--micro-batch", "2", "--steps", "3",
                    "--eval-blocks", "0", "--no-save-model", "--seed", "7", "--output", str(out),
                    "--nvme-path", str(tmp / f"swap-{name}"), *extra], tmp, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def _hex_losses(rep: dict) -> list[str]:
    return [float.hex(s["loss"]) for s in rep["steps"]]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt_neox", "phi", "gpt2"])
def test_dropout_family_trains_bit_identically_on_both_engines(tmp_path, arch):
    """A from-scratch family with dropout 0.1 (masks drawn from the seeded RNG in the same order by
    both engines): stock and memascend give the same per-step losses bit for bit, and the dropout
    is live (the same model without it gives other losses)."""
    spec = f"arch={arch},hidden=64,layers=2,heads=4,tie_word_embeddings=false"
    memascend = _finetune(tmp_path, "memascend", f"{spec},dropout=0.1")
    baseline = _finetune(tmp_path, "baseline", f"{spec},dropout=0.1", "--engine", "baseline")
    plain = _finetune(tmp_path, "plain", spec)
    assert memascend["config"]["model"]["from_scratch"]["arch"] == arch
    assert _hex_losses(memascend) == _hex_losses(baseline)
    assert _hex_losses(plain)[0] != _hex_losses(memascend)[0]
