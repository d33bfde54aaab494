"""End to end: ``memascend finetune`` with optimizer sub-groups kept in DRAM (``optimizer_dram_numel``
in the DeepSpeed JSON's ``"memascend"`` section).

A small from-scratch Llama whose optimizer state splits into three swappable sub-groups
(``optimizer_sub_group_numel`` 1 Mi elements: the 12.6 M-element embedding, then about 1.05 M and
0.66 M elements of the layers), gradient accumulation 2 and gradient clipping 1.0, trained with none,
the first two and all three sub-groups kept in DRAM: the losses are the same bit for bit, the swap
target moves fewer bytes per step with the kept sub-groups and none in the backward and the optimizer
step with all of them kept, and a partly kept run saved after step 2 and resumed (on a raw store)
gives the uninterrupted run's losses, as does a resume with the sub-groups placed otherwise than
in the run that saved the checkpoint (none kept, then the first two, and the reverse, on a swap
folder and a raw store). Each run takes 30-50 s on 2 cores, so the module is slow; the
default suite's run is ``test_exact_resume.py``'s llama-tiny with every sub-group kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytest.importorskip("deepspeed")

MODEL = "hidden=256,layers=2,heads=4,vocab=49152"
ARGS = ["--from-scratch", MODEL, "--grad-accum", "2", "--seq-len", "32", "--micro-batch", "2", "--eval-blocks", "0",
        "--no-save-model", "--report-to", "none"]
SUB_GROUP_NUMEL = 1 << 20
KEEP = {"none": 0, "part": 13_700_000, "all": 10**9}
"""``optimizer_dram_numel`` per placement: ``part`` fits the embedding's and the next sub-group."""
KEPT = {"none": [], "part": [0, 1], "all": [0, 1, 2]}
STEPS = 3


def _ds_config(tmp: Path, placement: str) -> str:
    path = tmp / f"ds-{placement}.json"
    path.write_text(json.dumps({"gradient_clipping": 1.0,
                                "memascend": {"optimizer_sub_group_numel": SUB_GROUP_NUMEL,
                                              "optimizer_dram_numel": KEEP[placement]}}))
    return str(path)


def _finetune(tmp: Path, name: str, placement: str, *extra: str, nvme: str | None = None) -> dict:
    out = tmp / name
    proc = run_cli(["finetune", *ARGS, "--deepspeed-config", _ds_config(tmp, placement), "--output", str(out),
                    "--nvme-path", str(tmp / (nvme or f"swap-{name}")), *extra], tmp, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "report.json").read_text())


def _losses_hex(report: dict) -> dict[int, str]:
    return {s["step"]: s["loss"].hex() for s in report["steps"]}


def _swap_bytes(step: dict, phases: tuple[str, ...] = ("forward_s", "backward_s", "optimizer_step_s")) -> int:
    return sum(step["phase_io"][p]["read_bytes"] + step["phase_io"][p]["write_bytes"] for p in phases)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("optimizer-dram")
    return {placement: _finetune(tmp, placement, placement, "--steps", str(STEPS)) for placement in KEEP}


@pytest.mark.slow
def test_losses_bit_identical_whatever_is_kept(runs):
    for placement, report in runs.items():
        dram = report["memory_breakdown"]["optimizer_dram"]
        assert report["memascend_settings"]["optimizer_dram_numel"] == KEEP[placement]
        assert len(dram["sub_group_numels"]) == 3 and min(dram["sub_group_numels"]) > 262144  # all swappable
        assert dram["kept_sub_groups"] == dram["dram_sub_groups"] == KEPT[placement]
        assert dram["kept_numel"] == sum(dram["sub_group_numels"][i] for i in KEPT[placement])
        # fp32 master, gradient and both Adam moments of each kept element
        assert dram["dram_bytes"] == 16 * dram["kept_numel"]
    assert sorted(_losses_hex(runs["none"])) == list(range(1, STEPS + 1))
    assert _losses_hex(runs["part"]) == _losses_hex(runs["none"]) == _losses_hex(runs["all"])


@pytest.mark.slow
def test_kept_sub_groups_move_no_swap_bytes(runs):
    numels = runs["none"]["memory_breakdown"]["optimizer_dram"]["sub_group_numels"]
    for step_none, step_part, step_all in zip(*(runs[p]["steps"] for p in ("none", "part", "all"))):
        assert _swap_bytes(step_part) < _swap_bytes(step_none) / 10
        # the swapped sub-group's master weights and two moments are written every step, 4 bytes each
        assert step_part["phase_io"]["optimizer_step_s"]["write_bytes"] >= 3 * 4 * numels[2]
        assert _swap_bytes(step_all) == 0  # parameters stay in DRAM for this model: nothing moves at all
    assert runs["all"]["swap_io"]["median_step"]["read_bytes"] == runs["all"]["swap_io"]["median_step"]["write_bytes"] == 0
    # the swap folder holds the swapped sub-groups' optimizer files only (the parameters' files beside
    # them; its size is counted in file-system blocks, hence the 1% slack)
    optimizer_files = {p: runs[p]["nvme"]["swap_folder_bytes"] - runs["all"]["nvme"]["swap_folder_bytes"]
                       for p in ("none", "part")}
    assert optimizer_files["none"] >= 0.99 * 3 * 4 * sum(numels)
    assert 0.99 * 3 * 4 * numels[2] <= optimizer_files["part"] < 3 * 4 * (numels[1] + numels[2])
    # the optimizer swapper's buffers fit the largest sub-group still swapped, not the kept embedding
    locked = {p: runs[p]["memory_breakdown"]["locked"]["optimizer_swap_buffers_bytes"] for p in KEEP}
    assert locked["all"] == 0 and locked["part"] < locked["none"] / 4


