"""Matrix definitions: thresholds from the issue texts, identical runs except the engine."""

from __future__ import annotations

import dataclasses
import json

import pytest

from memascend.errors import UserError
from memascend.regress.matrix import MATRICES, BenchConfig, Matrix, get_matrix


def test_named_matrices_exist_and_smoke_is_smollm2_one_and_two_ranks():
    assert set(MATRICES) == {"smoke", "cpu-full", "gpu", "scaling", "ablation", "chunking", "speed", "lora",
                             "context"}
    smoke = get_matrix("smoke")
    assert {c.data for c in smoke.configs} == {"shakespeare", "chitchat"}
    assert {c.nproc for c in smoke.configs} == {1, 2}
    assert all(c.model == "smollm2-135m" and c.from_scratch is None for c in smoke.configs)


def test_issue3_thresholds_are_data():
    issue3 = get_matrix("cpu-full").select("smollm2-shakespeare-*-256x4")
    assert len(issue3) == 2
    for c in issue3:
        assert (c.thresholds.max_peak_rss_ratio, c.thresholds.max_peak_locked_ratio,
                c.thresholds.max_step_time_ratio, c.thresholds.bitwise_losses) == (0.40, 0.25, 1.05, True)
    # The smoke gate: bitwise losses and the locked bound stay; RSS and time are looser (see SMOKE_THRESHOLDS).
    for c in get_matrix("smoke").configs:
        assert c.thresholds.bitwise_losses and c.thresholds.max_peak_locked_ratio == 0.25
        assert c.thresholds.max_peak_rss_ratio <= 0.50 and c.thresholds.max_step_time_ratio <= 1.30
    one_b = next(c for c in get_matrix("cpu-full").configs if c.from_scratch == "llama-1b")
    assert one_b.thresholds.max_peak_rss_ratio == 0.45


def test_cpu_full_spans_models_and_sequence_lengths():
    full = get_matrix("cpu-full")
    assert {"llama-0.1b", "llama-1b", "llama-3b"} <= {c.from_scratch for c in full.configs}
    one_node = [c for c in full.configs if c.nnodes == 1]  # the two-node row has the smoke shape (2 x 128)
    assert min(c.seq_len for c in one_node) == 256 and max(c.seq_len for c in one_node) == 4096
    assert {c.dtype for c in get_matrix("gpu").configs} == {"bf16", "fp16"}


def test_cpu_full_has_the_small_gpt2_row_with_the_chunked_loss_in_both_engines():
    """The 16 M GPT-2 (dropout 0.1) at 2 x 256, bf16, held to the memory core's targets, with
    ``--loss-chunk-tokens 128`` given to both engines (so losses stay comparable bit for bit)."""
    from memascend.config import FROM_SCRATCH_PRESETS

    (row,) = get_matrix("cpu-full").select("gpt2-16m-*")
    assert (row.from_scratch, row.dtype, row.micro_batch, row.seq_len, row.loss_chunk_tokens) == (
        "gpt2-16m", "bf16", 2, 256, 128)
    assert FROM_SCRATCH_PRESETS[row.from_scratch].dropout == 0.1
    assert (row.thresholds.max_peak_rss_ratio, row.thresholds.max_peak_locked_ratio, row.thresholds.bitwise_losses) == (
        0.40, 0.25, True)
    args = {e: row.finetune_args(engine=e, output_dir="o", nvme_path="s") for e in ("baseline", "memascend")}
    assert all(a[a.index("--loss-chunk-tokens") + 1] == "128" for a in args.values())
    assert [(x, y) for x, y in zip(args["baseline"], args["memascend"], strict=True) if x != y] == [
        ("baseline", "memascend")]


def test_engines_get_identical_arguments_except_engine_and_output():
    cfg = get_matrix("smoke").configs[2]
    a = cfg.finetune_args(engine="baseline", output_dir="o/b", nvme_path="swap")
    b = cfg.finetune_args(engine="memascend", output_dir="o/m", nvme_path="swap")
    diff = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    assert diff == [("baseline", "memascend"), ("o/b", "o/m")]
    assert a[a.index("--nproc") + 1] == "2" and "--no-save-model" in a


def test_select_and_errors():
    smoke = get_matrix("smoke")
    assert [c.name for c in smoke.select("*-r2")] == ["smollm2-shakespeare-r2", "smollm2-chitchat-r2"]
    # several comma-separated patterns; the matrix's order is kept
    assert [c.name for c in smoke.select("*shakespeare-r2, smollm2-chitchat-r1")] == [
        "smollm2-chitchat-r1", "smollm2-shakespeare-r2"]
    with pytest.raises(UserError):
        smoke.select("nothing*")
    with pytest.raises(UserError):
        get_matrix("huge")
    with pytest.raises(ValueError):
        BenchConfig(name="x", steps=2)


