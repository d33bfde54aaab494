"""The start-up hook of ``memascend run``: memascend is applied where a DeepSpeed config given to
``deepspeed.zero.Init`` / ``deepspeed.initialize`` has a ``"memascend"`` section, before DeepSpeed
runs, and nowhere else; a process that never imports DeepSpeed loads neither DeepSpeed nor memascend.

The wrappers are tested in-process around stand-ins for DeepSpeed's two functions (with memascend's
real ``apply``); the hook itself in fresh interpreters started as ``memascend run`` starts them."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import memascend.integrations.deepspeed as ma_ds
from memascend.config import MemAscendSettings
from memascend.integrations.deepspeed import autoapply, overflow
from tests.conftest import REPO


@pytest.fixture
def hook(monkeypatch):
    """``autoapply.install()`` in force (DeepSpeed imported here), memascend reverted afterwards."""
    # pure-torch stand-in for the overflow op, as tests/integrations/test_ds_apply_revert.py
    monkeypatch.setattr(overflow, "load_checker", lambda: (lambda t: bool((~torch.isfinite(t)).any())))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")  # no enable_torch_thp notice: only the hook's line
    monkeypatch.setattr(ma_ds._warn_torch_thp, "done", False, raising=False)  # ranks > 0 set it
    autoapply.install()
    yield
    ma_ds.revert()
    autoapply.uninstall()


def _recording_init(seen: list):
    def original(self, module=None, config_dict_or_path=None, config=None, enabled=True):
        seen.append(ma_ds.applied_settings())
    return autoapply.make_init(original)


# ---- which configs carry a section


def test_section_of_reads_dicts_json_paths_and_base64(tmp_path):
    cfg = {"zero_optimization": {"stage": 3}, "memascend": {"param_prefetch_slots": 8}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    encoded = base64.urlsafe_b64encode(json.dumps(cfg).encode()).decode()
    for given in (cfg, str(path), path, encoded):
        assert autoapply.section_of(given) == {"param_prefetch_slots": 8}
    assert autoapply.section_of({"memascend": {}}) == {}  # an empty section asks for the defaults


@pytest.mark.parametrize("given", [None, {"zero_optimization": {"stage": 3}}, "missing.json", "not base64 !",
                                   42, ["memascend"]])
def test_no_section_where_the_config_has_none_or_cannot_be_read(given, tmp_path):
    assert autoapply.section_of(given) is None
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert autoapply.section_of(bad) is None


def test_child_env_puts_the_hook_first_once_and_sets_the_variable():
    site = str(autoapply.SITE_DIR)
    env = autoapply.child_env({"PYTHONPATH": f"/a{os.pathsep}{os.pathsep}{site}{os.pathsep}/b", "X": "1"})
    assert env["PYTHONPATH"] == os.pathsep.join([site, "/a", "/b"])
    assert env[autoapply.ENV_VAR] == "1" and env["X"] == "1"
    assert autoapply.child_env({})["PYTHONPATH"] == site
    assert (autoapply.SITE_DIR / "sitecustomize.py").is_file()


def test_applied_line_names_the_settings():
    line = autoapply.applied_line(MemAscendSettings(), "deepspeed.zero.Init", 2)
    assert line.startswith("memascend: applied to DeepSpeed (2 ranks;") and "defaults (every optimization on)" in line
    line = autoapply.applied_line(MemAscendSettings(enable_fused_overflow_check=False, param_prefetch_slots=8),
                                  "deepspeed.initialize", 1)
    assert "(1 rank;" in line and "enable_fused_overflow_check=false, param_prefetch_slots=8" in line
    assert "\n" not in line


# ---- zero.Init and initialize with and without the section


def test_init_with_a_section_applies_it_before_deepspeed_runs(hook, capsys):
    seen = []
    _recording_init(seen)(object(), config_dict_or_path={"memascend": {"param_prefetch_slots": 8}})
    assert seen == [MemAscendSettings(param_prefetch_slots=8)]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("memascend: applied to DeepSpeed (1 rank;")
    assert "deepspeed.zero.Init" in err[0] and "param_prefetch_slots=8" in err[0]
    _recording_init(seen)(object(), config={"memascend": {"param_prefetch_slots": 8}})  # again: no second line
    assert capsys.readouterr().err == ""


def test_init_without_a_section_leaves_deepspeed_untouched(hook, capsys, tmp_path):
    seen = []
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    _recording_init(seen)(object(), config_dict_or_path=str(path))
    _recording_init(seen)(object())
    assert seen == [None, None] and ma_ds.patch_records() == ()
    assert capsys.readouterr().err == ""


def test_only_rank_0_prints_the_line(hook, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    seen = []
    _recording_init(seen)(object(), config_dict_or_path={"memascend": {}})
    assert seen == [MemAscendSettings()] and capsys.readouterr().err == ""


def test_a_bad_section_is_one_error_line_and_exit_2(hook, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _recording_init([])(object(), config_dict_or_path={"memascend": {"enable_param_pol": False}})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("memascend: error: unknown key(s) enable_param_pol")
    assert ma_ds.applied_settings() is None


def test_settings_applied_by_the_script_itself_are_kept(hook, capsys):
    ma_ds.apply(MemAscendSettings.baseline())
    seen = []
    _recording_init(seen)(object(), config_dict_or_path={"memascend": {}})
    assert seen == [MemAscendSettings.baseline()] and capsys.readouterr().err == ""


def test_initialize_applies_then_goes_through_the_seams_sizing_wrapper(hook, capsys):
    calls = []
    module = types.SimpleNamespace()

    def original(args=None, model=None, config=None, config_params=None):
        calls.append(("deepspeed", ma_ds.applied_settings()))
        return "engine"

    wrapper = autoapply.make_initialize(original, module)
    module.initialize = wrapper
    assert wrapper(model="m", config_params={"train_batch_size": 1}) == "engine"  # no section: straight through
    assert calls == [("deepspeed", None)]

    def apply_and_wrap(section, where):  # what the seam does on apply: wrap module.initialize
        ma_ds.apply(MemAscendSettings.from_mapping(section))

        def sizing(*args, **kwargs):
            calls.append(("sizing", None))
            return wrapper(*args, **kwargs)
        module.initialize = sizing

    calls.clear()
    original_apply, autoapply._apply_section = autoapply._apply_section, apply_and_wrap
    try:
        args = types.SimpleNamespace(deepspeed_config={"memascend": {"param_prefetch_slots": 4}})
        assert wrapper(args, model="m") == "engine"  # a caller holding the wrapper itself
    finally:
        autoapply._apply_section = original_apply
    assert calls == [("sizing", None), ("deepspeed", MemAscendSettings(param_prefetch_slots=4))]


def test_install_and_uninstall_restore_deepspeeds_own_functions():
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import Init

    before = (deepspeed.initialize, Init.__dict__["__init__"])
    autoapply.install()
    autoapply.install()
    try:
        assert autoapply.installed()
        assert deepspeed.initialize.__wrapped__ is before[0] and Init.__dict__["__init__"].__wrapped__ is before[1]
    finally:
        autoapply.uninstall()
    assert (deepspeed.initialize, Init.__dict__["__init__"]) == before and not autoapply.installed()
    autoapply.uninstall()


# ---- the start-up hook in fresh interpreters


def _python(code: str, *, hook_on: bool, extra_path: str = "", timeout_s: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", autoapply.ENV_VAR)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), extra_path) if p)
    env = autoapply.child_env(env)
    if not hook_on:
        env.pop(autoapply.ENV_VAR)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def test_a_process_that_never_imports_deepspeed_loads_neither_it_nor_memascend():
    out = _python("""
        import sys, json
        print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'memascend', 'torch'))))
        print(type(sys.meta_path[0]).__name__)
    """, hook_on=True)
    assert out.returncode == 0, out.stderr
    loaded, first_finder = out.stdout.splitlines()
    assert json.loads(loaded) == [] and first_finder == "DeepSpeedImportHook" and out.stderr == ""


def test_a_sitecustomize_the_hook_hides_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.OTHER_SITECUSTOMIZE_RAN = True\n")
    for hook_on in (True, False):
        out = _python("import builtins; print(getattr(builtins, 'OTHER_SITECUSTOMIZE_RAN', False))",
                      hook_on=hook_on, extra_path=str(tmp_path))
        assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


ZERO_INIT = """
    import os, sys, json
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}",
                      DS_ACCELERATOR="cpu")
    import deepspeed, torch
    from deepspeed.runtime.zero import partition_parameters as pp
    stock_swapper = pp.AsyncPartitionedParameterSwapper
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = {{"train_batch_size": 1, "zero_optimization": {{"stage": 3}}}}
    states = []
    for section in (None, {{"param_prefetch_slots": 6}}):
        with deepspeed.zero.Init(config_dict_or_path=cfg if section is None else {{**cfg, "memascend": section}}):
            torch.nn.Linear(4, 4)
        seam = sys.modules.get("memascend.integrations.deepspeed")
        states.append([seam is not None and seam.applied_settings() is not None,
                       pp.AsyncPartitionedParameterSwapper is not stock_swapper])
    print("STATES " + json.dumps(states), flush=True)
    os._exit(0)
