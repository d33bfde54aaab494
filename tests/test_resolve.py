"""The one resolver (issue 20 item 3): :func:`memascend.config.render.resolve` gives the DeepSpeed JSON, the derived
settings and the seam settings of the three-stage pipeline it replaced (render -> ``"memascend"`` section ->
``prepare_ds_config``), and the planner, the preflight checks and ``memascend doctor`` report its estimates.

``tests/resolve_golden.json`` holds a digest (:func:`_digest`) of each case's result as the pipeline produced
it before the resolver existed, and the user JSONs of the cases. A change that means to alter a resolved
result records new digests (issue 21's settings did: ``optimizer_chunk_numel``, ``param_pool_bytes``,
``enable_grad_streaming``, ``host_memory_budget`` and the chunked sub-group size; then ``enable_chunk_prefetch``,
a new field of every settings object); the live comparison with
the three-stage pipeline above the digest check still has to hold.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from memascend.config import build_run_config
from memascend.config.render import (
    NVME_SPACE_MARGIN,
    ModelShape,
    nvme_swap_bytes,
    render_ds_config,
    resolve,
)
from memascend.config.settings import MemAscendSettings
from memascend.config.sizing import prepare_ds_config
from memascend.integrations import deepspeed as seam

GOLDEN = json.loads((Path(__file__).parent / "resolve_golden.json").read_text())
USERS: dict[str, dict | None] = GOLDEN["users"]
SHAPES = {"llama-tiny": {"model": {"from_scratch": "llama-tiny"}}, "smollm2": {},
          "llama-3b": {"model": {"from_scratch": "llama-3b"}}}
VARIANTS = {"bf16": {}, "fp16": {"train": {"dtype": "fp16"}},
            "fp32-cpu-param": {"train": {"dtype": "fp32"}, "offload": {"param": "cpu"}}}


def _cases():
    for shape in SHAPES:
        for user in USERS:
            for variant in VARIANTS:
                if variant != "bf16" and (shape == "llama-3b" or user == "sizes"):
                    continue
                for engine in ("memascend", "baseline"):
                    for world in (1, 2):
                        yield f"{shape}/{user}/{variant}/{engine}/{world}"


CASES = list(_cases())


@pytest.fixture(scope="module")
def shapes() -> dict[str, ModelShape]:
    from memascend.plan import model_dims

    out = {}
    for name, overrides in SHAPES.items():
        d = model_dims(build_run_config({}, overrides))
        out[name] = ModelShape(d.total_numel, d.param_numels, d.module_param_counts)
    return out


@pytest.fixture(scope="module")
def user_files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("ds")
    files = {}
    for name, doc in USERS.items():
        if doc is not None:
            files[name] = str(folder / f"{name}.json")
            Path(files[name]).write_text(json.dumps(doc))
    return files


def _config(case: str, user_files: dict[str, str]):
    shape, user, variant, engine, _world = case.split("/")
    overrides = {k: dict(v) for k, v in VARIANTS[variant].items()}
    for k, v in SHAPES[shape].items():
        overrides.setdefault(k, {}).update(v)
    overrides["engine"] = engine
    overrides["deepspeed_config"] = user_files.get(user)
    return build_run_config({}, overrides)


def _three_stages(cfg, shape: ModelShape, world: int, user: dict | None) -> tuple[dict, list[dict], MemAscendSettings]:
    """The pipeline as memascend finetune ran it before the resolver (train/runner.py)."""
    ds_cfg, derived = render_ds_config(cfg, shape, world, "/swap", user)
    settings = MemAscendSettings.from_mapping((user or {}).get("memascend", {}))
    if cfg.engine == "memascend":
        ds_cfg, settings = prepare_ds_config(ds_cfg, settings, param_numels=shape.param_numels, world_size=world)
    else:
        fixes = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name.startswith("fix_")}
        settings = dataclasses.replace(MemAscendSettings.baseline(), **fixes)
    return ds_cfg, [dataclasses.asdict(d) for d in derived], settings


def _digest(run) -> str:
    body = {"ds_config": run.ds_config, "derived": run.derived_dicts(), "settings": dataclasses.asdict(run.settings),
            "nvme_bytes_per_rank": run.nvme_bytes_per_rank, "upfront_locked_bytes": run.upfront_locked_bytes}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.parametrize("case", CASES)
def test_resolve_gives_what_the_three_stage_pipeline_gave(case, shapes, user_files):
    cfg = _config(case, user_files)
    shape, user, world = shapes[case.split("/")[0]], USERS[case.split("/")[1]], int(case.split("/")[-1])
    run = resolve(cfg, shape, world, "/swap")
    ds_cfg, derived, settings = _three_stages(cfg, shape, world, user)
    assert run.ds_config == ds_cfg
    assert run.derived_dicts() == derived
    assert run.settings == settings
    assert run.user_ds_config == user
    assert (run.micro_batch, run.grad_accum) == (ds_cfg["train_micro_batch_size_per_gpu"],
                                                 ds_cfg["gradient_accumulation_steps"])
    assert _digest(run) == GOLDEN["digests"][case], "differs from the pipeline before the resolver"


def test_every_golden_case_is_tested():
    assert set(CASES) == set(GOLDEN["digests"])


def test_the_swap_folder_can_come_later(shapes):
    cfg = build_run_config({}, {})
    later = resolve(cfg, shapes["smollm2"], 2).with_swap_dir("/swap/run-1")
    assert later == resolve(cfg, shapes["smollm2"], 2, "/swap/run-1")
    zero = resolve(cfg, shapes["smollm2"], 2).ds_config["zero_optimization"]
    assert zero["offload_param"]["nvme_path"] is None and zero["offload_optimizer"]["nvme_path"] is None
    cpu = build_run_config({}, {"offload": {"param": "cpu", "optimizer": "cpu"}})
    assert "nvme_path" not in resolve(cpu, shapes["smollm2"], 1).with_swap_dir("/swap").ds_config["zero_optimization"][
        "offload_param"]


def test_the_seam_api_is_the_resolver_path(shapes, monkeypatch):
    """``prepare_ds_config`` (the seam's public API) is what the resolver runs, not a copy of it."""
    import memascend.config.render as resolve_mod

    calls = []

    def spy(*args, **kwargs):
        calls.append(args)
        return prepare_ds_config(*args, **kwargs)

    monkeypatch.setattr(resolve_mod, "prepare_ds_config", spy)
    resolve(build_run_config({}, {}), shapes["llama-tiny"], 1)
    resolve(build_run_config({}, {"engine": "baseline"}), shapes["llama-tiny"], 1)
    assert len(calls) == 1
    assert seam.prepare_ds_config is prepare_ds_config and seam.MemAscendSettings is MemAscendSettings


def test_the_user_json_is_read_and_its_section_parsed_once(shapes, user_files, monkeypatch):
    from memascend.config import loader, schema, user_ds
    from memascend.plan import plan_run
    from memascend.plan.shapes import ModelDims

    reads = []
    real = user_ds.read_ds_config
    for module in (loader, schema):  # the two readers of --deepspeed-config
        monkeypatch.setattr(module, "read_ds_config", lambda path: reads.append(path) or real(path))
    cfg = build_run_config({}, {"deepspeed_config": user_files["section"], "model": {"from_scratch": "llama-tiny"}})
    assert cfg.memascend == MemAscendSettings.from_mapping(USERS["section"]["memascend"])
    assert cfg.user_ds_config == USERS["section"]
    shape = shapes["llama-tiny"]
    run = resolve(cfg, shape, 1)
    dims = ModelDims(shape.total_numel, shape.param_numels, shape.module_param_counts, 64, 2, 4, 49152)
    plan_run(cfg, 1, dims)
    resolve(dataclasses.replace(cfg, engine="baseline"), shape, 2)
    assert reads == [user_files["section"]]
    assert run.settings.enable_fused_overflow_check is False and run.settings.param_prefetch_slots == 8


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("engine", ["memascend", "baseline"])
@pytest.mark.parametrize("user", ["none", "sizes"])
def test_plan_preflight_and_the_swap_folder_use_the_resolvers_estimates(engine, world, user, shapes, user_files):
    from memascend.config.render import nvme_space_bytes, upfront_locked_bytes
    from memascend.plan import model_dims, plan_run
    from memascend.units import DTYPE_BYTES

    cfg = build_run_config({}, {"engine": engine, "deepspeed_config": user_files.get(user),
                                "model": {"from_scratch": "llama-tiny"}})
    shape = shapes["llama-tiny"]
    run = resolve(cfg, shape, world)
    plan = plan_run(cfg, world, model_dims(cfg))[engine]
    assert plan.preflight_nvme_bytes_per_rank == run.nvme_bytes_per_rank > 0
    assert plan.preflight_locked_bytes_per_rank == run.upfront_locked_bytes > 0
    assert plan.to_dict()["preflight_nvme_bytes_per_rank"] == run.nvme_bytes_per_rank
    # The preflight's requirement is the upper estimate (fp32 gradient files, every sub-group swapped)
    # with the margin; the planner's NVMe prediction is that formula for stock, and at most it for
    # memascend (gradient files in bf16, sub-groups too small to swap not on NVMe).
    upper = nvme_swap_bytes(shape.total_numel, 2, True, True)
    assert plan.nvme_bytes == upper if engine == "baseline" else 0 < plan.nvme_bytes <= upper
    assert int(upper * NVME_SPACE_MARGIN) // world == run.nvme_bytes_per_rank
    # What the run's preflight and swap folder check.
    assert upfront_locked_bytes(run.ds_config, "bf16", shape.largest_numel, world, engine) == run.upfront_locked_bytes
    assert nvme_space_bytes(shape.total_numel, DTYPE_BYTES["bf16"], True, True) // world == run.nvme_bytes_per_rank


def test_doctor_checks_what_the_builtin_run_resolves_to(shapes):
    from click.testing import CliRunner

    from memascend.cli.doctor import doctor
    from memascend.host import DoctorOptions
    from memascend.host.doctor import BUILTIN_LARGEST_PARAM_NUMEL, BUILTIN_MODEL_NUMEL, builtin_run
    from memascend.host.result import format_bytes

    real = resolve(build_run_config({}, {}), shapes["smollm2"], 1)  # the built-in model's own layout
    assert (shapes["smollm2"].total_numel, shapes["smollm2"].largest_numel) == (BUILTIN_MODEL_NUMEL,
                                                                                BUILTIN_LARGEST_PARAM_NUMEL)
    summary = builtin_run()
    assert (summary.nvme_bytes_per_rank, summary.upfront_locked_bytes) == (real.nvme_bytes_per_rank,
                                                                           real.upfront_locked_bytes)
    options = DoctorOptions()
    assert (options.nvme_bytes, options.lock_bytes) == (real.nvme_bytes_per_rank, real.upfront_locked_bytes)
    help_text = " ".join(CliRunner().invoke(doctor, ["--help"]).output.split())
    assert format_bytes(real.upfront_locked_bytes) in help_text and format_bytes(real.nvme_bytes_per_rank) in help_text

