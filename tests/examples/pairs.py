"""Framework pairs: one training command under ``memascend run`` and the same command without it.

A pair (:data:`PAIRS`) is a framework (TRL's ``SFTTrainer`` through ``examples/trl_sft.py``,
``llamafactory-cli train`` with an ``examples/llamafactory`` YAML, or axolotl's ``axolotl.cli.train``
under torchrun with an ``examples/axolotl`` YAML), full fine-tuning or LoRA, always
with ``examples/ds_zero3_nvme.json`` (ZeRO-3, parameters and optimizer state on NVMe, an empty
``"memascend"`` section; each engine gets its own swap folder). Both commands start at once, or
one after the other for axolotl (as tests/examples/launch.py measures them: peak ``VmHWM`` and
``VmLck`` over each process tree).

:func:`run_pair` runs a pair at any shape (the default-suite tests use a tiny model and one step);
:func:`measure` runs it at the measured shape (SmolLM2-135M, micro-batch 4 x up to 256 tokens, 3
steps; one rank, two for axolotl, whose single-rank path initialises NCCL) and returns the record
that the slow tests check (:func:`problems`) and that

    python3 -m tests.examples.pairs [NAME ...] [--out DIR] [--stock-first]

writes to ``DIR/NAME.json`` (default ``baselines/cpu-2c-24g/frameworks``; exit 1 when a record has
problems, after writing it). docs/usage.md renders the committed records (tools/readme_frameworks.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO
from tests.examples.frameworks import framework_python
from tests.examples.launch import EXAMPLES, result_line, run_measured

DS_CONFIG = EXAMPLES / "ds_zero3_nvme.json"
TRL_SCRIPT = EXAMPLES / "trl_sft.py"
LF = EXAMPLES / "llamafactory"
AXOLOTL = EXAMPLES / "axolotl"
TRL_MARKER = "TRL_SFT_RESULT"
AXOLOTL_MARKER = "AXOLOTL_RESULT"
AXOLOTL_RANKS = 2
"""axolotl's ranks: with one it calls ``deepspeed.comm.init_distributed(dist_backend="nccl")``."""
AXOLOTL_PLUGINS = ("examples.axolotl.cpu_host.UseCpuPlugin", "tests.examples.axolotl_result.ResultPlugin")
"""The example YAML's plugin and the harness's observer (tests/examples/axolotl_result.py), in both commands."""
OUT_DIR = REPO / "baselines" / "cpu-2c-24g" / "frameworks"
RSS_RATIO_MAX = 0.40
LOCKED_RATIO_MAX = 0.25
MEASURED_SHAPE = {"micro_batch": 4, "seq_len": 256, "steps": 3}
"""The measured runs: micro-batch (sequences), tokens per sequence (at most, for LLaMA-Factory), steps."""
ENGINES = ("memascend", "stock", "baseline")
"""The commands of a pair: under ``memascend run``, without it, and (two ranks) ``baseline``: under
``memascend run`` with the section of ``MemAscendSettings.baseline()`` (every optimization off, the
correctness fixes on), the losses memascend's must equal where stock DeepSpeed 0.19.8 loses unaligned
gradient reads (on two ranks; docs/configuration.md ``fix_unaligned_gradient_io``)."""
_WORDS = ("the of and to a in that is was he for it with as his on be at by this had not are but from or have an "
          "they which one you were her all she there would their we him been has when who will more no if out so "
          "said what up its about into than them can only other new some could time these two may then do first").split()


@dataclass(frozen=True)
class Pair:
    """One framework's command, full fine-tune or LoRA."""

    framework: str
    """A key of tests.examples.frameworks.FRAMEWORKS (its venv runs the command)."""
    lora_rank: int
    """0: every weight trained; else LoRA adapters of this rank on every linear layer."""

    @property
    def name(self) -> str:
        return f"{self.framework}-{'lora' if self.lora_rank else 'full'}"

    @property
    def engines(self) -> tuple[str, ...]:
        """:data:`ENGINES` this pair runs: ``baseline`` too where it runs on two ranks."""
        return ENGINES if self.framework == "axolotl" else ENGINES[:2]