"""


@pytest.mark.parametrize("hook_on", [True, False])
def test_zero_init_applies_the_section_only_under_the_hook(hook_on):
    from memascend.train.dist import free_port

    out = _python(ZERO_INIT.format(port=free_port()), hook_on=hook_on)
    assert out.returncode == 0, out.stderr[-3000:]
    states = json.loads(out.stdout.split("STATES ", 1)[1])
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("memascend:")]
    if hook_on:  # without the section untouched, with it applied (the swapper is memascend's) and said once
        assert states == [[False, False], [True, True]]
        assert [ln.split(":")[1] for ln in lines if not ln.startswith("memascend: enable_torch_thp")] == [
            " applied to DeepSpeed (1 rank; the \"memascend\" section of the config given to deepspeed.zero.Init)"]
        assert "param_prefetch_slots=6" in lines[-1]
    else:
        assert states == [[False, False], [False, False]] and lines == []


INITIALIZE = """
    import os, sys, json
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}",
                      DS_ACCELERATOR="cpu")
    import deepspeed, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).to(torch.bfloat16)
    offload = {{"device": "nvme", "nvme_path": "{swap}"}}
    cfg = {{"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "bf16": {{"enabled": True}},
           "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
           "zero_optimization": {{"stage": 3, "offload_param": offload, "offload_optimizer": offload}},
           "memascend": {{}}}}
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    print("RESULT " + json.dumps({{"loss": loss.item().hex(), "sub_group_size": engine._config.zero_config.sub_group_size,
                                  "swapper": type(next(engine.module.parameters()).nvme_swapper).__name__}}), flush=True)
    os._exit(0)
