"""Attention without a sequence x sequence matrix: the models memascend builds use torch's
scaled-dot-product attention (transformers 5's default), whose causal kernel on the CPU keeps no
``heads x seq x seq`` scores when no attention mask is passed (memascend passes none)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from memascend.config import FROM_SCRATCH_PRESETS
from memascend.models.loading import from_scratch_config


@pytest.mark.parametrize("preset", ["llama-0.1b", "mistral-0.07b", "qwen2-0.1b", "gpt-neox-0.1b", "phi-0.1b", "gpt2-16m"])
def test_from_scratch_models_use_sdpa(preset):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(from_scratch_config(FROM_SCRATCH_PRESETS[preset]))
    assert model.config._attn_implementation == "sdpa"


_PROBE = """
import resource, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=8192))
ids = torch.randint(0, 64, (1, 8192))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
m(input_ids=ids, labels=ids).loss.backward()
print(m.config._attn_implementation, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_sdpa_forward_and_backward_hold_no_seq_by_seq_scores():
    """8 heads x 8192^2 fp32 scores would be 2 GiB; the run grows its peak RSS by far less."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, check=True)
    impl, growth_bytes = out.stdout.split()[-2:]
    assert impl == "sdpa"
    assert int(growth_bytes) < 256 << 20