PAIRS: dict[str, Pair] = {p.name: p for p in (Pair("trl", 0), Pair("trl", 8), Pair("llamafactory", 0),
                                                Pair("llamafactory", 8), Pair("axolotl", 0), Pair("axolotl", 8))}


def chat_jsonl(path: Path, rows: int = 64) -> Path:
    """``rows`` two-turn conversations of seeded random words, as ``{"messages": [...]}`` lines."""
    import random

    rng = random.Random(7)

    def sentence(lo: int, hi: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))

    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": sentence(8, 24)},
                                                     {"role": "assistant", "content": sentence(16, 48)}]}) + "\n"
                            for _ in range(rows)))
    return path


def _trl_command(pair: Pair, python: Path, work: Path, engine: str, model: Path, shape: dict) -> list[str]:
    data = work / "chat.jsonl"
    if not data.exists():
        chat_jsonl(data)
    command = [str(python), str(TRL_SCRIPT), "--model", str(model), "--data", str(data), "--deepspeed",
               str(DS_CONFIG), "--nvme-path", str(work / f"{engine}-swap"), "--output", str(work / engine),
               "--micro-batch", str(shape["micro_batch"]), "--seq-len", str(shape["seq_len"]),
               "--steps", str(shape["steps"])]
    return command + (["--lora-rank", str(pair.lora_rank)] if pair.lora_rank else [])


def _engine_ds_config(work: Path, engine: str) -> Path:
    """examples/ds_zero3_nvme.json with the engine's own swap folder (created) as both nvme_path values
    (``baseline``: the section of ``MemAscendSettings.baseline()``)."""
    import dataclasses

    from memascend.config import DS_CONFIG_SECTION, MemAscendSettings

    cfg = json.loads(DS_CONFIG.read_text())
    if engine == "baseline":
        cfg[DS_CONFIG_SECTION] = dataclasses.asdict(MemAscendSettings.baseline())
    swap = work / f"{engine}-swap"
    swap.mkdir(exist_ok=True)
    for key in ("offload_param", "offload_optimizer"):
        cfg["zero_optimization"][key]["nvme_path"] = str(swap)
    path = work / f"{engine}-ds.json"
    path.write_text(json.dumps(cfg))
    return path


def _lf_command(pair: Pair, python: Path, work: Path, engine: str, model: Path, shape: dict) -> list[str]:
    from memascend.train.dist import free_port

    _engine_ds_config(work, engine)
    yaml_file = LF / f"sft_{'lora' if pair.lora_rank else 'full'}_zero3_nvme.yaml"
    # one process without a launcher: DeepSpeed's rendezvous variables; use_cpu for bf16 on a CPU host
    return ["env", "DS_ACCELERATOR=cpu", "RANK=0", "WORLD_SIZE=1", "LOCAL_RANK=0", "MASTER_ADDR=127.0.0.1",
            f"MASTER_PORT={free_port()}", str(python.parent / "llamafactory-cli"), "train", str(yaml_file),
            f"model_name_or_path={model}", f"deepspeed={work / f'{engine}-ds.json'}", f"dataset_dir={LF}",
            "use_cpu=true", f"output_dir={work / engine}", f"max_steps={shape['steps']}",
            f"per_device_train_batch_size={shape['micro_batch']}", f"cutoff_len={shape['seq_len']}"]


