"""Bad input, its one error line and its exit code: the cases tests/cli/test_finetune_errors.py runs
and the "Bad input" table of docs/usage.md is generated from.

    python3 -m tests.cli.bad_input_cases --write-readme   # rewrite docs/usage.md's table from CASES
    python3 -m tests.cli.bad_input_cases --check          # exit 1 when docs/usage.md's table differs

Each case is run as ``python -m memascend COMMAND [the command's common flags] ARGS`` in a fresh
folder holding the case's files; ``{tmp}`` in an argument is that folder. The test asserts exactly one
``memascend: error:`` line containing ``message``, the exit code, no traceback, and that the folder
holds the same files afterwards (nothing created, nothing modified, nothing deleted).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
USAGE_DOC = REPO / "docs" / "usage.md"
"""The file that holds the bad-input table (between :data:`BEGIN` and :data:`END`)."""
BEGIN = "<!-- bad-input-table:begin -->"
END = "<!-- bad-input-table:end -->"

# Flags every case of a command gets before its own (a short run; output and swap in the case folder).
# No --from-scratch (it would replace a --model case's architecture and weights) and no --micro-batch
# (a flag overrides a --config case's value).
COMMON: dict[str, tuple[str, ...]] = {
    "finetune": ("--steps", "1", "--seq-len", "32", "--eval-blocks", "1", "--output", "{tmp}/out",
                 "--nvme-path", "{tmp}/swap"),
    "plan": (),
    "doctor": (),
    "regress": ("--output", "{tmp}/out"),
    "run": (),
    "": (),
}


@dataclass(frozen=True)
class Case:
    """One bad input."""

    id: str
    """Test id."""
    what: str
    """The input, in words (docs/usage.md)."""
    command: str
    """Subcommand (``""``: none, the arguments go to the ``memascend`` group)."""
    args: tuple[str, ...]
    """Arguments after the command's :data:`COMMON` flags; ``{tmp}`` is the case folder."""
    message: str
    """Text the one ``memascend: error:`` line contains."""
    exit_code: int = 2
    files: dict[str, bytes] = field(default_factory=dict)
    """Files written into the case folder first (relative path -> content)."""


def _safetensors(numel_by_name: dict[str, int]) -> bytes:
    """A valid ``.safetensors`` file of zero-filled fp32 tensors (8-byte header length, JSON header, data)."""
    header, offset = {}, 0
    for name, numel in numel_by_name.items():
        header[name] = {"dtype": "F32", "shape": [numel], "data_offsets": [offset, offset + 4 * numel]}
        offset += 4 * numel
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(offset)


_LLAMA_CONFIG = json.dumps({
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
    "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
    "max_position_embeddings": 64, "tie_word_embeddings": True,
}).encode()
_GPT2_CONFIG = json.dumps({
    "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 64, "n_embd": 16, "n_layer": 1,
    "n_head": 2, "n_positions": 64,
}).encode()
_T5_CONFIG = json.dumps({
    "model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "vocab_size": 64, "d_model": 16,
    "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2,
}).encode()
_WEIGHTS = _safetensors({"model.embed_tokens.weight": 64 * 16, "model.norm.weight": 16})

