"""Build locks left by killed JIT builds, live builders, and per-environment build folders
(memascend.ops.build; issue 19 item 10).

Torch's JIT build waits, silently and forever, on ``<build folder>/lock`` while it exists; a
builder killed mid-way (SIGKILL, OOM kill, a timeout) leaves it behind. These tests build a tiny
C++ library (no torch headers: ~3 s) instead of a real op.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from memascend.ops import build

TINY_SOURCE = 'extern "C" int memascend_locktest_answer() { return 42; }\n'

# Loads the tiny library through torch's cpp_extension.load the way DeepSpeed's OpBuilder.jit_load
# does (no build_directory: TORCH_EXTENSIONS_DIR/<name>), after memascend's configure_builds().
_LOAD_TINY = r"""
import sys
from memascend.ops.build import configure_builds
configure_builds()
from torch.utils import cpp_extension
path = cpp_extension.load(name="memascend_locktest", sources=[sys.argv[1]], is_python_module=False, verbose=False)
print("loaded", path)
"""


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **extra}
    return env


@pytest.fixture()
def tiny_source(tmp_path) -> Path:
    src = tmp_path / "tiny.cpp"
    src.write_text(TINY_SOURCE)
    return src


def test_stale_lock_of_a_killed_build_is_removed_and_the_op_built(tmp_path, tiny_source):
    """A lock no process holds (what SIGKILL during a build leaves): the load removes it with one
    line naming it and builds, instead of waiting forever (stock torch/DeepSpeed hang here)."""
    ext = tmp_path / "ext"
    lock = ext / "memascend_locktest" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    proc = subprocess.run([sys.executable, "-c", _LOAD_TINY, str(tiny_source)], capture_output=True, text=True,
                          timeout=120, env=_env(TORCH_EXTENSIONS_DIR=str(ext)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded" in proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memascend:")]
    assert lines == [f"memascend: removed the stale build lock {lock} (a build of memascend_locktest was killed); "
                     "building it again"]
    assert not lock.exists()
    assert (ext / "memascend_locktest" / "memascend_locktest.so").is_file()


def test_build_killed_mid_way_then_next_load_recovers(tmp_path, tiny_source):
    """The real sequence: a builder is SIGKILLed while it holds torch's lock; the next load
    finishes within seconds."""
    ext = tmp_path / "ext"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import os, sys, time; os.makedirs(sys.argv[1], exist_ok=True); "
         "fd = os.open(os.path.join(sys.argv[1], 'lock'), os.O_CREAT | os.O_EXCL); print('held', flush=True); "
         "time.sleep(600)", str(ext / "memascend_locktest")],
        stdout=subprocess.PIPE, text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    assert (ext / "memascend_locktest" / "lock").exists()
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _LOAD_TINY, str(tiny_source)], capture_output=True, text=True,
                          timeout=120, env=_env(TORCH_EXTENSIONS_DIR=str(ext)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "removed the stale build lock" in proc.stderr
    assert time.monotonic() - start < 60


def _run_guard(name: str, build_dir: Path, done: list, **kw) -> None:
    try:
        with build.guarded_build(name, build_dir, **kw):
            done.append(time.monotonic())
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        done.append(exc)


def test_live_torch_builder_is_waited_for_by_pid_then_its_death_is_recovered(tmp_path, capfd):
    """A process holding torch's lock open is a live build: the guard says once which pid it waits
    for and waits; when that builder is killed, the guard removes the lock and goes on."""
    build_dir = tmp_path / "op"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import os, sys, time; os.makedirs(sys.argv[1], exist_ok=True); "
         "fd = os.open(os.path.join(sys.argv[1], 'lock'), os.O_CREAT | os.O_EXCL); print('held', flush=True); "
         "time.sleep(600)", str(build_dir)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        done: list = []
        thread = threading.Thread(target=_run_guard, args=("fake_op", build_dir, done),
                                  kwargs={"poll_s": 0.05, "confirm_s": 0.2}, daemon=True)
        thread.start()
        time.sleep(1.5)
        assert done == []  # still waiting: the builder is alive
        killed = time.monotonic()
        holder.kill()
        holder.wait()
        thread.join(timeout=10)
        assert not thread.is_alive() and len(done) == 1 and isinstance(done[0], float), done
        assert done[0] - killed < 5
    finally:
        if holder.poll() is None:
            holder.kill()
    err = capfd.readouterr().err.splitlines()
    assert err == [
        f"memascend: waiting for the build of fake_op by pid {holder.pid} ({build_dir / 'lock'})",
        f"memascend: removed the stale build lock {build_dir / 'lock'} (a build of fake_op was killed); "
        "building it again",
    ]


def test_another_memascend_builder_is_waited_for_by_pid(tmp_path, capfd):
    """Two memascend processes building one op: the second says once whose build it waits for and
    proceeds when the first finishes (a torch lock the first removed in the meantime is no issue)."""
    build_dir = tmp_path / "op"
    first = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from memascend.ops import build\n"
         "with build.guarded_build('fake_op', Path(sys.argv[1])):\n"
         "    print('building', flush=True); time.sleep(2.5)", str(build_dir)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert first.stdout.readline().strip() == "building"
        done: list = []
        start = time.monotonic()
        _run_guard("fake_op", build_dir, done, quiet_s=0.3, poll_s=0.05)
        assert len(done) == 1 and isinstance(done[0], float), done
        assert 1.0 < done[0] - start < 10
        assert first.wait(timeout=30) == 0
    finally:
        if first.poll() is None:
            first.kill()
    err = capfd.readouterr().err.splitlines()
    assert err == [f"memascend: waiting for the build of fake_op by pid {first.pid} ({build_dir})"]


def test_find_build_locks_tells_stale_from_live(tmp_path):
    stale = tmp_path / "py311_cpu" / "async_io" / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()
    live_dir = tmp_path / "cpu_adam"
    live_dir.mkdir()
    fd = os.open(live_dir / "lock", os.O_CREAT | os.O_EXCL)
    try:
        holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=live_dir)
        try:
            time.sleep(0.3)
            states = {s.lock_path: s for s in build.find_build_locks([tmp_path])}
        finally:
            holder.kill()
            holder.wait()
    finally:
        os.close(fd)
    assert set(states) == {stale, live_dir / "lock"}
    assert states[stale].stale and not states[live_dir / "lock"].stale
    assert holder.pid in states[live_dir / "lock"].live_pids


def test_environments_get_their_own_build_folders():
    base = {"executable": "/usr/bin/python3", "prefix": "/usr", "python_version": "3.11.7 (main)",
            "torch_version": "2.13.0", "deepspeed_version": "0.19.8"}
    key = build.build_env_key(**base)
    assert key == build.build_env_key(**base)
    assert key.startswith("py311-torch2.13.0-ds0.19.8-")
    others = [
        {**base, "executable": "/opt/venv/bin/python3", "prefix": "/opt/venv"},  # a venv on the same interpreter
        {**base, "python_version": "3.12.1 (main)"},
        {**base, "torch_version": "2.12.0"},
        {**base, "torch_version": "2.13.0+cuda12.8"},
        {**base, "deepspeed_version": "0.18.0"},
    ]
    keys = {build.build_env_key(**o) for o in others}
    assert len(keys) == len(others) and key not in keys


def test_configure_builds_sets_a_keyed_folder_that_child_processes_share(tmp_path):
    """Without TORCH_EXTENSIONS_DIR, a process (and torchrun's ranks, which inherit the variable)
    builds DeepSpeed's ops under ~/.cache/memascend/torch_extensions/<key>; a user's setting wins."""
    env = {k: v for k, v in _env(HOME=str(tmp_path)).items() if k not in ("TORCH_EXTENSIONS_DIR", "MEMASCEND_EXT_DIR")}
    code = ("import os, subprocess, sys; from memascend.ops import build; build.configure_builds(); "
            "print(os.environ['TORCH_EXTENSIONS_DIR']); print(build.ext_cache_dir()); sys.stdout.flush(); "
            "subprocess.run([sys.executable, '-c', 'from memascend.ops import build; "
            "print(build.torch_extensions_dir())'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    torch_dir, ext_dir, child_dir = out.stdout.split()
    key = Path(torch_dir).name
    assert torch_dir == str(tmp_path / ".cache" / "memascend" / "torch_extensions" / key)
    assert ext_dir == str(tmp_path / ".cache" / "memascend" / "ext" / key)
    assert child_dir == torch_dir
    mine = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**env, "TORCH_EXTENSIONS_DIR": str(tmp_path / "mine")})
    assert mine.stdout.split()[0] == str(tmp_path / "mine")


def test_build_module_loaded_twice_wraps_torch_load_once(monkeypatch):
    """``python3 -m memascend.ops.build`` runs this module as __main__ while the op loaders import
    it again: the second configure_builds must not wrap the wrapper (it would wait on itself)."""
    import importlib.util

    from torch.utils import cpp_extension

    spec = importlib.util.spec_from_file_location("memascend_build_second_copy", build.__file__)
    second = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, second)
    spec.loader.exec_module(second)
    build.configure_builds()
    second.configure_builds()
    assert cpp_extension.load.memascend_guarded
    assert not getattr(cpp_extension.load.__wrapped__, "memascend_guarded", False)


TINY_MODULE_SOURCE = """#include <Python.h>
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "memascend_locktest2", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_memascend_locktest2(void) { return PyModule_Create(&tiny); }
"""


def test_memascend_op_load_recovers_from_a_stale_lock(tmp_path):
    """memascend's own loader (load_op, builds under ext_cache_dir()) goes through the same guard."""
    src = tmp_path / "tiny_module.cpp"
    src.write_text(TINY_MODULE_SOURCE)
    ext = tmp_path / "ext"
    os.environ["MEMASCEND_EXT_DIR"] = str(ext)
    try:
        lock = build.op_build_dir("locktest2", (str(src),)) / "lock"
    finally:
        del os.environ["MEMASCEND_EXT_DIR"]
    lock.parent.mkdir(parents=True)
    lock.touch()
    code = ("import sys; from memascend.ops.build import load_op; "
            "m = load_op('locktest2', (sys.argv[1],)); print('loaded', m.__name__)")
    proc = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, timeout=120,
                          env=_env(MEMASCEND_EXT_DIR=str(ext)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["loaded", "memascend_locktest2"]
    assert f"memascend: removed the stale build lock {lock}" in proc.stderr
    assert not lock.exists()


def test_sigterm_while_waiting_for_a_build_is_honoured(tmp_path):
    """A run waiting for another process's build stops at once on SIGTERM (the waits sleep in
    Python, where memascend's handler turns the signal into KeyboardInterrupt)."""
    build_dir = tmp_path / "op"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import os, sys, time; os.makedirs(sys.argv[1], exist_ok=True); "
         "fd = os.open(os.path.join(sys.argv[1], 'lock'), os.O_CREAT | os.O_EXCL); print('held', flush=True); "
         "time.sleep(600)", str(build_dir)],
        stdout=subprocess.PIPE, text=True,
    )
    code = ("import sys; from pathlib import Path; from memascend.ops.build import guarded_build; "
            "from memascend.train.swapdir import TerminationAsInterrupt\n"
            "try:\n"
            "    with TerminationAsInterrupt(), guarded_build('fake_op', Path(sys.argv[1])):\n"
            "        print('built')\n"
            "except KeyboardInterrupt:\n"
            "    print('interrupted')\n")
    try:
        assert holder.stdout.readline().strip() == "held"
        waiter = subprocess.Popen([sys.executable, "-c", code, str(build_dir)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            line = waiter.stderr.readline()  # says whose build it waits for
            assert line.startswith("memascend: waiting for the build of fake_op by pid"), line
            sent = time.monotonic()
            waiter.send_signal(signal.SIGTERM)
            out, _ = waiter.communicate(timeout=30)
            assert time.monotonic() - sent < 3
            assert out.strip() == "interrupted" and waiter.returncode == 0
        finally:
            if waiter.poll() is None:
                waiter.kill()
    finally:
        holder.kill()
        holder.wait()
    assert (build_dir / "lock").exists()  # a live builder's lock is never touched
