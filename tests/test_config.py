import pytest

from memascend.config import (
    FROM_SCRATCH_PRESETS,
    FromScratchConfig,
    build_run_config,
    load_config_file,
    parse_from_scratch,
)
from memascend.errors import UserError


def test_defaults_are_the_documented_main_job():
    cfg = build_run_config({}, {})
    assert cfg.model.name_or_path == "smollm2-135m"
    assert cfg.data.source == "shakespeare"
    assert (cfg.offload.param, cfg.offload.optimizer) == ("nvme", "nvme")
    assert cfg.train.dtype == "bf16" and cfg.train.micro_batch == 4 and cfg.data.seq_len == 256


def test_cli_overrides_file_and_none_means_not_given(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('engine = "baseline"\n[train]\nlr = 0.5\nsteps = 7\n[data]\nseq_len = 128\n')
    cfg = build_run_config(load_config_file(f), {"train": {"lr": 0.25, "steps": None}, "data": {"seq_len": None}})
    assert cfg.train.lr == 0.25 and cfg.train.steps == 7 and cfg.data.seq_len == 128


@pytest.mark.parametrize(
    "text, match",
    [
        ("train = 5\n", r"\[train\] must be a table, got 5"),
        ("nonsense = 1\n", "unknown key 'nonsense'"),
        ("[train\n", "not valid TOML"),
    ],
)
def test_bad_toml_is_a_user_error(tmp_path, text, match):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(UserError, match=match):
        load_config_file(f)


def test_an_unknown_key_in_a_section_names_the_file_and_key(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[train]\nbogus = 1\n")
    with pytest.raises(UserError, match=r"bad.toml: train.bogus: Unexpected keyword argument"):
        build_run_config(load_config_file(f), {}, file_name=f)


def test_yaml_config_is_read_like_toml(tmp_path):
    from memascend.config import load_config_file

    y = tmp_path / "run.yaml"
    y.write_text("engine: baseline\ntrain:\n  lr: 1e-4   # YAML 1.1 would read a string\n  steps: 7\n"
                 "data:\n  seq_len: 128\n")
    t = tmp_path / "run.toml"
    t.write_text('engine = "baseline"\n[train]\nlr = 1e-4\nsteps = 7\n[data]\nseq_len = 128\n')
    assert load_config_file(y) == load_config_file(t)
    assert build_run_config(load_config_file(y), {}).train.lr == 1e-4
    y.write_text("train:\n  lr: '1e-4'\n")
    with pytest.raises(UserError, match=r"run.yaml: train.lr: Input should be a valid number, got '1e-4'"):
        build_run_config(load_config_file(y), {}, file_name=y)
    for text, match in (("train: [1\n", "not valid YAML"), ("- 1\n", "must hold a table of sections"),
                        ("train: 5\n", r"\[train\] must be a table, got 5"), ("bogus: 1\n", "unknown key 'bogus'")):
        y.write_text(text)
        with pytest.raises(UserError, match=match):
            load_config_file(y)
    y.write_text("")
    assert load_config_file(y) == {}


def _alias_bomb(levels: int = 9) -> str:
    """YAML whose last anchor expands to 9**levels strings through ``levels`` anchors of 9 aliases each."""
    rows = ["[" + ", ".join(['"lol"'] * 9) + "]"]
    rows += ["[" + ", ".join([f"*a{i}"] * 9) + "]" for i in range(levels - 1)]
    return "[" + ", ".join(f"&a{i} {row}" for i, row in enumerate(rows)) + "]"


@pytest.mark.parametrize("key", ["train:\n  lr", "model:\n  from_scratch", "data:\n  columns"])
def test_yaml_alias_bomb_is_refused_while_loading(tmp_path, key):
    """Aliases are expanded into a value only up to a small number of values: a bomb is refused by
    the loader (fast, before any value is built), naming the file."""
    import time

    from memascend.config import load_config_file

    y = tmp_path / "bomb.yaml"
    y.write_text(f"{key}: {_alias_bomb()}\n")
    start = time.perf_counter()
    with pytest.raises(UserError, match=rf"^config file {y} is refused: its aliases expand to more than 10,000 values"):
        load_config_file(y)
    assert time.perf_counter() - start < 1.0
    y.write_text("train: &t\n  lr: &x [*x]\n")
    with pytest.raises(UserError, match="refers to a value that holds it"):
        load_config_file(y)


@pytest.mark.parametrize("name, text", [("deep.yaml", "train: " + "[" * 20000 + "]" * 20000 + "\n"),
                                        ("deep.toml", "[train]\nx = " + "[" * 20000 + "]" * 20000 + "\n")],
                         ids=["yaml", "toml"])
def test_a_config_nested_too_deeply_is_refused(tmp_path, name, text):
    from memascend.config import load_config_file

    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(UserError, match=rf"^config file {f} is refused: its values are nested too deeply$"):
        load_config_file(f)


def test_yaml_anchors_within_the_limit_still_work(tmp_path):
    from memascend.config import load_config_file

    y = tmp_path / "run.yaml"
    y.write_text("train:\n  lr: &lr 3e-4\n  weight_decay: *lr\ndata:\n  columns: &c {text: body}\n")
    cfg = build_run_config(load_config_file(y), {}, file_name=y)
    assert cfg.train.lr == cfg.train.weight_decay == 3e-4 and cfg.data.columns == {"text": "body"}


def test_max_data_bytes_is_a_byte_count_in_the_file_and_a_size_as_a_flag(tmp_path):
    from click.testing import CliRunner

    from memascend.cli.main import cli
    from memascend.config import DEFAULT_MAX_DATA_BYTES, load_config_file

    assert build_run_config({}, {}).data.max_bytes == DEFAULT_MAX_DATA_BYTES == 1 << 30
    t = tmp_path / "run.toml"
    t.write_text("[data]\nmax_bytes = 4294967296\n")
    assert build_run_config(load_config_file(t), {}, file_name=t).data.max_bytes == 4 << 30
    assert build_run_config(load_config_file(t), {"data": {"max_bytes": 5}}).data.max_bytes == 5
    for value, match in (('"4GiB"', "run.toml: data.max_bytes: Input should be a valid integer"),
                         ("0", r"--max-data-bytes \(\[data\] max_bytes\) must be at least 1 byte, got 0")):
        t.write_text(f"[data]\nmax_bytes = {value}\n")
        with pytest.raises(UserError, match=match):
            build_run_config(load_config_file(t), {}, file_name=t)
    res = CliRunner().invoke(cli, ["plan", "--from-scratch", "llama-tiny", "--max-data-bytes", "lots"])
    assert res.exit_code == 2 and "Invalid value for '--max-data-bytes': not a memory size: 'lots'" in res.output


def test_missing_toml_file():
    with pytest.raises(UserError, match="config file not found"):
        load_config_file("/nonexistent/run.toml")


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"train": {"micro_batch": 0}}, "micro-batch"),
        ({"train": {"lr": -1.0}}, "--lr"),
        ({"train": {"dtype": "fp8"}}, "--dtype"),
        ({"data": {"seq_len": 2}}, "--seq-len"),
        ({"offload": {"param": "disk"}}, "--offload-param"),
        ({"engine": "turbo"}, "--engine"),
    ],
)
def test_invalid_values_raise_user_error(overrides, match):
    with pytest.raises(UserError, match=match):
        build_run_config({}, overrides)