def test_scaling_search_is_cpu_fulls_llama_series_in_ascending_size():
    scaling = get_matrix("scaling")
    assert scaling.capped_search and not get_matrix("cpu-full").capped_search
    assert [c.from_scratch for c in scaling.configs] == ["llama-tiny", "llama-0.1b", "llama-0.3b", "llama-0.5b",
                                                         "llama-1b", "llama-2b", "llama-3b"]
    sizes = [c.param_numel for c in scaling.configs]
    assert sizes == sorted(sizes) and sizes[0] < 5e6 and 2.7e9 < sizes[-1] < 2.8e9
    full = {c.name: c for c in get_matrix("cpu-full").configs}
    for c in scaling.configs:
        # the same runs as cpu-full's scaling series: bf16, 1 x 256, activation checkpointing, 3 steps, eval off
        kw = dict(engine="memascend", output_dir="o", nvme_path="s")
        assert c.finetune_args(**kw) == full[c.name].finetune_args(**kw)
        args = c.finetune_args(**kw)
        assert (c.dtype, c.micro_batch, c.seq_len, c.steps) == ("bf16", 1, 256, 3)
        assert "--activation-checkpointing" in args and "--no-save-model" in args
        assert args[args.index("--eval-blocks") + 1] == "0"
        # where both engines fit: bitwise losses, and memascend never above stock's memory
        assert c.thresholds.bitwise_losses and c.thresholds.max_peak_rss_ratio == 1.0
    with pytest.raises(ValueError, match="ascending"):
        Matrix(name="x", description="", configs=tuple(reversed(scaling.configs)), capped_search=True)


def test_context_search_grows_only_the_sequence_with_the_chunked_loss_on_both_engines():
    from memascend.config import FROM_SCRATCH_PRESETS, parse_from_scratch

    context = get_matrix("context")
    assert context.capped_search
    assert [c.seq_len for c in context.configs] == [1024, 2048, 4096, 8192, 16384, 32768]
    model = parse_from_scratch(context.configs[0].from_scratch)
    preset = FROM_SCRATCH_PRESETS["llama-0.1b"]
    assert model.param_numel == preset.param_numel and model.max_position_embeddings >= 32768
    assert (model.hidden_size, model.num_layers, model.kv_heads) == (preset.hidden_size, preset.num_layers,
                                                                     preset.kv_heads)
    for c in context.configs:
        base, ma = (c.finetune_args(engine=e, output_dir="o", nvme_path="s") for e in ("baseline", "memascend"))
        assert base[base.index("--loss-chunk-tokens") + 1] == ma[ma.index("--loss-chunk-tokens") + 1] == "256"
        assert [a for a in base if a != "baseline"] == [a for a in ma if a != "memascend"]
        assert (c.micro_batch, c.dtype) == (1, "bf16") and "--activation-checkpointing" in ma
        assert c.thresholds.bitwise_losses
    assert "--loss-chunk-tokens" not in get_matrix("smoke").configs[0].finetune_args(engine="memascend",
                                                                                      output_dir="o", nvme_path="s")


def test_ablation_passes_settings_to_the_memascend_run_only(tmp_path):
    from memascend.regress.matrix import get_matrix

    m = get_matrix("ablation")
    assert m.configs[0].memascend_settings == ()  # the defaults, as cpu-full runs them
    cfg = next(c for c in m.configs if c.name.endswith("-no-torch-thp"))
    out = tmp_path / cfg.name / "memascend.r2"
    args = cfg.finetune_args(engine="memascend", output_dir=str(out), nvme_path="/swap")
    path = tmp_path / cfg.name / "memascend-deepspeed.json"
    assert args[-2:] == ["--deepspeed-config", str(path)]
    assert "--deepspeed-config" not in cfg.finetune_args(engine="baseline", output_dir=str(out), nvme_path="/swap")
    cfg.write_deepspeed_json("memascend", str(out))
    assert json.loads(path.read_text()) == {"memascend": {"enable_torch_thp": False}}
    cfg.write_deepspeed_json("baseline", str(out))
    assert not (tmp_path / cfg.name / "baseline-deepspeed.json").exists()
    # Identical training configuration otherwise: only --engine and the settings file differ.
    base = cfg.finetune_args(engine="baseline", output_dir=str(out), nvme_path="/swap")
    assert [a for a in args if a not in ("memascend", "--deepspeed-config", str(path))] == \
        [a for a in base if a != "baseline"]