CASES: tuple[Case, ...] = (
    # ---- numbers: non-finite, out of range (items 3, 4, 7, 11) ----
    Case("lr-nan", "learning rate NaN", "finetune", ("--lr", "nan"), "--lr: Input should be a finite number, got nan"),
    Case("lr-inf", "learning rate infinite", "finetune", ("--lr", "inf"), "--lr: Input should be a finite number, got inf"),
    Case("lr-zero", "learning rate 0", "finetune", ("--lr", "0"), "--lr must be positive, got 0.0"),
    Case("epochs-nan", "epochs NaN", "finetune", ("--epochs", "nan"), "--epochs: Input should be a finite number, got nan"),
    Case("epochs-inf", "epochs infinite", "finetune", ("--epochs", "inf"), "--epochs: Input should be a finite number, got inf"),
    Case("epochs-huge", "epochs absurdly large (a run for ever)", "finetune", ("--epochs", "1e30"),
         "--epochs must be at most 1,000,000, got 1e+30"),
    Case("steps-zero", "no steps", "finetune", ("--steps", "0"), "--steps must be >= 1 (or give --epochs)"),
    Case("steps-huge", "steps absurdly large", "finetune", ("--steps", "100000000000"),
         "--steps must be at most 10,000,000, got 100,000,000,000"),
    Case("warmup-negative", "negative warm-up", "finetune", ("--warmup-steps", "-1"),
         "--warmup-steps ([train] warmup_steps) must be >= 0, got -1"),
    Case("loss-chunk-tokens-zero", "no tokens per loss chunk", "finetune", ("--loss-chunk-tokens", "0"),
         "--loss-chunk-tokens must be >= 1 token, got 0"),
    Case("max-grad-norm-negative", "negative gradient clip", "finetune", ("--max-grad-norm", "-1"),
         "--max-grad-norm ([train] gradient_clipping) must be >= 0, got -1.0"),
    Case("lr-scheduler-unknown", "unknown --lr-scheduler", "finetune", ("--lr-scheduler", "exponential"),
         "Invalid value for '--lr-scheduler': 'exponential' is not one of 'constant', 'linear', 'cosine'."),
    Case("lr-scheduler-and-ds-scheduler", "--lr-scheduler and a \"scheduler\" in --deepspeed-config", "finetune",
         ("--lr-scheduler", "cosine", "--deepspeed-config", "{tmp}/ds.json"),
         "both set the learning-rate schedule: remove one of them",
         files={"ds.json": b'{"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}\n'}),
    Case("eval-every-negative", "negative --eval-every", "finetune", ("--eval-every", "-1"),
         "--eval-every ([train] eval_every) must be >= 0, got -1"),
    Case("eval-every-no-eval-blocks", "--eval-every without held-out blocks", "finetune",
         ("--eval-every", "2", "--eval-blocks", "0"), "--eval-every 2 needs held-out blocks, but --eval-blocks is 0"),
    Case("seed-negative", "negative seed", "finetune", ("--seed", "-1"), "--seed must be between 0 and 4294967295, got -1"),
    Case("nproc-zero", "zero ranks", "finetune", ("--nproc", "0"), "--nproc must be at least 1, got 0"),
    Case("nproc-negative", "negative ranks", "finetune", ("--nproc", "-2"), "--nproc must be at least 1, got -2"),
    Case("from-scratch-inf", "infinite model width", "finetune", ("--from-scratch", "hidden=inf,layers=2,heads=4"),
         "--from-scratch: value of 'hidden' is not a finite number: 'inf'"),
    Case("from-scratch-tie-not-bool", "tie_word_embeddings neither true nor false", "finetune",
         ("--from-scratch", "hidden=64,layers=2,heads=4,tie_word_embeddings=maybe"),
         "--from-scratch: value of 'tie_word_embeddings' must be true or false, got 'maybe'"),
    Case("from-scratch-unknown-arch", "a from-scratch architecture memascend does not build", "finetune",
         ("--from-scratch", "arch=bert,hidden=64,layers=2,heads=4"),
         "from-scratch model: unknown arch 'bert' (known: llama, mistral, qwen2, gpt_neox, phi, gpt2)"),
    Case("from-scratch-neox-kv-heads", "grouped-query attention on an architecture without it", "finetune",
         ("--from-scratch", "arch=gpt_neox,hidden=64,layers=2,heads=4,kv_heads=2"),
         "from-scratch model: arch gpt_neox has no grouped-query attention: num_kv_heads 2 must equal num_heads 4"),
    Case("from-scratch-dropout-range", "dropout of 1 or more", "finetune",
         ("--from-scratch", "arch=phi,hidden=64,layers=2,heads=4,dropout=1"),
         "from-scratch model: dropout must be in [0, 1), got 1.0"),
    Case("toml-nan", "NaN in a --config TOML field", "finetune", ("--config", "{tmp}/run.toml"),
         "run.toml: train.lr: Input should be a finite number, got nan", files={"run.toml": b"[train]\nlr = nan\n"}),
    Case("toml-inf-no-flag", "inf in a --config field", "finetune", ("--config", "{tmp}/run.toml"),
         "run.toml: train.weight_decay: Input should be a finite number, got inf",
         files={"run.toml": b"[train]\nweight_decay = inf\n"}),
    Case("toml-lr-string", "a number written as a string (TOML)", "finetune", ("--config", "{tmp}/run.toml"),
         "run.toml: train.lr: Input should be a valid number, got '1e-4'", files={"run.toml": b"[train]\nlr = \"1e-4\"\n"}),
    Case("toml-fraction-for-int", "a fraction where a whole number goes (TOML)", "finetune",
         ("--config", "{tmp}/run.toml"), "run.toml: train.micro_batch: Input should be a valid integer, got 2.5",
         files={"run.toml": b"[train]\nmicro_batch = 2.5\n"}),
    Case("toml-unknown-key", "an unknown key in a --config section", "finetune", ("--config", "{tmp}/run.toml"),
         "run.toml: train.learning_rate: Unexpected keyword argument", files={"run.toml": b"[train]\nlearning_rate = 1\n"}),
    Case("yaml-wrong-type", "a string where a whole number goes (YAML)", "finetune", ("--config", "{tmp}/run.yaml"),
         "run.yaml: train.seed: Input should be a valid integer, got 'random'",
         files={"run.yaml": b"train:\n  seed: random\n"}),
    Case("yaml-syntax", "a --config YAML file that does not parse", "finetune", ("--config", "{tmp}/run.yaml"),
         "run.yaml is not valid YAML", files={"run.yaml": b"train: [1\n"}),
    Case("yaml-alias-bomb", "a --config YAML alias bomb (9 anchors, each 9 aliases of the one before)", "finetune",
         ("--config", "{tmp}/bomb.yaml"), "bomb.yaml is refused: its aliases expand to more than 10,000 values",
         files={"bomb.yaml": ("model:\n  from_scratch: [&a0 [" + ", ".join(["lol"] * 9) + "], "
                              + ", ".join(f"&a{i + 1} [" + ", ".join([f"*a{i}"] * 9) + "]" for i in range(8))
                              + "]\n").encode()}),
    Case("toml-wrong-type", "a string where a number goes (TOML)", "finetune", ("--config", "{tmp}/run.toml"),
         "run.toml: train.micro_batch: Input should be a valid integer, got 'two'",
         files={"run.toml": b"[train]\nmicro_batch = \"two\"\n"}),
    Case("toml-not-a-table", "a TOML section that is not a table", "finetune", ("--config", "{tmp}/run.toml"),
         "[train] must be a table, got 5", files={"run.toml": b"train = 5\n"}),
    Case("config-missing", "--config file missing", "finetune", ("--config", "/nonexistent.toml"),
         "config file not found: /nonexistent.toml"),
    Case("ds-config-list", "--deepspeed-config holding [1,2,3]", "finetune", ("--deepspeed-config", "{tmp}/ds.json"),
         "ds.json must be a JSON object ({...}), got a list", files={"ds.json": b"[1, 2, 3]\n"}),
    Case("ds-config-nan", "NaN in --deepspeed-config", "finetune", ("--deepspeed-config", "{tmp}/ds.json"),
         "ds.json holds NaN: every number must be finite", files={"ds.json": b'{"gradient_clipping": NaN}\n'}),
    Case("ds-config-lr-conflict", "--lr and --deepspeed-config's optimizer.params.lr disagree", "finetune",
         ("--lr", "1e-4", "--deepspeed-config", "{tmp}/ds.json"),
         "--lr 0.0001 disagrees with --deepspeed-config",
         files={"ds.json": b'{"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}\n'}),
    Case("ds-config-nvme-path-conflict", "--nvme-path and the DeepSpeed JSON's nvme_path disagree", "finetune",
         ("--deepspeed-config", "{tmp}/ds.json"),
         "zero_optimization.offload_param.nvme_path = /elsewhere (give one of them)",
         files={"ds.json": b'{"zero_optimization": {"offload_param": {"nvme_path": "/elsewhere"}}}\n'}),
    Case("ds-config-micro-batch-conflict", "--config's micro_batch and the DeepSpeed JSON's disagree", "plan",
         ("--config", "{tmp}/run.toml", "--deepspeed-config", "{tmp}/ds.json"),
         "run.toml: train.micro_batch 2 disagrees with --deepspeed-config",
         files={"run.toml": b"[train]\nmicro_batch = 2\n", "ds.json": b'{"train_micro_batch_size_per_gpu": 8}\n'}),
    Case("output-not-empty", "--output holding files (no --overwrite-output, no --resume)", "finetune",
         ("--output", "{tmp}/full"), "full is not empty (notes.txt): give --overwrite-output",
         files={"full/notes.txt": b"mine\n"}),
    Case("overwrite-output-holds-the-model", "--overwrite-output where --model lies in the output's model/ "
         "(the run would remove what it reads)", "finetune",
         ("--model", "{tmp}/om/model", "--output", "{tmp}/om", "--overwrite-output"),
         "om/model lies in the run's output",
         files={"om/model/config.json": _LLAMA_CONFIG, "om/model/model.safetensors": b"weights",
                "om/report.json": b"{}\n"}),
    Case("overwrite-output-holds-the-data", "--overwrite-output where --data is the earlier run's steps.jsonl",
         "finetune", ("--from-scratch", "llama-tiny", "--data", "{tmp}/om/steps.jsonl", "--output", "{tmp}/om",
                      "--overwrite-output"),
         "om/steps.jsonl lies in the run's output",
         files={"om/steps.jsonl": b'{"text": "a few words of text"}\n' * 200}),
    Case("ds-config-syntax", "--deepspeed-config not JSON", "finetune", ("--deepspeed-config", "{tmp}/ds.json"),
         "ds.json is not valid JSON: line 1", files={"ds.json": b"{oops\n"}),
    Case("ds-config-train-batch-size", "--deepspeed-config train_batch_size not micro-batch x grad-accum x ranks",
         "finetune", ("--deepspeed-config", "{tmp}/ds.json"),
         "ds.json: train_batch_size 3 is not a multiple of micro-batch 4 x grad-accum 1 = 4",
         files={"ds.json": b'{"train_batch_size": 3}\n'}),
    Case("host-memory-budget-below-smallest", "--host-memory-budget below what any setting of the model fits",
         "finetune", ("--from-scratch", "llama-3b", "--micro-batch", "1", "--host-memory-budget", "1GiB"),
         "--host-memory-budget 1GiB is below the smallest workable budget"),
    Case("host-memory-budget-not-a-size", "--host-memory-budget that is not a size", "finetune",
         ("--host-memory-budget", "lots"), "Invalid value for '--host-memory-budget': not a memory size: 'lots'"),
    Case("ds-config-host-memory-budget", "host_memory_budget in the DeepSpeed JSON that is not a size", "plan",
         ("--deepspeed-config", "{tmp}/ds.json"), "memascend setting host_memory_budget: not a memory size: '4 apples'",
         files={"ds.json": b'{"memascend": {"host_memory_budget": "4 apples"}}\n'}),
    Case("ds-config-param-pool-bytes", "param_pool_bytes in the DeepSpeed JSON below one byte", "plan",
         ("--deepspeed-config", "{tmp}/ds.json"), "memascend setting param_pool_bytes must be an integer >= 1",
         files={"ds.json": b'{"memascend": {"param_pool_bytes": 0}}\n'}),
    # ---- usage errors of the command line itself (click) ----
    Case("dtype-choice", "unknown --dtype", "finetune", ("--dtype", "int8"),
         "Invalid value for '--dtype': 'int8' is not one of 'bf16', 'fp16', 'fp32'."),
    Case("int-not-a-number", "a word where an integer goes", "finetune", ("--steps", "ten"),
         "Invalid value for '--steps': 'ten' is not a valid integer."),
    Case("unknown-option", "unknown option", "finetune", ("--learning-rate", "1e-4"), "No such option '--learning-rate'"),
    Case("missing-value", "option without its value", "finetune", ("--seq-len",), "Option '--seq-len' requires an argument."),
    Case("unknown-command", "unknown command", "", ("train",), "No such command 'train'."),
    Case("doctor-size", "doctor: a size that is not one", "doctor", ("--lock-bytes", "lots"),
         "Invalid value for '--lock-bytes': not a memory size: 'lots' (e.g. 16GiB, 300MiB)"),
    Case("doctor-size-overflow", "doctor: a size past float range", "doctor", ("--nvme-bytes", "9" * 400),
         "is too large"),
    Case("plan-cap-nan", "plan: --cap-gib NaN", "plan", ("--cap-gib", "nan"),
         "Invalid value for '--cap-gib': must be a finite number greater than 0, got nan"),
    Case("plan-data-missing", "plan --data: a path that does not exist", "plan",
         ("--from-scratch", "llama-tiny", "--data", "{tmp}/missing.jsonl"),
         "missing.jsonl (plan reads no data, but finetune would stop here)"),
    Case("plan-run-only-flag", "plan with a flag that only matters in a run", "plan",
         ("--from-scratch", "llama-tiny", "--nvme-overwrite"), "No such option '--nvme-overwrite'"),
    Case("plan-nproc-zero", "plan: zero ranks", "plan", ("--nproc", "0"), "--nproc must be at least 1, got 0"),
    Case("regress-timeout-inf", "regress: --timeout infinite", "regress", ("--timeout", "inf"),
         "Invalid value for '--timeout': must be a finite number greater than 0, got inf"),
    Case("regress-cap-overflow", "regress: --memory-cap past float range", "regress", ("--memory-cap", "1e999"),
         "not a memory size: '1e999'"),
    Case("run-no-command", "run without a command", "run", (), "Missing argument 'COMMAND...'"),
    Case("run-command-not-found", "run: a program that is not on PATH", "run", ("--", "no-such-trainer", "cfg.yaml"),
         "command not found: no-such-trainer (give a program on PATH or a path to one)"),
    # ---- paths, models, data (items 4, 7, 9) ----
    Case("model-missing", "--model path missing", "finetune", ("--model", "/nonexistent/model"),
         "model not found: /nonexistent/model"),
    Case("model-t5", "--model: a T5 folder (no causal-LM head)", "finetune", ("--model", "{tmp}/t5"),
         "is a 't5' model, an architecture without a causal-LM head", files={"t5/config.json": _T5_CONFIG}),
    Case("plan-model-t5", "plan --model: a T5 folder", "plan", ("--model", "{tmp}/t5"),
         "is a 't5' model, an architecture without a causal-LM head", files={"t5/config.json": _T5_CONFIG}),
    Case("model-truncated", "--model: model.safetensors cut short", "finetune", ("--model", "{tmp}/llama"),
         "model.safetensors are truncated or damaged",
         files={"llama/config.json": _LLAMA_CONFIG, "llama/model.safetensors": _WEIGHTS[: len(_WEIGHTS) // 2]}),
    Case("model-bad-config", "--model: config.json not JSON", "finetune", ("--model", "{tmp}/broken"),
         "config.json is not valid JSON", files={"broken/config.json": b"{\"model_type\": \n"}),
    Case("model-no-tokenizer", "--model: folder without tokenizer files", "finetune", ("--model", "{tmp}/gpt2"),
         "has no tokenizer: none of tokenizer.json",
         files={"gpt2/config.json": _GPT2_CONFIG, "gpt2/model.safetensors": _safetensors({"wte.weight": 64 * 16})}),
    Case("seq-len-over-limit", "--seq-len beyond the model's positions", "finetune",
         ("--from-scratch", "llama-tiny", "--seq-len", "100000"), "--seq-len 100000 exceeds the model's limit of 8192"),
    Case("data-missing", "--data path missing", "finetune", ("--data", "/nonexistent/data.jsonl"),
         "data not found: /nonexistent/data.jsonl"),
    Case("jsonl-malformed", "--data: a malformed JSONL line", "finetune", ("--data", "{tmp}/d.jsonl"),
         "d.jsonl:2: malformed JSON", files={"d.jsonl": b'{"text": "fine"}\n{"text": oops}\n'}),
    Case("jsonl-not-utf8", "--data: a JSONL line that is not UTF-8", "finetune", ("--data", "{tmp}/latin1.jsonl"),
         "latin1.jsonl:2: not UTF-8 text (invalid continuation byte at byte 28 of the file)",
         files={"latin1.jsonl": b'{"text": "ok"}\n{"text": "caf\xe9 au lait"}\n'}),
    Case("text-not-utf8", "--data: a .txt file that is not UTF-8", "finetune", ("--data", "{tmp}/latin1.txt"),
         "latin1.txt: not UTF-8 text", files={"latin1.txt": b"caf\xe9 au lait\n"}),
    Case("data-over-max-data-bytes", "--data files holding more than --max-data-bytes", "finetune",
         ("--data", "{tmp}/small.txt,{tmp}/big.txt", "--max-data-bytes", "1KiB"),
         "big.txt: --data holds more than --max-data-bytes 1.00 KiB (1,024 bytes; [data] max_bytes in a --config file)",
         files={"small.txt": b"a few words of text\n" * 20, "big.txt": b"a few words of text\n" * 40}),
    # models by Hugging Face id, data through `datasets` (issue 23; tests/models, tests/data)
    Case("model-id-uncached", "--model: a Hugging Face id neither cached nor downloadable", "finetune",
         ("--model", "no-org/no-such-model"), "model not found: no-org/no-such-model"),
    Case("revision-local-model", "--revision for a model that is not a Hugging Face id", "finetune",
         ("--revision", "v1"), "--revision v1 applies to a Hugging Face model id (org/name), not to smollm2-135m"),
    Case("data-format-unknown", "unknown --data-format", "finetune", ("--data-format", "xml"),
         "Invalid value for '--data-format': 'xml' is not one of 'auto', 'text', 'chat', 'alpaca', 'sharegpt'."),
    Case("data-columns-malformed", "--data-columns not FIELD=COLUMN", "finetune", ("--data-columns", "body"),
         "--data-columns: 'body' is not FIELD=COLUMN"),
    Case("data-columns-unknown-field", "--data-columns: a field no format has", "finetune",
         ("--data", "{tmp}/qa.csv", "--data-columns", "question=q"), "--data-columns: unknown field 'question'",
         files={"qa.csv": b"q,a\nWhat?,That.\n"}),
    Case("data-column-missing", "--data-format alpaca on a file without its columns", "finetune",
         ("--data", "{tmp}/qa.csv", "--data-format", "alpaca"),
         "qa.csv: --data-format alpaca needs a column 'instruction' (columns: q, a; map one with --data-columns "
         "instruction=COLUMN)", files={"qa.csv": b"q,a\nWhat?,That.\n"}),
    Case("data-columns-no-such-column", "--data-columns naming a column no row of a .jsonl has (chat rows)",
         "finetune", ("--from-scratch", "llama-tiny", "--data", "{tmp}/d.jsonl", "--data-columns", "text=nope"),
         "d.jsonl: --data-columns text=nope: no row has a column 'nope'",
         files={"d.jsonl": b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'}),
    Case("data-row-wrong-type", "--data: a .json row whose value has the wrong type", "finetune",
         ("--data", "{tmp}/alpaca.json"), "alpaca.json row 2: 'output' must be a string, got int",
         files={"alpaca.json": b'[{"instruction": "a", "output": "b"}, {"instruction": "c", "output": 5}]\n'}),
    Case("sharegpt-bad-role", "--data: a sharegpt turn from an unknown speaker", "finetune",
         ("--data", "{tmp}/d.jsonl"), "d.jsonl:1: conversations message 2: 'from' must be one of human, user, gpt",
         files={"d.jsonl": b'{"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}]}\n'}),
    Case("lora-target-no-module", "--lora-target-modules naming no module of the model", "finetune",
         ("--from-scratch", "llama-tiny", "--data", "{tmp}/small.txt", "--lora-rank", "4",
          "--lora-target-modules", "nope_proj"), "--lora-target-modules nope_proj: no such module in smollm2-135m",
         files={"small.txt": b"a few words of text\n" * 400}),
    Case("lora-rank-zero", "--lora-rank 0", "finetune", ("--lora-rank", "0"),
         "--lora-rank ([lora] rank) must be at least 1, got 0"),
    Case("lora-rank-above-width", "--lora-rank above the width of a targeted layer", "finetune",
         ("--from-scratch", "llama-tiny", "--data", "{tmp}/small.txt", "--lora-rank", "65"),
         "--lora-rank 65 is above the width of model.layers.0.self_attn.q_proj in smollm2-135m (64 -> 64)",
         files={"small.txt": b"a few words of text\n" * 400}),
    Case("nvme-path-unwritable", "--nvme-path that cannot be created", "finetune",
         ("--from-scratch", "llama-tiny", "--data", "{tmp}/small.txt", "--nvme-path", "/proc/memascend-swap"),
         "cannot create --nvme-path /proc/memascend-swap", files={"small.txt": b"a few words of text\n" * 400}),
    # checkpoints (memascend/train/checkpoints.py; runs in tests/faults/test_checkpoint_faults.py)
    Case("checkpoint-every-zero", "--checkpoint-every 0", "finetune", ("--checkpoint-every", "0"),
         "--checkpoint-every must be >= 1 step, got 0"),
    Case("checkpoint-minutes-nan", "--checkpoint-every-minutes NaN", "finetune", ("--checkpoint-every-minutes", "nan"),
         "--checkpoint-every-minutes: Input should be a finite number, got nan"),
    Case("keep-checkpoints-zero", "--keep-checkpoints 0", "finetune", ("--keep-checkpoints", "0"),
         "--keep-checkpoints must be >= 1, got 0"),
    Case("save-checkpoint-unwritable", "--save-checkpoint where nothing can be written", "finetune",
         ("--from-scratch", "llama-tiny", "--data", "{tmp}/small.txt", "--save-checkpoint", "/proc/memascend-ck"),
         "--save-checkpoint /proc/memascend-ck is not writable", files={"small.txt": b"a few words of text\n" * 400}),
    Case("save-checkpoint-foreign-tag", "--save-checkpoint holding a global_step<N> without a manifest where the run "
         "saves", "finetune", ("--from-scratch", "llama-tiny", "--data", "{tmp}/small.txt", "--save-checkpoint",
                               "{tmp}/ck"),
         "global_step1 exists and is not a memascend checkpoint (no memascend_checkpoint.json)",
         files={"small.txt": b"a few words of text\n" * 400, "ck/global_step1/mp_rank_00_model_states.pt": b"other"}),
    Case("resume-incomplete", "--resume of a checkpoint whose save never finished (no manifest)", "finetune",
         ("--from-scratch", "llama-tiny", "--data", "{tmp}/small.txt", "--resume", "{tmp}/ck"),
         "global_step2 is incomplete: no memascend_checkpoint.json",
         files={"small.txt": b"a few words of text\n" * 400, "ck/latest": b"global_step2",
                "ck/global_step2/mp_rank_00_model_states.pt": b"half"}),
    Case("resume-other-model", "--resume of a checkpoint of another model", "finetune",
         ("--from-scratch", "llama-tiny", "--data", "{tmp}/small.txt", "--resume", "{tmp}/ck"),
         "was saved for a different model: parameter model.embed_tokens.weight [49152, 64] is not in the checkpoint",
         files={"small.txt": b"a few words of text\n" * 400, "ck/latest": b"global_step2",
                "ck/global_step2/memascend_checkpoint.json": json.dumps({
                    "format": 1, "complete": True, "step": 2, "dtype": "bf16", "world_size": 1,
                    "param_shapes": {"encoder.weight": [8, 8]}, "files": {}}).encode()}),
)


def argv(case: Case, tmp: Path) -> list[str]:
    """The full ``memascend`` argument list of a case run in folder ``tmp``."""
    words = [*([case.command] if case.command else []), *COMMON[case.command], *case.args]
    return [w.replace("{tmp}", str(tmp)) for w in words]


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def _shown(case: Case) -> str:
    """The command as docs/usage.md shows it: the case's own arguments (common flags elided)."""
    args = " ".join(a if len(a) <= 40 else a[:12] + "..." for a in case.args).replace("{tmp}/", "")
    common = " ..." if COMMON[case.command] else ""
    return f"`memascend {case.command}{common} {args}`".replace("  ", " ")


def exit_code_table() -> str:
    """Exit codes from :mod:`memascend.errors` (the classes) and the CLI's other codes."""
    from memascend import errors

    rows = [("0", "-", "success"),
            ("1", "-", "`memascend regress`: a regression or a failed run; `memascend doctor`: a check the run needs failed")]
    classes = sorted(
        (c for c in vars(errors).values()
         if isinstance(c, type) and issubclass(c, errors.MemascendError) and c is not errors.MemascendError),
        key=lambda c: c.exit_code,
    )
    for cls in classes:
        doc = " ".join((cls.__doc__ or "").split("\n\n")[0].split())
        rows.append((str(cls.exit_code), f"`{cls.__name__}`", doc))
    rows.append(("130", "-", "interrupted (Ctrl-C, SIGTERM); swap files and stores are removed"))
    rows.append(("128 + N", "-", "the training process was killed by signal N (137: SIGKILL, e.g. the OOM killer; 134: "
                 "SIGABRT); `memascend finetune` (memascend/train/supervisor.py) removed its swap files and marked "
                 "report.json `killed`; a full --nvme-path filesystem is exit 3 instead"))
    lines = ["| exit code | error class | meaning |", "|---|---|---|"]
    lines += [f"| {code} | {name} | {_md(doc)} |" for code, name, doc in rows]
    return "\n".join(lines)


def bad_input_table() -> str:
    """The bad-input table of docs/usage.md: one row per case."""
    lines = ["| input | command | `memascend: error:` line contains | exit code |", "|---|---|---|---|"]
    for c in CASES:
        lines.append(f"| {_md(c.what)} | {_md(_shown(c))} | {_md(c.message)} | {c.exit_code} |")
    return "\n".join(lines)


def readme_section() -> str:
    """Everything between the markers of docs/usage.md."""
    return (
        f"{BEGIN}\n"
        "<!-- generated by `python3 -m tests.cli.bad_input_cases --write-readme` from tests/cli/bad_input_cases.py "
        "and memascend/errors.py; do not edit by hand -->\n\n"
        f"{exit_code_table()}\n\n"
        "Bad input, each case run by `tests/cli/test_finetune_errors.py` (finetune cases also pass a tiny run's "
        "flags, shown as `...`; each asserts exactly this one line on stderr, the exit code, no traceback, and "
        "no file created, changed or deleted):\n\n"
        f"{bad_input_table()}\n"
        f"{END}"
    )


def readme_with_section(text: str) -> str:
    """``text`` (docs/usage.md) with its marked section replaced by :func:`readme_section`.

    Raises:
        ValueError: the markers are missing.
    """
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"docs/usage.md has no {BEGIN} ... {END} section")
    return text[:start] + readme_section() + text[end + len(END):]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write-readme", action="store_true", help="rewrite docs/usage.md's bad-input section")
    mode.add_argument("--check", action="store_true", help="exit 1 when docs/usage.md's section is out of date")
    opts = parser.parse_args()
    text = USAGE_DOC.read_text()
    new = readme_with_section(text)
    if opts.check:
        if new != text:
            print("docs/usage.md's bad-input table is out of date: run python3 -m tests.cli.bad_input_cases "
                  "--write-readme", file=sys.stderr)
            return 1
        return 0
    if new != text:
        USAGE_DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
