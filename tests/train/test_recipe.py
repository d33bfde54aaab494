"""The run as a recipe (issue 20 item 1): the per-step record, the one report builder, the cleanup
ledger, and DeepSpeed internals only behind the seam.

``data/report_keys.json`` is the key structure of two ``report.json`` files written by the runner
before the recipe existed (leaves are type names; numbers, strings and paths excluded): the report
built here from fixed inputs must have the same keys in the same order.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from memascend.config import build_run_config
from memascend.telemetry import MemorySampler
from memascend.train import report as report_mod
from memascend.train.cleanup import Cleanup
from memascend.train.dist import DistInfo
from memascend.train.recipe import StepRecord
from memascend.train.run_log import STEPS_LOG, RunLog

FIXTURE = json.loads((Path(__file__).parent / "data" / "report_keys.json").read_text())
PACKAGE = Path(__file__).resolve().parents[2] / "memascend"

ADDED_STEP_KEYS = ["lr", "locked_bytes", "nvme_read_bytes", "nvme_write_bytes", "eval_loss", "swap_read_bytes",
                   "swap_write_bytes", "io_wait_s", "phase_io", "phase_floor_s", "phase_cpu_s", "phase_sys_s",
                   "step_worker_s"]
"""Keys a step record gained after the fixture was recorded (TensorBoard, --eval-every, the swap I/O
meter, the step overlap's worker seconds), at its end."""
ADDED_TRAIN_KEYS = {"lr_scheduler", "eval_every", "report_to", "verbose", "deterministic"}
"""``config.train`` keys added by issue 23 (the optimizer, evaluation and logging flags) and ``--deterministic``."""

ADDED_CONFIG_SECTIONS = ("lora",)
"""``config`` sections added since: the LoRA settings (``--lora-rank`` ...)."""


def keys(value):
    """The key structure of a JSON value: dicts keep their keys in order, a list its first element."""
    if isinstance(value, dict):
        return [(k, keys(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [keys(value[0])] if value else []
    return None


def old_step_keys(rec_keys):
    """A step record's key structure without :data:`ADDED_STEP_KEYS` (which must close it, in order)."""
    assert [k for k, _ in rec_keys[-len(ADDED_STEP_KEYS):]] == ADDED_STEP_KEYS
    return rec_keys[:-len(ADDED_STEP_KEYS)]


def is_subsequence(old: list, new: list) -> bool:
    """Every element of ``old`` is in ``new``, in the same order (``new`` may have more); a nested
    ``(key, structure)`` pair is covered by the same key whose structure covers it (a nested section,
    e.g. ``model.from_scratch``, may gain keys too)."""
    it = iter(new)
    return all(any(_covers(x, y) for y in it) for x in old)


def _covers(old, new) -> bool:
    if isinstance(old, tuple) and isinstance(new, tuple) and isinstance(old[1], list) and isinstance(new[1], list):
        return old[0] == new[0] and is_subsequence(old[1], new[1])
    return old == new


def record(step: int = 1) -> StepRecord:
    return StepRecord(step=step, loss=10.5, rank_losses=(10.5,), time_s=0.5,
                      phase_s={"forward_s": 0.1, "backward_s": 0.2, "optimizer_step_s": 0.15}, tokens=64,
                      tokens_per_s=128.0, rss_bytes=1 << 29, minor_faults=1000, skipped=False, lr=1e-4,
                      locked_bytes=1 << 20, nvme_read_bytes=4096, nvme_write_bytes=8192)


def test_step_record_has_the_keys_and_values_of_the_old_record():
    rec = record().to_dict()
    for backend in ("folder", "raw_store"):
        assert old_step_keys(keys(rec)) == keys(FIXTURE[backend]["steps"][0])
    assert rec == {"step": 1, "loss": 10.5, "rank_losses": [10.5], "time_s": 0.5,
                   "phase_s": {"forward_s": 0.1, "backward_s": 0.2, "optimizer_step_s": 0.15}, "tokens": 64,
                   "tokens_per_s": 128.0, "rss_bytes": 1 << 29, "minor_faults": 1000, "skipped": False,
                   "lr": 1e-4, "locked_bytes": 1 << 20, "nvme_read_bytes": 4096, "nvme_write_bytes": 8192,
                   "eval_loss": None, "swap_read_bytes": 0, "swap_write_bytes": 0, "io_wait_s": 0.0, "phase_io": None,
                   "phase_floor_s": None, "phase_cpu_s": None, "phase_sys_s": None, "step_worker_s": None}
    assert dataclasses.replace(record(), eval_loss=3.5).to_dict()["eval_loss"] == 3.5
    assert list(rec["phase_s"]) == list(report_mod.PHASES)
    # JSON as steps.jsonl writes it: a list, not a tuple; the record is frozen and its dict a copy
    assert json.loads(json.dumps(rec)) == rec
    rec["phase_s"]["forward_s"] = 9.0
    assert record().to_dict()["phase_s"]["forward_s"] == 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        record().loss = 1.0  # type: ignore[misc]


def test_run_log_writes_the_record_as_a_line(tmp_path):
    sampler = MemorySampler()
    log = RunLog(tmp_path, sampler, {"engine": "memascend"})
    log.step(record(1).to_dict())
    log.step(record(2).to_dict())
    log.close()
    lines = [json.loads(x) for x in (tmp_path / STEPS_LOG).read_text().splitlines()]
    assert lines == [record(1).to_dict(), record(2).to_dict()]
    partial = json.loads((tmp_path / "report.json").read_text())
    assert partial["steps"] == lines and partial["complete"] is False


def _cfg(backend: str, tmp_path: Path):
    nvme = str(tmp_path / ("run.store" if backend == "raw_store" else "swap"))
    train = {"steps": 2, "save_checkpoint": str(tmp_path / "ck"), "save_model": backend == "folder"}
    if backend == "folder":
        train["checkpoint_every"] = 1
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"memascend": {"enable_param_pool": True}, "gradient_clipping": 1.0}))
    return build_run_config({}, {
        "model": {"from_scratch": "llama-tiny"},
        "data": {"seq_len": 32, "eval_blocks": 1},
        "train": {**train, "micro_batch": 2},
        "offload": {"nvme_path": nvme},
        "output_dir": str(tmp_path / "out"),
        "deepspeed_config": str(ds) if backend == "folder" else None,
    })


def _inputs(backend: str, tmp_path: Path) -> report_mod.ReportInputs:
    cfg = _cfg(backend, tmp_path)
    summary = MemorySampler().summary()
    store = {"target": "x.store", "used_bytes": 0} if backend == "raw_store" else None
    return report_mod.ReportInputs(
        cfg=cfg, ds_config={"zero_optimization": {"stage": 3}}, derived=[], engine_settings={"enable_param_pool": True},
        user_ds_config=cfg.user_ds_config, device_type="cpu", world_size=1,
        split=SimpleNamespace(num_documents=3, num_tokens=300, train=[0] * 8, eval=[0]),
        shape=SimpleNamespace(total_numel=100, trainable_numel=100, largest_numel=60), param_dtype="bfloat16",
        per_step=[record(1).to_dict(), record(2).to_dict()], loss_before=10.7, loss_after=10.6, skipped_steps=0,
        train_s=1.0, wall_s=5.0, summary=summary,
        rank_peaks=[{"rank": 0, "peak_rss_bytes": 1 << 30, "peak_locked_bytes": 1 << 20}],
        memory_breakdown={"peak_rss_bytes": 1 << 30}, io_read_bytes=1, io_write_bytes=2,
        swap_folder_bytes=3 if backend == "folder" else 0, nvme_backend=backend,
        store_report=store, store_ranks=[{"rank": 0, **store}] if store else None,
        seeding={"seed": 1234, "rank_seeds": [1234], "rng_from_checkpoint": False},
        model_dir=str(tmp_path / "out" / "model") if backend == "folder" else None,
        resumed_from=None, start_step=0, periodic_saved=["global_step1", "global_step2"] if backend == "folder" else [],
        checkpoint_saves=[{"path": str(tmp_path / "ck" / "global_step2"), "save_s": 0.2, "manifest_s": 0.1,
                           "bytes": 10}],
        saved_to=str(tmp_path / "ck"), saved_tag="global_step2",
    )


@pytest.mark.parametrize("backend", ["folder", "raw_store"])
def test_report_from_fixed_inputs_has_the_old_reports_keys(tmp_path, backend):
    want = FIXTURE[backend]
    rep = report_mod.build_report(_inputs(backend, tmp_path))
    # the swap I/O summary and the phases' CPU and system seconds added at the end
    assert list(rep) == [*want, "swap_io", "median_phase_cpu_s", "median_phase_sys_s", "step_overlap"]
    # the sections the builder makes, key for key and in order
    for section in ("host", "model", "data", "eval", "nvme", "checkpoint", "seeding"):
        if section == "nvme" and backend == "raw_store":
            assert list(rep["nvme"]) == list(want["nvme"])  # the store's own keys come from the store
            continue
        added = [("dist_backend", None)] if section == "host" else []  # issue 22: nccl or gloo
        got = [k for k in keys(rep[section]) if k != ("trainable_param_numel", None)]  # model: added for LoRA
        assert got == keys(want[section]) + added, section
    assert rep["model"]["trainable_param_numel"] == 100
    # config: the fields of the recorded config, in order, plus the ones added since (issue 23)
    assert [k for k in rep["config"] if k not in ADDED_CONFIG_SECTIONS] == list(want["config"])
    for section, fields in keys(want["config"]):
        now = dict(keys(rep["config"]))[section]
        assert is_subsequence(fields or [], now or []), section
    assert ADDED_TRAIN_KEYS <= set(rep["config"]["train"])
    assert [old_step_keys(k) for k in keys(rep["steps"])] == keys(want["steps"])
    # memory: the recorded keys, then the per-host ones added for several hosts (issue 22)
    assert list(rep["memory"]) == [*want["memory"], "nodes", "max_node_peak_rss_bytes", "max_node_peak_locked_bytes"]
    assert rep["memory"]["sum_rank_peak_rss_bytes"] == 1 << 30 == rep["memory"]["max_node_peak_rss_bytes"]
    assert rep["complete"] is True and rep["status"] == "completed" and rep["num_steps"] == 2
    assert rep["median_step_s"] == 0.5 and rep["median_phase_s"] == record().to_dict()["phase_s"]
    assert rep["nvme"]["backend"] == backend and rep["nvme"]["path"] == _cfg(backend, tmp_path).offload.nvme_path
    assert rep["user_deepspeed_config"] == (None if backend == "raw_store" else
                                            {"memascend": {"enable_param_pool": True}, "gradient_clipping": 1.0})
    assert rep["checkpoint"]["saved_tag"] == "global_step2" and rep["checkpoint"]["start_step"] == 0


def test_no_nvme_report_has_no_store_keys(tmp_path):
    inp = dataclasses.replace(_inputs("folder", tmp_path), nvme_backend=None, swap_folder_bytes=0)
    assert list(report_mod.build_report(inp)["nvme"]) == ["read_bytes", "write_bytes", "swap_folder_bytes", "path",
                                                          "backend"]


def test_partial_report_header_is_the_final_reports_first_keys(tmp_path):
    inp = _inputs("folder", tmp_path)
    info = DistInfo(rank=0, local_rank=0, world_size=1, device_type="cpu")
    header = report_mod.report_header(inp.cfg, inp.shape, inp.split, info)
    final = report_mod.build_report(inp)
    assert list(header) == ["report_version", "engine", "config", "versions", "host", "model", "data"]
    assert header["config"] == final["config"] and header["data"] == final["data"]
    assert header["model"] == {k: v for k, v in final["model"].items() if k != "param_dtype"}
    assert header["host"] == {k: final["host"][k] for k in ("device_type", "world_size")}


def test_cleanup_runs_every_step_and_raises_the_first_error(tmp_path):
    done = []
    ledger = Cleanup()
    ledger.swap_lock = SimpleNamespace(release=lambda: (done.append("lock"), 1 / 0))

    def revert():
        done.append("revert")
        raise RuntimeError("second")

    ledger.revert = revert
    ledger.created_out_dir = tmp_path / "out"
    ledger.created_out_dir.mkdir()
    with pytest.raises(ZeroDivisionError):
        ledger.run(failed=True)
    assert done == ["lock", "revert"] and not ledger.created_out_dir.exists()


def test_cleanup_keeps_the_output_folder_of_a_run_that_did_not_fail_or_is_not_empty(tmp_path):
    ledger = Cleanup()
    ledger.created_out_dir = tmp_path / "out"
    ledger.created_out_dir.mkdir()
    ledger.run()
    assert ledger.created_out_dir.exists()
    (ledger.created_out_dir / "steps.jsonl").write_text("")
    ledger.run(failed=True)
    assert ledger.created_out_dir.exists()


def test_train_package_calls_no_deepspeed_internal_on_an_engine():
    """``engine._x`` and ``._zero...`` calls live in memascend/integrations/deepspeed (e.g.
    ``engine_state.consolidated_16bit_state_dict``), not in the recipe or the checkpoints."""
    found = []
    for path in (PACKAGE / "train").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = node.value
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
                if "engine" in name or node.attr.startswith("_zero"):
                    found.append(f"{path.name}:{node.lineno} {name}.{node.attr}")
    assert not found


def test_consolidated_state_dict_goes_through_the_seam():
    from memascend.integrations.deepspeed.engine_state import consolidated_16bit_state_dict

    calls = []
    engine = SimpleNamespace(_zero3_consolidated_16bit_state_dict=lambda: calls.append(1) or {"w": 1})
    assert consolidated_16bit_state_dict(engine) == {"w": 1} and calls == [1]


def test_cleanup_closes_a_raw_store_the_seam_holds_even_before_the_ledger_knew_it(monkeypatch):
    """An interrupt between ``apply_raw_store``'s return and the ledger's assignment: the seam's
    revert still runs (it closes the store)."""
    from memascend.integrations import deepspeed as seam

    calls = []
    monkeypatch.setattr(seam, "active_raw_store", lambda: object())
    monkeypatch.setattr(seam, "revert", lambda: calls.append("revert"))
    Cleanup().run()
    assert calls == ["revert"]
    monkeypatch.setattr(seam, "active_raw_store", lambda: None)
    Cleanup().run()
    assert calls == ["revert"]


def test_peaks_per_host_sum_that_host_s_ranks_and_the_largest_host_is_named():
    ranks = [{"rank": r, "node_rank": r // 2, "hostname": f"h{r // 2}", "peak_rss_bytes": (r + 1) << 30,
              "peak_locked_bytes": 1 << 20} for r in range(4)]
    nodes = report_mod.node_peaks(ranks)
    assert [(n["node_rank"], n["hostname"], n["ranks"]) for n in nodes] == [(0, "h0", [0, 1]), (1, "h1", [2, 3])]
    assert [n["sum_rank_peak_rss_bytes"] >> 30 for n in nodes] == [1 + 2, 3 + 4]
    mem = report_mod._memory_section({"peak_rss_bytes": 1 << 30, "peak_locked_bytes": 1 << 20}, ranks)
    assert mem["max_node_peak_rss_bytes"] == 7 << 30 and mem["max_node_peak_locked_bytes"] == 2 << 20
    assert mem["sum_rank_peak_rss_bytes"] == 10 << 30
    # ranks recorded before nodes were (no node_rank): one host
    assert [n["ranks"] for n in report_mod.node_peaks([{"rank": 0, "peak_rss_bytes": 1, "peak_locked_bytes": 0},
                                                       {"rank": 1, "peak_rss_bytes": 2, "peak_locked_bytes": 0}])] == [[0, 1]]