def _axolotl_command(pair: Pair, python: Path, work: Path, engine: str, model: Path, shape: dict) -> list[str]:
    from memascend.train.dist import free_port

    yaml_file = AXOLOTL / f"sft_{'lora' if pair.lora_rank else 'full'}_zero3_nvme.yaml"
    # torchrun from the venv's Python; keys after the YAML override it (--key=value, axolotl's CLI)
    return ["env", "DS_ACCELERATOR=cpu", "AXOLOTL_DO_NOT_TRACK=1", "HF_HUB_OFFLINE=1", str(python), "-m",
            "torch.distributed.run", "--nproc-per-node", str(AXOLOTL_RANKS), "--master-port", str(free_port()), "-m",
            "axolotl.cli.train", str(yaml_file), f"--base_model={model}",
            f"--deepspeed={_engine_ds_config(work, engine)}", f"--output_dir={work / engine}",
            f"--dataset_prepared_path={work / f'{engine}-prepared'}", f"--max_steps={shape['steps']}",
            f"--micro_batch_size={shape['micro_batch']}", f"--sequence_len={shape['seq_len']}",
            f"--plugins={json.dumps(list(AXOLOTL_PLUGINS))}"]


_COMMANDS = {"trl": _trl_command, "llamafactory": _lf_command, "axolotl": _axolotl_command}
_MARKERS = {"trl": TRL_MARKER, "axolotl": AXOLOTL_MARKER}


def _losses(pair: Pair, work: Path, engine: str, log: str) -> tuple[list[float], dict]:
    """Per-step training losses (full precision) and, for TRL and axolotl, the result line."""
    if pair.framework in _MARKERS:
        result = result_line(log, _MARKERS[pair.framework]) or {}
        return result.get("losses", []), result
    state = work / engine / "trainer_state.json"
    history = json.loads(state.read_text())["log_history"] if state.is_file() else []
    return [entry["loss"] for entry in history if "loss" in entry], {}


def run_pair(name: str, work: Path, model: Path, *, shape: dict, python: Path, stock_first: bool = False,
             timeout_s: float = 1800, engines: tuple[str, ...] | None = None, one_at_a_time: bool = False) -> dict:
    """Run pair ``name`` (its engines at once, or one after the other) in ``work``.

    Args:
        name: a key of :data:`PAIRS`.
        work: an empty folder (data, swap folders, outputs, logs).
        model: a Hugging Face model folder with its tokenizer.
        shape: ``micro_batch``, ``seq_len`` (tokens) and ``steps``.
        python: the framework venv's Python.
        stock_first: start the stock command first (the order of the two processes).
        engines: the engines to run (the pair's, :attr:`Pair.engines`, by default; the default-suite
            smoke tests run one).
        one_at_a_time: start an engine's command when the one before has ended (each command's peaks
            are its own process tree's either way; this halves what the host must hold at once).

    Returns:
        Per engine (``"memascend"``, ``"stock"``, ``"baseline"``): ``command`` (argv), ``returncode``, ``log``,
        ``peak_rss_kib``, ``peak_locked_kib``, ``losses``, ``applied_lines`` (memascend's one stderr
        line) and ``result`` (TRL's or axolotl's result line, else ``{}``).
    """
    pair = PAIRS[name]
    make = _COMMANDS[pair.framework]
    engines = pair.engines if engines is None else engines
    commands = {engine: make(pair, python, work, engine, model, shape) for engine in engines}
    for engine in set(commands) - {"stock"}:
        commands[engine] = [sys.executable, "-m", "memascend", "run", "--", *commands[engine]]
    order = sorted(engines, key=("stock", "memascend", "baseline").index if stock_first else ENGINES.index)
    if one_at_a_time:
        runs = [run_measured([commands[e]], REPO, [work / f"{e}.log"], timeout_s)[0] for e in order]
    else:
        runs = run_measured([commands[e] for e in order], REPO, [work / f"{e}.log" for e in order], timeout_s)
    out = {}
    for engine, run in zip(order, runs, strict=True):
        losses, result = _losses(pair, work, engine, run["log"])
        out[engine] = {**run, "command": commands[engine], "losses": losses, "result": result,
                       "applied_lines": [ln for ln in run["log"].splitlines() if ln.startswith("memascend: applied")]}
    return out