def test_from_scratch_specs():
    assert parse_from_scratch("llama-1b") is FROM_SCRATCH_PRESETS["llama-1b"]
    fs = parse_from_scratch("hidden=256,layers=4,heads=8,vocab=49152")
    assert (fs.hidden_size, fs.num_layers, fs.num_heads, fs.kv_heads) == (256, 4, 8, 8)
    with pytest.raises(UserError, match="not divisible"):
        parse_from_scratch("hidden=100,layers=2,heads=3")
    with pytest.raises(UserError, match="unknown preset"):
        parse_from_scratch("gpt-5")
    with pytest.raises(UserError, match="missing"):
        parse_from_scratch("hidden=64")


def test_from_scratch_untied_embeddings(tmp_path):
    """``tie_word_embeddings`` (default true): key=value, TOML and JSON; the untied count adds lm_head."""
    tied = parse_from_scratch("hidden=64,layers=2,heads=4")
    untied = parse_from_scratch("hidden=64,layers=2,heads=4,tie_word_embeddings=false")
    assert tied.tie_word_embeddings and not untied.tie_word_embeddings
    assert untied.param_numel - tied.param_numel == 49152 * 64
    assert parse_from_scratch("hidden=64,layers=2,heads=4,tie_word_embeddings=TRUE") == tied
    toml = tmp_path / "m.toml"
    toml.write_text("hidden = 64\nlayers = 2\nheads = 4\ntie_word_embeddings = false\n")
    jsn = tmp_path / "m.json"
    jsn.write_text('{"hidden": 64, "layers": 2, "heads": 4, "tie_word_embeddings": false}')
    assert parse_from_scratch(str(toml)) == parse_from_scratch(str(jsn)) == untied
    with pytest.raises(UserError, match="tie_word_embeddings' must be true or false, got 'maybe'"):
        parse_from_scratch("hidden=64,layers=2,heads=4,tie_word_embeddings=maybe")
    jsn.write_text('{"hidden": 64, "layers": 2, "heads": 4, "tie_word_embeddings": 0}')
    with pytest.raises(UserError, match="tie_word_embeddings"):
        parse_from_scratch(str(jsn))
    assert all(p.tie_word_embeddings for n, p in FROM_SCRATCH_PRESETS.items()
               if p.arch == "llama" and n not in ("llama-7b", "llama-70b"))


