"""``llama_config``: from-scratch models with tied and untied input/output embeddings."""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from memascend.config import FROM_SCRATCH_PRESETS
from memascend.models.loading import llama_config

TINY = FROM_SCRATCH_PRESETS["llama-tiny"]


def _build(hf_cfg):
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(hf_cfg)


def _unique_numel(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_untied_llama_tiny_has_its_own_lm_head():
    fs = dataclasses.replace(TINY, tie_word_embeddings=False)
    model = _build(llama_config(fs))
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert tuple(model.lm_head.weight.shape) == (fs.vocab_size, fs.hidden_size)
    assert _unique_numel(model) == fs.param_numel == TINY.param_numel + fs.vocab_size * fs.hidden_size


def test_tied_llama_tiny_is_unchanged():
    """The default (tied) builds the same weights as the LlamaConfig memascend used before the option."""
    model = _build(llama_config(TINY))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert _unique_numel(model) == TINY.param_numel == 3_277_120
    before = _build(LlamaConfig(vocab_size=TINY.vocab_size, hidden_size=TINY.hidden_size,
                                intermediate_size=TINY.mlp_size, num_hidden_layers=TINY.num_layers,
                                num_attention_heads=TINY.num_heads, num_key_value_heads=TINY.kv_heads,
                                max_position_embeddings=TINY.max_position_embeddings, tie_word_embeddings=True,
                                bos_token_id=1, eos_token_id=2, pad_token_id=2))
    old, new = before.state_dict(), model.state_dict()
    assert old.keys() == new.keys()
    assert all(torch.equal(old[k], new[k]) for k in old)


def test_model_classes_are_imported_without_scipy():
    """In a fresh process: the model classes import without SciPy, the causal-LM loss is there, and
    ``transformers``' own SciPy check answers as before afterwards."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from memascend.models.loading import import_modeling_without_scipy\n"
        "import_modeling_without_scipy()\n"
        "from transformers import AutoModelForCausalLM\n"
        "import transformers.models.llama.modeling_llama\n"
        "from transformers.loss.loss_utils import LOSS_MAPPING\n"
        "import transformers.utils as u\n"
        "import importlib.util\n"
        "print('scipy' in sys.modules, u.is_scipy_available() == (importlib.util.find_spec('scipy') is not None),"
        " 'ForCausalLM' in LOSS_MAPPING)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "True", "True"], proc.stdout