def losses_match(losses: list[float], reference: list[float], rtol: float) -> bool:
    """Bit-equal per-step losses; with ``rtol`` > 0 the first bit-equal and each later one within
    ``rtol`` of the reference, relative (:data:`LOSS_RTOL`)."""
    if len(losses) != len(reference) or [x.hex() for x in losses[:1]] != [x.hex() for x in reference[:1]]:
        return False
    if not rtol:
        return [x.hex() for x in losses] == [x.hex() for x in reference]
    return all(abs(a - b) <= rtol * abs(b) for a, b in zip(losses, reference, strict=True))


def problems(record: dict) -> list[str]:
    """What a record (:func:`measure`) falls short in: failed runs, losses that differ from stock's (from
    ``baseline``'s where the record has one, and then the first step's loss from stock's), memascend not
    applied (or applied to stock), ratios above :data:`RSS_RATIO_MAX` / :data:`LOCKED_RATIO_MAX`."""
    out = []
    ma, stock = record["engines"]["memascend"], record["engines"]["stock"]
    for engine, run in record["engines"].items():
        if run["returncode"] != 0 or len(run["losses"]) != record["shape"]["steps"]:
            out.append(f"{engine}: exit {run['returncode']}, {len(run['losses'])} losses")
    same = record["engines"].get("baseline", stock)
    if not losses_match(ma["losses"], same["losses"], LOSS_RTOL.get(record["pair"], 0.0)):
        out.append(f"losses differ: {ma['losses']} vs {same['losses']}")
    if same is not stock and [x.hex() for x in ma["losses"][:1]] != [x.hex() for x in stock["losses"][:1]]:
        out.append(f"first losses differ: {ma['losses'][:1]} vs stock {stock['losses'][:1]}")
    applied = {engine: run["applied_lines"] for engine, run in record["engines"].items()}
    if applied != {engine: int(engine != "stock") for engine in applied}:
        out.append(f"applied lines: {', '.join(f'{e} {n}' for e, n in applied.items())}")
    if not record["peak_rss_ratio"] <= RSS_RATIO_MAX:
        out.append(f"peak RSS ratio {record['peak_rss_ratio']:.3f} > {RSS_RATIO_MAX}")
    if not record["peak_locked_ratio"] <= LOCKED_RATIO_MAX:
        out.append(f"locked ratio {record['peak_locked_ratio']:.3f} > {LOCKED_RATIO_MAX}")
    return out


LOSS_RTOL = {"axolotl-lora": 1e-4}
"""Pairs held to a relative tolerance after the first step instead of bit-equal losses: LoRA on two
ranks under DeepSpeed 0.19.8 varies run to run in stock itself (stock against stock, llama-tiny, 3
steps: the losses part at step 2, by up to 4e-6 relative; memascend against memascend alike)."""

LORA_RSS_GAP = ("with LoRA the stock run keeps no optimizer state for the frozen base: its peak is DeepSpeed's "
                "~1 GiB of locked parameter swap buffers over what the framework holds itself, and loading the "
                "pairs' fp32 SmolLM2 checkpoint maps its whole 513 MiB safetensors file on top of the framework's "
                "imports and data (525 MiB under TRL, 690 MiB under LLaMA-Factory, measured before DeepSpeed "
                "starts): a transient of 1.04-1.2 GiB, 0.43-0.46x of stock's peak, whatever the engine holds")


def check_slow(name: str, record: dict) -> None:
    """The slow tests' verdict on a record: every problem fails the test, except a LoRA pair's peak
    RSS ratio above :data:`RSS_RATIO_MAX`, which is an expected failure (:data:`LORA_RSS_GAP`)."""
    import pytest

    issues = problems(record)
    expected = [p for p in issues if PAIRS[name].lora_rank and p.startswith("peak RSS ratio")]
    assert issues == expected, issues
    if expected:
        pytest.xfail(f"{expected[0]}: {LORA_RSS_GAP}")