def test_llama2_shaped_presets():
    """llama-7b / llama-70b have Llama-2-7B/70B's shapes and parameter counts (untied lm_head)."""
    seven, seventy = FROM_SCRATCH_PRESETS["llama-7b"], FROM_SCRATCH_PRESETS["llama-70b"]
    assert (seven.hidden_size, seven.num_layers, seven.num_heads, seven.kv_heads, seven.mlp_size,
            seven.vocab_size, seven.tie_word_embeddings) == (4096, 32, 32, 32, 11008, 32000, False)
    assert (seventy.hidden_size, seventy.num_layers, seventy.num_heads, seventy.kv_heads, seventy.mlp_size,
            seventy.vocab_size, seventy.tie_word_embeddings) == (8192, 80, 64, 8, 28672, 32000, False)
    assert (seven.param_numel, seventy.param_numel) == (6_738_415_616, 68_976_648_192)


@pytest.mark.parametrize("name", sorted(FROM_SCRATCH_PRESETS))
def test_param_numel_matches_transformers(name):
    """The closed-form parameter count (used for NVMe space estimates) matches the real model."""
    import torch
    from transformers import AutoModelForCausalLM

    from memascend.models.loading import llama_config

    fs: FromScratchConfig = FROM_SCRATCH_PRESETS[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama_config(fs))
    assert sum(p.numel() for p in model.parameters()) == fs.param_numel


def test_to_dict_keeps_the_report_keys_and_round_trips(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"memascend": {"enable_param_pool": false}}')
    cfg = build_run_config({}, {"deepspeed_config": str(ds), "offload": {"nvme_path": str(tmp_path / "a.store")}})
    d = cfg.to_dict()
    assert set(d) == {"model", "data", "train", "offload", "lora", "output_dir", "engine", "deepspeed_config"}
    assert set(d["offload"]) == {"param", "optimizer", "nvme_path", "nvme_overwrite", "enable_crc"}
    assert d["offload"]["nvme_path"] == str(tmp_path / "a.store")
    assert build_run_config(d, {}) == cfg


def test_the_swap_target_is_classified_when_the_config_is_built(tmp_path):
    from pathlib import Path

    from memascend.config import SwapTarget
    from memascend.train.store_target import is_store_target

    def kind(path: str) -> str:
        return build_run_config({}, {"offload": {"nvme_path": path}}).offload.swap_target.kind

    assert kind(str(tmp_path)) == "folder" and kind(str(tmp_path / "s.store")) == "store_file"
    assert kind(f"{tmp_path}/a.store,{tmp_path}/b.store") == "store_list"
    block = next((str(p) for p in sorted(Path("/dev").glob("loop[0-9]*")) if p.is_block_device()), None)
    if block:
        assert kind(block) == "device"
    for path in (str(tmp_path), str(tmp_path / "s.store"), *([block] if block else [])):
        assert SwapTarget.of(path).is_raw_store == is_store_target(path)


def test_the_memascend_section_is_parsed_when_the_config_is_built(tmp_path):
    from memascend.config.settings import MemAscendSettings

    ds = tmp_path / "ds.json"
    ds.write_text('{"memascend": {"param_prefetch_slots": 8}, "gradient_clipping": 0.5}')
    cfg = build_run_config({}, {"deepspeed_config": str(ds)})
    assert cfg.memascend == MemAscendSettings(param_prefetch_slots=8)
    assert cfg.user_ds_config["gradient_clipping"] == 0.5
    assert build_run_config({}, {}).memascend == MemAscendSettings() and build_run_config({}, {}).user_ds_config is None
    ds.write_text('{"memascend": {"enable_everything": true}}')
    with pytest.raises(UserError, match="unknown key.*enable_everything"):
        build_run_config({}, {"deepspeed_config": str(ds)})
    ds.write_text('{"memascend": [1]}')
    with pytest.raises(UserError, match='"memascend" section must be a JSON object'):
        build_run_config({}, {"deepspeed_config": str(ds)})
    with pytest.raises(UserError, match="DeepSpeed config not found"):
        build_run_config({}, {"deepspeed_config": str(tmp_path / "missing.json")})


def test_activation_dram_bytes_is_a_size_or_zero():
    from memascend.config.settings import MemAscendSettings

    assert MemAscendSettings(activation_dram_bytes="2GiB").activation_dram_bytes == 2 << 30
    assert MemAscendSettings.from_mapping({"activation_dram_bytes": 0}).activation_dram_bytes == 0
    assert MemAscendSettings().activation_dram_bytes is None
    for bad in (-1, True, "lots", 1.5):
        with pytest.raises(UserError, match="activation_dram_bytes"):
            MemAscendSettings(activation_dram_bytes=bad)
