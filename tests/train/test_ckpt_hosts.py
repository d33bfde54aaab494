"""Checkpoint folders of a run on several hosts (memascend.train.checkpoints.hosts): every host names one
shared folder, and resolves ``--resume`` alike, or every rank stops with the same line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from memascend.errors import UserError
from memascend.train.checkpoints import hosts as ckpt_hosts
from memascend.train.checkpoints.manifest import write_manifest
from memascend.train.dist import DistInfo, free_port


def _train(**kw) -> SimpleNamespace:
    base = {"save_checkpoint": None, "checkpoint_every": None, "checkpoint_every_minutes": None, "resume": None}
    return SimpleNamespace(**{**base, **kw})


def _rec(rank: int, **kw) -> dict:
    return {"rank": rank, "node_rank": rank, "hostname": f"h{rank}", **kw}


def test_written_folders_are_the_options_that_write_checkpoints(tmp_path):
    assert ckpt_hosts.written_folders(_train(), tmp_path) == {}
    got = ckpt_hosts.written_folders(_train(save_checkpoint="ck", checkpoint_every=5), tmp_path / "out")
    assert got == {"--save-checkpoint": os.path.abspath("ck"),
                   "periodic checkpoints (OUTPUT/checkpoints)": str(tmp_path / "out" / "checkpoints")}


def test_a_host_naming_another_folder_is_named():
    same = [_rec(0, folders={"--save-checkpoint": "/nfs/ck"}), _rec(1, folders={"--save-checkpoint": "/nfs/ck"})]
    assert ckpt_hosts.differing_folders(same) is None
    other = [same[0], _rec(1, folders={"--save-checkpoint": "/local/ck"})]
    msg = ckpt_hosts.differing_folders(other)
    assert "--save-checkpoint: host h0 (node 0, rank 0) names /nfs/ck, host h1 (node 1, rank 1) names /local/ck" in msg
    assert "storage every host reaches" in msg


def test_a_host_that_does_not_see_rank_0s_probe_is_named():
    probes = {"--save-checkpoint": "/ck/.memascend-shared-x"}
    assert ckpt_hosts.unseen_probes([_rec(0, sees={"--save-checkpoint": True}),
                                     _rec(1, sees={"--save-checkpoint": True})], probes) is None
    msg = ckpt_hosts.unseen_probes([_rec(0, sees={"--save-checkpoint": True}),
                                    _rec(1, sees={"--save-checkpoint": False})], probes)
    assert msg.startswith("--save-checkpoint: host h1 (node 1, rank 1) does not see what host h0 (node 0, rank 0) "
                          "writes in /ck")


def test_one_host_needs_no_collective(tmp_path):
    info = DistInfo(rank=0, local_rank=0, world_size=2, device_type="cpu")  # two ranks, one host
    assert not ckpt_hosts.several_hosts(info)
    ckpt_hosts.check_shared_folders(_train(save_checkpoint=str(tmp_path / "ck")), tmp_path, info, "run")
    assert ckpt_hosts.resolve_resume_everywhere("auto", tmp_path, info) is None  # no process group touched
    assert not (tmp_path / "ck").exists()


def _rank_main(rank: int, port: int, tmp: str) -> None:
    """One "host" of a two-host gloo group (one rank each): each case's check, and what it raised."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    info = DistInfo(rank=rank, local_rank=0, world_size=2, device_type="cpu", local_world_size=1, node_rank=rank,
                    hostname=f"host{rank}")
    base = Path(tmp)
    cases = {
        "shared": lambda: ckpt_hosts.check_shared_folders(_train(save_checkpoint=str(base / "ck")), base, info, "r1"),
        "differ": lambda: ckpt_hosts.check_shared_folders(_train(save_checkpoint=str(base / f"ck{rank}")), base,
                                                          info, "r1"),
        # rank 0 sees a checkpoint in its OUTPUT/checkpoints, rank 1's output has none
        "resume": lambda: ckpt_hosts.resolve_resume_everywhere("auto", base / f"out{rank}", info),
    }
    errs = {}
    for case, check in cases.items():
        try:
            check()
            errs[case] = None
        except UserError as exc:
            errs[case] = str(exc)
    (base / f"rank{rank}.json").write_text(json.dumps(errs))
    tdist.destroy_process_group()


@pytest.mark.distributed
def test_two_hosts_check_together(tmp_path):
    import torch.multiprocessing as mp

    tag = tmp_path / "out0" / "checkpoints" / "global_step2"
    tag.mkdir(parents=True)
    write_manifest(tag, {"step": 2, "tag": tag.name, "dtype": "bf16", "world_size": 2, "param_shapes": {}})
    mp.start_processes(_rank_main, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    errs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert errs[0] == errs[1]  # every rank raises the same line
    assert errs[0]["shared"] is None
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(ckpt_hosts.PROBE_PREFIX)]  # probe removed
    assert errs[0]["differ"].startswith(f"--save-checkpoint: host host0 (node 0, rank 0) names {tmp_path / 'ck0'}, "
                                        f"host host1 (node 1, rank 1) names {tmp_path / 'ck1'}")
    assert "host host0 (node 0, rank 0) finds " + str(tag) in errs[0]["resume"]
    assert "host host1 (node 1, rank 1) finds no checkpoint" in errs[0]["resume"]