def _version(python: Path, package: str) -> str:
    out = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "absent"


def _portable(argv: list[str], subs: dict[str, str]) -> str:
    """``argv`` as one shell line, the run's folders written as ``$NAME``."""
    text = shlex.join(argv)
    for path, name in sorted(subs.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(path, name)
    return text


def measure(name: str, work: Path, *, stock_first: bool = False, one_at_a_time: bool | None = None) -> dict:
    """Pair ``name`` at :data:`MEASURED_SHAPE` on SmolLM2-135M (the venv built when absent): the
    record written by ``python3 -m tests.examples.pairs`` (commands with ``$WORK``, ``$MODEL``,
    ``$VENV``, ``$REPO`` for the run's folders; KiB peaks; losses and their ``float.hex``; ratios).
    ``one_at_a_time`` (:func:`run_pair`) defaults to true for axolotl, whose stock command's two
    ranks take about 12 GiB: with the memascend command beside it a 24 GiB host shared with other
    jobs runs out."""
    from memascend.config import ModelConfig
    from memascend.models.loading import resolve_model

    pair = PAIRS[name]
    python = framework_python(pair.framework, build=True)
    model = resolve_model(ModelConfig(name_or_path="smollm2-135m")).hf_dir
    if one_at_a_time is None:
        one_at_a_time = pair.framework == "axolotl"
    runs = run_pair(name, work, model, shape=MEASURED_SHAPE, python=python, stock_first=stock_first,
                    one_at_a_time=one_at_a_time)
    subs = {str(work): "$WORK", str(model): "$MODEL", str(python.parent.parent): "$VENV", str(REPO): "$REPO",
            sys.executable: "python3"}
    engines = {engine: {"command": _portable(run["command"], subs), "returncode": run["returncode"],
                        "peak_rss_kib": run["peak_rss_kib"], "peak_locked_kib": run["peak_locked_kib"],
                        "losses": run["losses"], "losses_hex": [x.hex() for x in run["losses"]],
                        "applied_lines": len(run["applied_lines"])}
               for engine, run in runs.items()}
    record = {
        "pair": name, "framework": pair.framework, "lora_rank": pair.lora_rank, "model": "SmolLM2-135M-Instruct",
        "shape": dict(MEASURED_SHAPE), "ranks": AXOLOTL_RANKS if pair.framework == "axolotl" else 1,
        "started_first": "stock" if stock_first else "memascend", "one_at_a_time": one_at_a_time,
        "versions": {p: _version(python, p) for p in (pair.framework,
                                                      "transformers", "peft", "deepspeed", "torch")},
        "engines": engines,
        "peak_rss_ratio": engines["memascend"]["peak_rss_kib"] / max(1, engines["stock"]["peak_rss_kib"]),
        "peak_locked_ratio": engines["memascend"]["peak_locked_kib"] / max(1, engines["stock"]["peak_locked_kib"]),
    }
    for engine, run in runs.items():
        if run["returncode"] != 0:
            record["engines"][engine]["log_tail"] = run["log"][-2000:]
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"pairs to measure: {', '.join(PAIRS)} (default: all)")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="folder for NAME.json")
    parser.add_argument("--stock-first", action="store_true", help="start the stock command first")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(PAIRS))
    if unknown:
        parser.error(f"unknown pair {', '.join(unknown)} (known: {', '.join(PAIRS)})")
    failed = 0
    for name in args.names or list(PAIRS):
        with tempfile.TemporaryDirectory(prefix=f"pair-{name}-") as work:
            record = measure(name, Path(work), stock_first=args.stock_first)
        issues = problems(record)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"{name}: peak RSS {record['peak_rss_ratio']:.3f}x, locked {record['peak_locked_ratio']:.3f}x; "
              + ("; ".join(issues) if issues else "losses equal"), flush=True)
        failed += bool(issues)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
