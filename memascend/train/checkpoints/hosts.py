"""Checkpoints of a run on several hosts: one folder that every host reaches.

A checkpoint is one folder whatever the number of hosts: every rank writes its own files into it
(DeepSpeed's ``zero_pp_rank_<N>_mp_rank_00_optim_states.pt``; the rank's swapped optimizer state,
node-local while training, as ``offloaded_tensors/rank<NN>/`` (swap folder) or
``memascend_store/rank<NN>/`` (raw store export); ``N``/``NN`` the GLOBAL rank), then rank 0 hashes
every file into the manifest and renames the folder into place. So ``--save-checkpoint``,
``--resume`` and ``OUTPUT/checkpoints`` (periodic checkpoints, ``--resume auto``) must name the
same folder on every host, on storage every host reaches (NFS, a parallel filesystem).

:func:`check_shared_folders` checks the folders a run will write before its first step, and
:func:`resolve_resume_everywhere` makes every host resolve ``--resume`` to the same checkpoint; a
host that names another folder, or does not see what rank 0 writes there, stops every rank with
the same one line (instead of a checkpoint missing that host's files, or ranks that disagree and
hang). On one host neither does anything beyond :func:`~memascend.train.checkpoints.resume.resolve_resume`
(no collective call).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from memascend.errors import IntegrityError, UserError
from memascend.train.checkpoints.layout import periodic_root
from memascend.train.checkpoints.manifest import Checkpoint
from memascend.train.checkpoints.resume import resolve_resume
from memascend.train.dist import all_gather, broadcast

SHARED_HINT = ("with several hosts a checkpoint folder must be one folder on storage every host reaches (NFS, a "
               "parallel filesystem), named by the same path on every host")
PROBE_PREFIX = ".memascend-shared-"


def several_hosts(info: Any) -> bool:
    """Whether the run's ranks are on more than one host (``info``: a :class:`~memascend.train.dist.DistInfo`)."""
    return info.ranks_on_node < info.world_size


def written_folders(train_cfg: Any, output_dir: str | os.PathLike) -> dict[str, str]:
    """The checkpoint folders the run writes, by the option that names them: ``--save-checkpoint``,
    and ``OUTPUT/checkpoints`` with periodic checkpoints. Absolute paths (as this host sees them)."""
    out = {}
    if train_cfg.save_checkpoint is not None:
        out["--save-checkpoint"] = os.path.abspath(train_cfg.save_checkpoint)
    if train_cfg.checkpoint_every is not None or train_cfg.checkpoint_every_minutes is not None:
        out["periodic checkpoints (OUTPUT/checkpoints)"] = os.path.abspath(periodic_root(output_dir))
    return out


def _who(rec: dict) -> str:
    return f"host {rec['hostname']} (node {rec['node_rank']}, rank {rec['rank']})"


def differing_folders(records: list[dict]) -> str | None:
    """The first option whose folder differs between ranks, as the error message, or ``None``.

    Args:
        records: one per rank: ``rank``, ``node_rank``, ``hostname``, ``folders`` (option -> path).
    """
    first = records[0]
    for what, path in first["folders"].items():
        other = next((r for r in records[1:] if r["folders"].get(what) != path), None)
        if other is not None:
            return (f"{what}: {_who(first)} names {path}, {_who(other)} names {other['folders'].get(what)}; "
                    f"{SHARED_HINT}")
    return None


def unseen_probes(records: list[dict], probes: dict[str, str]) -> str | None:
    """The first folder that a rank does not share with rank 0, as the error message, or ``None``.

    Args:
        records: one per rank: ``rank``, ``node_rank``, ``hostname``, ``sees`` (option -> whether
            the rank sees rank 0's probe folder).
        probes: option -> rank 0's probe folder (in the checkpoint folder, or its nearest existing parent).
    """
    for what, probe in probes.items():
        other = next((r for r in records if not r["sees"].get(what, False)), None)
        if other is not None:
            return (f"{what}: {_who(other)} does not see what {_who(records[0])} writes in {Path(probe).parent} "
                    f"(a node-local folder?); {SHARED_HINT}")
    return None


def _make_probes(folders: dict[str, str], run_id: str) -> dict[str, str]:
    """Rank 0: an empty probe folder in each folder (or its nearest existing parent); a folder
    that cannot be written is left to :func:`~memascend.train.checkpoints.checks.check_checkpoint_space`."""
    probes = {}
    for what, path in folders.items():
        probe_dir = Path(path)
        while not probe_dir.exists():
            probe_dir = probe_dir.parent
        try:
            probes[what] = tempfile.mkdtemp(prefix=f"{PROBE_PREFIX}{run_id}-", dir=probe_dir)
        except OSError:
            continue
    return probes


def check_shared_folders(train_cfg: Any, output_dir: str | os.PathLike, info: Any, run_id: str) -> None:
    """Before the first step of a run on several hosts, check that every host names the same
    checkpoint folders (:func:`written_folders`) and sees what rank 0 writes there (an empty
    probe folder, removed again). Collective: every rank calls it; nothing on one host.

    Raises:
        UserError: on every rank, the same line: a host names another folder, or does not share it.
    """
    if not several_hosts(info):
        return
    mine = {"rank": info.rank, **info.node_record(), "folders": written_folders(train_cfg, output_dir)}
    records = all_gather(mine, info.world_size)
    problem = differing_folders(records)
    if problem is None and mine["folders"]:
        probes = broadcast(_make_probes(mine["folders"], run_id) if info.rank == 0 else None, info.rank)
        try:
            sees = {what: os.path.isdir(p) for what, p in probes.items()}
            problem = unseen_probes(all_gather({**mine, "sees": sees}, info.world_size), probes)
        finally:
            if info.rank == 0:
                for p in probes.values():
                    shutil.rmtree(p, ignore_errors=True)
    if problem is not None:
        raise UserError(problem)


def resolve_resume_everywhere(resume: str, output_dir: str | os.PathLike, info: Any) -> Checkpoint | None:
    """:func:`~memascend.train.checkpoints.resume.resolve_resume` on every rank; with several hosts, every
    rank then has the same answer or raises the same error (collective: every rank calls it).

    Raises:
        UserError, IntegrityError: as ``resolve_resume`` (on every rank when every rank failed alike);
            UserError: some hosts resolve another checkpoint, none, or cannot read it.
    """
    if not several_hosts(info):
        return resolve_resume(resume, output_dir)
    found, err = None, None
    try:
        found = resolve_resume(resume, output_dir)
    except (UserError, IntegrityError) as exc:
        err = exc
    seen = None if found is None else f"{found.path} (step {found.step})"
    records = all_gather({"rank": info.rank, **info.node_record(), "seen": seen,
                          "error": None if err is None else str(err)}, info.world_size)
    first = records[0]
    other = next((r for r in records[1:] if (r["seen"], r["error"]) != (first["seen"], first["error"])), None)
    if other is None:
        if err is not None:
            raise err
        return found

    def says(r: dict) -> str:
        return r["error"] or (f"finds {r['seen']}" if r["seen"] else "finds no checkpoint")
    raise UserError(f"--resume {resume}: {_who(first)} {says(first)}, but {_who(other)} {says(other)}; "
                    f"{SHARED_HINT}")