def test_chunking_runs_memascend_in_both_slots_the_reference_unchunked(tmp_path):
    """The chunked step's step-time target is against the unchunked step: the baseline slot runs
    ``--engine memascend`` with the chunked step and gradient streaming off; the memascend slot the
    defaults; the training arguments are otherwise identical."""
    from memascend.regress.matrix import UNCHUNKED_SETTINGS, BenchConfig, get_matrix

    m = get_matrix("chunking")
    assert {c.from_scratch for c in m.configs} == {None, "llama-1b"}
    for cfg in m.configs:
        assert cfg.reference_settings == UNCHUNKED_SETTINGS and cfg.thresholds.max_step_time_ratio == 1.15
        out = tmp_path / cfg.name / "baseline"
        ref = cfg.finetune_args(engine="baseline", output_dir=str(out), nvme_path="/swap")
        mine = cfg.finetune_args(engine="memascend", output_dir=str(out), nvme_path="/swap")
        assert ref[ref.index("--engine") + 1] == "memascend" == mine[mine.index("--engine") + 1]
        assert ref[-2:] == ["--deepspeed-config", str(tmp_path / cfg.name / "baseline-deepspeed.json")]
        assert "--deepspeed-config" not in mine and ref[:-2] == mine
        cfg.write_deepspeed_json("baseline", str(out))
        assert json.loads((tmp_path / cfg.name / "baseline-deepspeed.json").read_text()) == {
            "memascend": {"optimizer_chunk_numel": None, "enable_grad_streaming": False}}
    with pytest.raises(UserError):
        BenchConfig(name="x", reference_settings=(("no_such_setting", 1),))


def test_speed_pairs_stock_with_the_speed_targets():
    """Matrix ``speed``: same-run pairs against stock (no reference settings) with the default job,
    an untied family, two ranks and llama-1b; at the default budget step time <= 0.80x and RSS <=
    0.40x with no noise allowance; with stock's peak RSS as the budget step time <= 0.60x and swap
    bytes <= 0.30x; llama-1b's 4 GiB budget reported."""
    from memascend.regress.matrix import STOCK_DEFAULT_JOB_PEAK_RSS, get_matrix

    m = get_matrix("speed")
    by_name = {c.name: c for c in m.configs}
    assert by_name["smollm2-bf16-256x4-speed"].micro_batch == 4 and by_name["smollm2-bf16-256x4-speed"].seq_len == 256
    assert by_name["mistral-0.07b-bf16-256x2-speed"].from_scratch == "mistral-0.07b"
    assert by_name["smollm2-bf16-256x4-r2-speed"].nproc == 2
    for cfg in m.configs:
        assert cfg.reference_settings is None
        th = cfg.thresholds
        assert th.bitwise_losses
        budget = dict(cfg.memascend_settings).get("host_memory_budget")
        if budget is None:
            assert cfg.memascend_settings == ()
            assert (th.max_step_time_ratio, th.step_time_noise, th.max_peak_rss_ratio) == (0.80, 0.0, 0.40)
        elif budget == "auto":
            assert cfg.from_scratch == "llama-1b" and th.max_peak_rss_ratio is None
            assert (th.max_step_time_ratio, th.step_time_noise) == (0.70, 0.0)
        elif cfg.from_scratch == "llama-1b":
            assert budget == "4GiB" and th.max_peak_rss_ratio == 1.0
        else:
            assert budget == (STOCK_DEFAULT_JOB_PEAK_RSS if cfg.nproc == 1 else "12GiB")
            assert (th.max_step_time_ratio, th.step_time_noise, th.max_swap_bytes_ratio) == (0.60, 0.0, 0.30)
            assert by_name[cfg.name.replace("-budget", "")].memascend_settings == ()  # its default-budget twin


def test_deepspeed_settings_go_to_both_engines(tmp_path):
    from memascend.regress.matrix import BenchConfig, get_matrix

    cfg = next(c for c in get_matrix("cpu-full").configs if c.name == "llama-1b-bf16-256x1-sub-group-1e8")
    assert dict(cfg.deepspeed_settings)["zero_optimization.sub_group_size"] == 100_000_000
    # Each engine's own max_in_cpu: the baseline derives the model's size (stock crashes below it),
    # memascend's param_dram_numel "auto" drops the DRAM copy of a model this large.
    assert "zero_optimization.offload_param.max_in_cpu" not in dict(cfg.deepspeed_settings)
    assert cfg.memascend_settings == ()
    two = BenchConfig(name="x", deepspeed_settings=(("zero_optimization.sub_group_size", 7),
                                                    ("zero_optimization.reduce_bucket_size", 9)),
                      memascend_settings=(("enable_torch_thp", False),))
    for engine in ("baseline", "memascend"):
        out = tmp_path / "x" / engine
        args = two.finetune_args(engine=engine, output_dir=str(out), nvme_path="/swap")
        path = tmp_path / "x" / f"{engine}-deepspeed.json"
        assert args[-2:] == ["--deepspeed-config", str(path)]
        two.write_deepspeed_json(engine, str(out))
        doc = json.loads(path.read_text())
        assert doc["zero_optimization"] == {"sub_group_size": 7, "reduce_bucket_size": 9}
        assert ("memascend" in doc) == (engine == "memascend")