@pytest.mark.slow
def test_partly_kept_resume_on_a_raw_store_is_exact(tmp_path, runs):
    first = _finetune(tmp_path, "first", "part", "--steps", "2", "--save-checkpoint", str(tmp_path / "ck"),
                      nvme="run.store")
    resumed = _finetune(tmp_path, "resumed", "part", "--steps", str(STEPS), "--resume", str(tmp_path / "ck"),
                        nvme="run.store")
    assert resumed["checkpoint"]["start_step"] == 2
    assert {**_losses_hex(first), **_losses_hex(resumed)} == _losses_hex(runs["none"])
    # the kept sub-groups' master weights are in the ZeRO checkpoint file, the swapped one's are not
    import torch

    optim = next((tmp_path / "ck" / "global_step2").glob("*optim_states.pt"))
    flat = torch.load(optim, map_location="cpu", weights_only=False)["optimizer_state_dict"]["fp32_flat_groups"]
    assert [t.numel() > 0 for t in flat] == [True, True, False]
    # resumed with every sub-group swapped: the kept sub-groups' master weights and moments are written
    # from the ZeRO file to the resumed run's store
    other = _finetune(tmp_path, "other", "none", "--steps", str(STEPS), "--resume", str(tmp_path / "ck"),
                      nvme="other.store")
    assert other["memory_breakdown"]["optimizer_dram"]["dram_sub_groups"] == []
    assert {**_losses_hex(first), **_losses_hex(other)} == _losses_hex(runs["none"])


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed, nvme", [("none", "part", "swap"), ("none", "part", "run.store"),
                                                  ("part", "none", "swap")])
def test_resume_exact_across_placements(tmp_path, runs, saved, resumed, nvme):
    """Saved with one placement, resumed with another (``--host-memory-budget auto`` may choose
    another on resume): each sub-group's state is moved where the resumed run keeps it."""
    first = _finetune(tmp_path, "first", saved, "--steps", "2", "--save-checkpoint", str(tmp_path / "ck"), nvme=nvme)
    again = _finetune(tmp_path, "resumed", resumed, "--steps", str(STEPS), "--resume", str(tmp_path / "ck"),
                      nvme=nvme)
    assert again["checkpoint"]["start_step"] == 2
    assert again["memory_breakdown"]["optimizer_dram"]["kept_sub_groups"] == KEPT[resumed]
    assert {**_losses_hex(first), **_losses_hex(again)} == _losses_hex(runs["none"])
    if nvme == "swap":
        # the checkpoint's swap files of sub-groups now kept in DRAM were not left in the swap folder
        assert again["nvme"]["swap_folder_bytes"] <= 1.01 * runs[resumed]["nvme"]["swap_folder_bytes"]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_partly_kept_losses_bit_identical(tmp_path):
    """Two ranks: each keeps the sub-groups of its own partition that fit (ZeRO-3 pads every
    parameter's partition to the same size, so both ranks keep the same ones)."""
    none = _finetune(tmp_path, "none2", "none", "--steps", "2", "--nproc", "2")
    numels = none["memory_breakdown"]["optimizer_dram"]["sub_group_numels"]
    assert len(numels) >= 2
    ds = tmp_path / "ds-part2.json"
    ds.write_text(json.dumps({"gradient_clipping": 1.0,
                              "memascend": {"optimizer_sub_group_numel": SUB_GROUP_NUMEL,
                                            "optimizer_dram_numel": sum(numels[:-1])}}))
    out = tmp_path / "part2"
    proc = run_cli(["finetune", *ARGS, "--deepspeed-config", str(ds), "--steps", "2", "--nproc", "2",
                    "--output", str(out), "--nvme-path", str(tmp_path / "swap-part2")], tmp_path, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    part = json.loads((out / "report.json").read_text())
    assert part["memory_breakdown"]["optimizer_dram"]["kept_sub_groups"] == list(range(len(numels) - 1))
    assert _losses_hex(part) == _losses_hex(none)
    assert sum(_swap_bytes(s) for s in part["steps"]) < sum(_swap_bytes(s) for s in none["steps"])
