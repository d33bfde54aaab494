"""A thin parent process that outlives the training process and cleans up after a hard death.

A training process that dies without unwinding (SIGKILL, the kernel's OOM killer, or SIGABRT from
an ``assert`` in DeepSpeed's aio op when a write fails, e.g. on a full disk) runs no ``finally``
block: its swap files or store file would stay behind and the user would see no memascend line.
``memascend finetune`` therefore runs the job in a child process (or under torchrun with
``--nproc``) and waits; what it decided for the run (config, output folder, budget choice) reaches the
job in a file, not on the command line (:mod:`memascend.train.handover`). Every rank records what it created in a *run-state* file
(:func:`record_run_state`); when the child ends, the parent removes whatever of that is still
there, marks the partial ``report.json`` and prints one line saying how the run ended:

* killed by a signal: ``memascend: error: the training process was killed by SIGKILL ...``, exit
  ``128 + signal``;
* and the swap folder's filesystem is (nearly) full: the disk-full line, exit 3
  (:class:`~memascend.errors.DeviceError`).

Signals: the child runs in its own process group; SIGINT, SIGTERM and SIGHUP sent to the parent (a
terminal's Ctrl-C reaches only the parent's group) are forwarded to it once, so the child unwinds
and cleans up as before.

Only paths memascend created are ever removed: the run's ``memascend-<run id>`` swap folder, a store
file the run created (under its run lock, so never one another run has adopted meanwhile), the
scratch key folder of a raw store.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from memascend.train.handover import Handover, write_handover

# STATE_DIR_ENV: the folder where ranks write their run-state files (also this module's name for it)
from memascend.train.run_state import (
    STATE_DIR_ENV,
    make_state_dir,
    orphaned_state_dirs,
    other_ranks_lines,
)

#: Set in the child's environment: the job runs in this process, no further supervisor.
SUPERVISED_ENV = "MEMASCEND_SUPERVISED"
#: A swap folder's filesystem with less free space than this, after a hard death, counts as full.
FULL_DISK_FREE_BYTES = 64 << 20

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def is_supervised() -> bool:
    """Whether this process runs under :func:`supervise` (or a launcher it started)."""
    return os.environ.get(SUPERVISED_ENV) == "1"


def record_run_state(rank: int, **paths: str | None) -> None:
    """Record (merge) what this rank created, for the parent to clean after a hard death.

    Args:
        rank: global rank (one file per rank).
        **paths: ``swap_dir`` (the run's swap folder), ``store_file`` (a store file this run
            created), ``key_root`` (a raw store's scratch key folder), ``out_dir``,
            ``nvme_path``; ``None`` values are ignored.

    Does nothing outside :func:`supervise`. Written atomically (temporary file, rename).
    """
    folder = os.environ.get(STATE_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return
    path = Path(folder) / f"rank{rank}.json"
    state = {}
    with contextlib.suppress(OSError, ValueError):
        state = json.loads(path.read_text())
    state.update({k: str(v) for k, v in paths.items() if v is not None})
    state["pid"] = os.getpid()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def supervise(cmd: list[str], handover: Handover | None = None) -> int:
    """Run ``cmd`` (the job: ``python -m memascend finetune`` or a torchrun launch of it) as a
    child, forward signals, and clean up after it.

    Args:
        cmd: the child's command line.
        handover: the resolved run, written to the run-state folder before the child starts (the
            job loads it: :func:`memascend.train.handover.handed_over`).

    Returns:
        The exit code for this process: the child's own, or after a death by signal the code of
        :func:`_report_hard_death`.
    """
    _reclaim_orphaned_states()
    state_dir = make_state_dir()
    env = {**os.environ, STATE_DIR_ENV: str(state_dir), SUPERVISED_ENV: "1"}
    try:
        if handover is not None:
            write_handover(state_dir, handover)
        # In its own process group: a terminal's Ctrl-C reaches only this parent, which forwards it
        # once (the child must not get it twice: a second interrupt would cut its cleanup short).
        child = subprocess.Popen(cmd, env=env, process_group=0, preexec_fn=_die_with_parent(os.getpid()))
        old = {sig: signal.signal(sig, lambda signum, _frame: _forward(child, signum)) for sig in _FORWARDED}
        try:
            code = child.wait()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        for line in other_ranks_lines(state_dir):  # rank 0 printed its own; the others' once each
            print(line, file=sys.stderr, flush=True)
        states = _read_states(state_dir)
        left = _clean_leftovers(states)
        if code < 0 or left:
            return _report_hard_death(-code if code < 0 else None, states, left, code)
        return code
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def _reclaim_orphaned_states() -> None:
    """Clean what runs whose supervising parent was killed outright left (their swap folders, store
    files, key folders) and remove their run-state folders (:func:`~memascend.train.run_state.orphaned_state_dirs`:
    only when the parent and every rank it records are gone)."""
    for folder in orphaned_state_dirs():
        removed = _clean_leftovers(_read_states(folder))
        shutil.rmtree(folder, ignore_errors=True)
        if removed:
            print(f"memascend: note: removed {', '.join(removed)}, left by an earlier run whose processes were killed",
                  file=sys.stderr, flush=True)


def _die_with_parent(parent_pid: int):
    """``preexec_fn``: the child gets SIGTERM (and unwinds, cleaning up) if this parent dies first,
    e.g. when a timeout kills the parent with SIGKILL."""

    def setup() -> None:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return setup


def _forward(child: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signum)


def _read_states(state_dir: Path) -> list[dict]:
    states = []
    for path in sorted(state_dir.glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            states.append(json.loads(path.read_text()))
    return states


def _clean_leftovers(states: list[dict]) -> list[str]:
    """Remove what the ranks created and did not remove themselves; returns what was removed."""
    from memascend.io.runlock import acquire_run_lock
    from memascend.train.swapdir import RUN_DIR_RE

    removed = []
    for st in states:
        swap_dir = st.get("swap_dir")
        if swap_dir and RUN_DIR_RE.fullmatch(Path(swap_dir).name) and Path(swap_dir).is_dir():
            shutil.rmtree(swap_dir, ignore_errors=True)
            removed.append(swap_dir)
        store_file = st.get("store_file")
        if store_file and Path(store_file).is_file():
            try:  # under its run lock: never a file another run took over since
                lock = acquire_run_lock(store_file)
            except Exception:  # noqa: BLE001 - busy or gone: not ours to remove now
                lock = None
            if lock is not None:
                Path(store_file).unlink(missing_ok=True)
                lock.release()
                removed.append(store_file)
        key_root = st.get("key_root")
        if key_root and Path(key_root).is_dir():
            shutil.rmtree(key_root, ignore_errors=True)
    return removed


def _report_hard_death(signum: int | None, states: list[dict], removed: list[str], code: int) -> int:
    """Print the one line for a run that died without cleaning up; mark the partial report."""
    from memascend.units import format_bytes

    # the dead process may have left a progress bar without its newline: start a line of our own
    print(file=sys.stderr, flush=True)

    if signum is not None:
        how = f"was killed by {signal.Signals(signum).name}"
    else:
        how = f"exited with code {code} without cleaning up (a rank was killed)"
    cleaned = f"; removed {', '.join(removed)}" if removed else ""
    full = _full_swap_filesystem(states)
    out_dir = next((st["out_dir"] for st in states if st.get("out_dir")), None)
    _mark_report(out_dir, f"the training process {how}")
    record = f"; what ran until then is in {out_dir}/report.json and steps.jsonl" if out_dir else ""
    if full is not None:
        path, free_bytes = full
        print(
            f"memascend: error: --nvme-path {path} is full ({format_bytes(free_bytes)} free): the training "
            f"process {how} while swapping{cleaned}; free space there (or use a larger disk) and resume from "
            f"the last complete checkpoint{record}",
            file=sys.stderr,
            flush=True,
        )
        return 3
    hint = " (out of memory? see `dmesg | grep -i oom`)" if signum == signal.SIGKILL else ""
    print(f"memascend: error: the training process {how}{hint}{cleaned}{record}", file=sys.stderr, flush=True)
    return 128 + signum if signum is not None else (code or 1)


def _full_swap_filesystem(states: list[dict]) -> tuple[str, int] | None:
    for st in states:
        nvme_path = st.get("nvme_path")
        if nvme_path and Path(nvme_path).is_dir():
            free_bytes = shutil.disk_usage(nvme_path).free
            if free_bytes < FULL_DISK_FREE_BYTES:
                return nvme_path, free_bytes
    return None


def _mark_report(out_dir: str | None, error: str) -> None:
    """Set ``status: killed`` in a partial report the dead run left (a complete one is kept), with
    the memory peaks of the whole run: the partial report holds those of its last write (the end of
    the set-up or of the last step), the timeline rank 0 streamed holds every sample up to the kill."""
    if not out_dir:
        return
    from memascend.train.run_log import REPORT, TIMELINE_CSV, write_json_atomic

    path = Path(out_dir) / REPORT
    with contextlib.suppress(OSError, ValueError):
        rep = json.loads(path.read_text())
        if rep.get("complete") is False:
            rep.update(status="killed", error=error)
            peaks = timeline_peaks(Path(out_dir) / TIMELINE_CSV)
            if peaks is not None and isinstance(rep.get("memory"), dict):
                rep["memory"] = merge_peaks(rep["memory"], peaks)
            write_json_atomic(path, rep)


def timeline_peaks(csv_path: Path) -> dict | None:
    """The peaks of a streamed memory timeline (``memory_timeline.csv``), named as the sampler's
    summary names them (``peak_rss_bytes`` = max of the ``hwm_bytes`` and ``rss_bytes`` columns,
    ``peak_sampled_rss_bytes``, ``peak_uss_bytes``, ``peak_locked_bytes``, per-phase
    ``phase_peak_rss_bytes`` / ``phase_peak_locked_bytes``, ``num_samples``; bytes).

    Returns ``None`` without a readable timeline. A row cut short by the kill is skipped.
    """
    try:
        lines = csv_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    if len(lines) < 2:
        return None
    cols = lines[0].split(",")
    if not {"phase", "rss_bytes", "hwm_bytes", "locked_bytes"} <= set(cols):
        return None
    at = {name: cols.index(name) for name in cols}
    out = {"peak_rss_bytes": 0, "peak_sampled_rss_bytes": 0, "peak_uss_bytes": 0, "peak_locked_bytes": 0,
           "phase_peak_rss_bytes": {}, "phase_peak_locked_bytes": {}, "num_samples": 0}
    for line in lines[1:]:
        cells = line.split(",")
        if len(cells) != len(cols):
            continue
        try:
            rss, hwm, locked = (int(cells[at[c]]) for c in ("rss_bytes", "hwm_bytes", "locked_bytes"))
            uss = int(cells[at["uss_bytes"]]) if "uss_bytes" in at and cells[at["uss_bytes"]] else 0
        except ValueError:
            continue
        phase = cells[at["phase"]]
        out["peak_rss_bytes"] = max(out["peak_rss_bytes"], hwm, rss)
        out["peak_sampled_rss_bytes"] = max(out["peak_sampled_rss_bytes"], rss)
        out["peak_uss_bytes"] = max(out["peak_uss_bytes"], uss)
        out["peak_locked_bytes"] = max(out["peak_locked_bytes"], locked)
        out["phase_peak_rss_bytes"][phase] = max(out["phase_peak_rss_bytes"].get(phase, 0), rss)
        out["phase_peak_locked_bytes"][phase] = max(out["phase_peak_locked_bytes"].get(phase, 0), locked)
        out["num_samples"] += 1
    return out if out["num_samples"] else None


def merge_peaks(memory: dict, peaks: dict) -> dict:
    """``memory`` (a report's ``"memory"``) with each peak raised to ``peaks``' where that is higher
    (numbers: the larger; per-phase dicts: per phase)."""
    merged = dict(memory)
    for key, value in peaks.items():
        old = merged.get(key)
        if isinstance(value, dict):
            old = old if isinstance(old, dict) else {}
            merged[key] = {**old, **{ph: max(v, old.get(ph) or 0) for ph, v in value.items()}}
        else:
            merged[key] = max(value, old) if isinstance(old, int | float) else value
    return merged