"""


def test_a_model_built_outside_zero_init_gets_memascend_at_initialize(tmp_path):
    """A plain ``deepspeed.initialize`` loop: applied there, the sizes resolved by the seam's own
    ``initialize`` wrapper (the hook's call goes on through it), the same loss as without the hook."""
    from memascend.train.dist import free_port

    results = {}
    for hook_on in (True, False):
        swap = tmp_path / f"swap-{hook_on}"
        swap.mkdir()
        out = _python(INITIALIZE.format(port=free_port(), swap=swap), hook_on=hook_on)
        assert out.returncode == 0, out.stderr[-3000:]
        results[hook_on] = json.loads(out.stdout.split("RESULT ", 1)[1])
        results[hook_on]["lines"] = [ln for ln in out.stderr.splitlines() if ln.startswith("memascend: applied")]
    with_hook, without = results[True], results[False]
    assert with_hook["loss"] == without["loss"]
    assert with_hook["swapper"] == "PooledParamSwapper" and without["swapper"] == "AsyncPartitionedParameterSwapper"
    assert with_hook["sub_group_size"] < without["sub_group_size"] == 1_000_000_000
    assert len(with_hook["lines"]) == 1 and "given to deepspeed.initialize" in with_hook["lines"][0]
    assert without["lines"] == []