def test_a_bad_memascend_setting_is_refused_when_the_config_is_made():
    from memascend.errors import UserError
    from memascend.regress.matrix import BenchConfig

    with pytest.raises(UserError, match="no_such"):
        BenchConfig(name="x", memascend_settings=(("no_such", True),))


def test_gpu_rows_in_order_of_value_sized_for_one_device_call():
    gpu = get_matrix("gpu")
    assert [c.name for c in gpu.configs] == ["smollm2-shakespeare-bf16-256x4-auto", "llama-1b-bf16-2048x1-auto",
                                             "llama-1b-bf16-2048x1", "smollm2-shakespeare-bf16-256x4",
                                             "llama-3b-bf16-2048x1", "llama-0.1b-bf16-1024x8",
                                             "llama-0.1b-fp16-1024x8"]
    # CUDA: stock's own losses differ run to run without --deterministic, so every row has it
    assert all(c.deterministic for c in gpu.configs)
    smollm2_auto, one_b_auto, one_b, smollm2, three_b = gpu.configs[:5]
    # the auto rows: the lean rows' shape, the host's DRAM as the cache, the 0.70x step-time target
    for auto, lean in ((smollm2_auto, smollm2), (one_b_auto, one_b)):
        assert dataclasses.replace(auto, name=lean.name, thresholds=lean.thresholds, memascend_settings=()) == lean
        assert auto.memascend_settings == (("host_memory_budget", "auto"),)
        assert auto.thresholds.max_step_time_ratio == 0.70 and auto.thresholds.step_time_noise == 0.0
    for c, preset in ((one_b, "llama-1b"), (three_b, "llama-3b")):
        # NVMe-bound (>= 24 bytes/param per step): few steps, one 2048-token sequence, recomputed activations
        assert (c.from_scratch, c.dtype, c.seq_len, c.micro_batch, c.steps) == (preset, "bf16", 2048, 1, 3)
        assert c.activation_checkpointing and c.thresholds.max_peak_rss_ratio == 0.45
        assert (c.offload_param, c.offload_optimizer) == ("nvme", "nvme")
        assert c.reference_settings is None  # a pair against stock: stock fits a 125 GiB GPU host
    # the default job (4 x 256, SmolLM2-135M, Shakespeare): cpu-full's row plus --deterministic
    kw = dict(engine="memascend", output_dir="o", nvme_path="s")
    cpu_row = next(c for c in get_matrix("cpu-full").configs if c.name == smollm2.name)
    assert smollm2.finetune_args(**kw) == cpu_row.finetune_args(**kw) + ["--deterministic"]
    assert smollm2.thresholds == cpu_row.thresholds


def test_gpu_llama_0_1b_row_still_runs_the_h100_golden_command():
    from pathlib import Path

    golden = json.loads((Path(__file__).resolve().parents[2] / "baselines" / "nvidia-h100-80gb-hbm3-x1"
                         / "gpu.json").read_text())
    row = get_matrix("gpu").select("llama-0.1b-bf16-1024x8")[0]
    for engine in ("baseline", "memascend"):
        recorded = golden["commands"][row.name][engine].split()
        out = recorded[recorded.index("--output") + 1]
        swap = recorded[recorded.index("--nvme-path") + 1]
        assert recorded[4:] == row.finetune_args(engine=engine, output_dir=out, nvme_path=swap)


def test_the_lora_row_gives_both_engines_the_same_adapters():
    cfg, big = get_matrix("lora").configs
    assert big.lora == cfg.lora and big.from_scratch == "llama-0.5b"
    args = {e: cfg.finetune_args(engine=e, output_dir="o", nvme_path="n") for e in ("baseline", "memascend")}
    for engine_args in args.values():
        i = engine_args.index("--lora-rank")
        assert engine_args[i:i + 4] == ["--lora-rank", "16", "--lora-target-modules", "all-linear"]
    # the same command but for the engine and memascend's section, which swaps the activations
    ma = args["memascend"]
    ds = ma.index("--deepspeed-config")
    assert [a for a in args["baseline"] if a != "baseline"] == [a for a in ma[:ds] + ma[ds + 2:] if a != "memascend"]
    assert "--deepspeed-config" not in args["baseline"]
    assert cfg.deepspeed_json("memascend") == {"memascend": {"enable_activation_swap": True}}
    assert args["baseline"][args["baseline"].index("--loss-chunk-tokens") + 1] == "256"  # both engines
    assert cfg.thresholds.max_peak_rss_ratio == 0.40 and cfg.thresholds.max_peak_locked_ratio == 0.25
