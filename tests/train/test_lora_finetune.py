"""One real LoRA fine-tune of the built-in SmolLM2 (ZeRO-3, base weights and optimizer on NVMe): only the
adapters train, and both outputs (the PEFT adapter, the merged model) load back with transformers/PEFT
and give the trained model's held-out loss."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_cli

SEQ_LEN, EVAL_BLOCKS, SEED, DOCUMENTS = 32, 2, 1234, 2
PARAMS = 134_515_008
"""SmolLM2-135M's parameters."""


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    args = ["finetune", "--steps", "1", "--seq-len", str(SEQ_LEN), "--micro-batch", "2", "--eval-blocks",
            str(EVAL_BLOCKS), "--max-documents", str(DOCUMENTS), "--lr", "5e-3", "--lora-rank", "4", "--lora-alpha", "8", "--merge-lora",
            "--output", str(tmp / "out"), "--nvme-path", str(tmp / "swap")]
    proc = run_cli(args, tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp / "out", json.loads((tmp / "out" / "report.json").read_text())


def _held_out_loss(model, blocks) -> float:
    """Token-weighted mean cross-entropy over ``blocks`` (as memascend.train.evaluation does it)."""
    loss_sum = tokens = 0.0
    with torch.no_grad():
        for i in range(0, len(blocks), 2):
            idx = torch.arange(i, min(i + 2, len(blocks)))
            ids, labels = blocks.input_ids[idx], blocks.labels[idx]
            count = float((labels[:, 1:] != -100).sum())
            loss_sum += float(model(input_ids=ids, labels=labels).loss) * count
            tokens += count
    return loss_sum / tokens


def test_only_the_adapters_train(lora_run):
    out, rep = lora_run
    assert rep["config"]["lora"]["rank"] == 4 and rep["num_steps"] == 1
    # NVMe: the bf16 base weights (+ adapters) and the optimizer state of the adapters only (a full
    # fine-tune writes 16 more bytes per parameter: fp32 master, two moments, gradient).
    assert PARAMS * 2 < rep["nvme"]["swap_folder_bytes"] < PARAMS * 2 * 1.1
    from safetensors import safe_open

    with safe_open(out / "adapter" / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
        shapes = {tuple(f.get_slice(k).get_shape()) for k in keys}
    # PEFT's default targets for Llama: q_proj and v_proj of each of the 30 layers, A and B each
    assert len(keys) == 30 * 2 * 2 and all(".lora_A." in k or ".lora_B." in k for k in keys)
    assert shapes == {(4, 576), (576, 4), (192, 4)}
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]


def test_adapter_and_merged_model_load_back_as_the_trained_model(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memascend.config import ModelConfig
    from memascend.data import build_blocks, read_documents
    from memascend.models.loading import resolve_model

    out, rep = lora_run
    tok = AutoTokenizer.from_pretrained(out / "adapter")
    blocks = build_blocks(read_documents("shakespeare", DOCUMENTS), tok, SEQ_LEN, EVAL_BLOCKS, SEED).eval
    base = AutoModelForCausalLM.from_pretrained(resolve_model(ModelConfig()).hf_dir, dtype=torch.bfloat16).eval()
    base_loss = _held_out_loss(base, blocks)
    # the adapters in the training dtype, as trained (PEFT would upcast them to fp32)
    with_adapter = PeftModel.from_pretrained(base, out / "adapter", autocast_adapter_dtype=False).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.bfloat16).eval()
    before, after = rep["eval"]["loss_before"], rep["eval"]["loss_after"]
    assert abs(base_loss - before) < 2e-3, (base_loss, before)
    assert abs(after - before) > 5e-3  # the adapters changed the model measurably
    adapter_loss = _held_out_loss(with_adapter, blocks)
    assert abs(adapter_loss - after) < 2e-3, (adapter_loss, after, before)
    merged_loss = _held_out_loss(merged, blocks)
    # W + (alpha / rank) * B @ A rounded to bf16 (as PEFT's merge_and_unload in bf16): measured 0.010-0.013 off
    assert abs(merged_loss - after) < 3e-2, (merged_loss, after, before)
    with torch.no_grad():
        ids = blocks.input_ids[:2]
        lp = torch.log_softmax(with_adapter(input_ids=ids).logits.float(), -1)
        lm = torch.log_softmax(merged(input_ids=ids).logits.float(), -1)
    # bf16: W + (alpha / rank) * B @ A rounded to bf16 moves each merged weight by up to half a bf16 step,
    # about as much as one step's adapter update here, so the merged model's log-probabilities differ
    # from the adapter's by bf16 noise (measured 0.10 on average)
    assert (lp - lm).abs().mean() < 0.15
    # the merged weights themselves: PEFT's merge in fp32 of the bf16 base and adapter, rounded once
    reference = PeftModel.from_pretrained(base.float(), out / "adapter").merge_and_unload().state_dict()
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(tensor.float(), reference[name], rtol=2**-8, atol=1e-7, msg=name)
