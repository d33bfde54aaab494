"""Build-or-load of the C++/CUDA extensions in ``csrc/``, and safe JIT builds for DeepSpeed's ops.

This module imports nothing of memascend's other layers (``host``, ``io``, ``integrations``):
building DeepSpeed's own ops (``async_io``, ``cpu_adam``, ...) ahead of use is
:mod:`memascend.integrations.deepspeed.ops_build`, behind the seam.

An op is looked up in this order:
1. a prebuilt module ``memascend_<op>`` importable from ``sys.path`` or from
   ``$MEMASCEND_PREBUILT_DIR`` (the container image builds these ahead of time);
2. a JIT build with :func:`torch.utils.cpp_extension.load` (ninja), cached under
   ``$MEMASCEND_EXT_DIR`` (default ``~/.cache/memascend/ext/<environment key>``) so later
   processes reuse it.

CUDA sources (``*.cu``) are compiled only when torch was built with CUDA and ``nvcc`` is found;
the C++ part of an op must therefore work on its own (CPU-only hosts).

Build folders per environment: a build is specific to the interpreter, torch (and its CUDA) and
DeepSpeed it was compiled against, and torch's JIT reuses a build folder whatever the torch
version. :func:`configure_builds` therefore points ``TORCH_EXTENSIONS_DIR`` (DeepSpeed's JIT ops:
async_io, cpu_adam, shm_comm, ...) at ``~/.cache/memascend/torch_extensions/<environment key>``
when the user has not set it, as every training rank, ``python3 -m memascend.ops.build``
and memascend's own ops do; the key (:func:`build_env_key`) hashes the interpreter
path, ``sys.prefix`` (a venv), the Python, torch/CUDA and DeepSpeed versions.

Stale build locks: torch's JIT build holds a lock file ``<build folder>/lock``
(:class:`torch.utils.file_baton.FileBaton`) and every other process waits, polling, until it is
gone. A builder killed mid-way (SIGKILL, an OOM kill, a timeout) leaves it, and every later
process then waits forever without a word. :func:`guarded_build` (wrapped around every
``cpp_extension.load`` of the process by :func:`configure_builds`) serialises memascend's builders
on a ``flock`` of ``<build folder>/memascend-build.pid`` (released by the kernel when its
holder dies; holds the holder's pid), says once which pid it is waiting for, and removes torch's
lock when no process holds it open (FileBaton keeps it open for the whole build) and none works
in the build folder (ninja and the compilers run there), checked twice 0.5 s apart. Processes on
other hosts are not seen: hosts sharing a home folder (NFS) need their own ``TORCH_EXTENSIONS_DIR``
(builds use ``-march=native`` and are host-specific anyway).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
import importlib.metadata
import inspect
import os
import pkgutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from memascend.procfs import has_open

CSRC_DIR = Path(__file__).resolve().parent.parent.parent / "csrc"
_NOT_OPS = {"build"}


class OpBuildError(RuntimeError):
    """Raised when an op can be neither imported prebuilt nor built."""


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def build_env_key(
    *,
    executable: str | None = None,
    prefix: str | None = None,
    python_version: str | None = None,
    torch_version: str | None = None,
    deepspeed_version: str | None = None,
) -> str:
    """Name of this environment's build folders: ``py<XY>-torch<V>-ds<V>-<hash>``.

    Args:
        executable, prefix, python_version, torch_version, deepspeed_version: the inputs
            (default: this process's ``sys.executable`` with links resolved (``python3`` and
            ``python3.11`` are one interpreter), ``sys.prefix`` (tells venvs of one interpreter
            apart), ``sys.version``, torch's version and CUDA version, DeepSpeed's version or
            ``none``).

    Returns:
        A folder name; two environments differing in any input get different names.
    """
    if torch_version is None:
        import torch

        torch_version = f"{torch.__version__}+cuda{torch.version.cuda}" if torch.version.cuda else torch.__version__
    inputs = (
        os.path.realpath(executable if executable is not None else sys.executable),
        os.path.abspath(prefix if prefix is not None else sys.prefix),
        python_version if python_version is not None else sys.version,
        torch_version,
        deepspeed_version if deepspeed_version is not None else _package_version("deepspeed"),
    )
    digest = hashlib.sha256("\0".join(inputs).encode()).hexdigest()[:12]
    py = "".join(inputs[2].split()[0].split(".")[:2])
    short_torch = torch_version.split("+")[0]
    return f"py{py}-torch{short_torch}-ds{inputs[4]}-{digest}"


@functools.cache
def _this_env_key() -> str:
    return build_env_key()


def _cache_root() -> Path:
    return Path.home() / ".cache" / "memascend"


def ext_cache_dir(*, create: bool = True) -> Path:
    """Folder holding memascend's JIT-built extensions: ``$MEMASCEND_EXT_DIR`` or
    ``~/.cache/memascend/ext/<build_env_key()>`` (created on demand with ``create``)."""
    env = os.environ.get("MEMASCEND_EXT_DIR")
    root = Path(env) if env else _cache_root() / "ext" / _this_env_key()
    if create:
        root.mkdir(parents=True, exist_ok=True)
    return root


def torch_extensions_dir() -> Path:
    """Where torch's JIT builds (DeepSpeed's ops) go: ``$TORCH_EXTENSIONS_DIR`` when set, else
    ``~/.cache/memascend/torch_extensions/<build_env_key()>`` (what :func:`configure_builds` sets)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(env) if env else _cache_root() / "torch_extensions" / _this_env_key()


def configure_builds() -> Path:
    """Keep this environment's JIT builds apart and guard every build of this process.

    Sets ``TORCH_EXTENSIONS_DIR`` to :func:`torch_extensions_dir` unless the user set it (child
    processes, e.g. torchrun's ranks, inherit it), and wraps :func:`torch.utils.cpp_extension.load`
    (which DeepSpeed's ``OpBuilder.jit_load`` looks up at each call) in :func:`guarded_build`.
    Idempotent.

    Returns:
        The torch extensions folder in use.
    """
    root = torch_extensions_dir()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(root))
    from torch.utils import cpp_extension

    # Marked on torch's function itself: this module may be loaded twice (``python3 -m
    # memascend.ops.build`` runs it as __main__ too), and a second wrapper would wait on the first.
    if not getattr(cpp_extension.load, "memascend_guarded", False):
        original = cpp_extension.load

        signature = inspect.signature(original)

        @functools.wraps(original)
        def load(name, sources, *args, **kwargs):
            build_dir = signature.bind(name, sources, *args, **kwargs).arguments.get("build_directory")
            if build_dir is None:
                build_dir = _default_build_directory(name)
            with guarded_build(name, Path(build_dir)):
                return original(name, sources, *args, **kwargs)

        load.memascend_guarded = True
        cpp_extension.load = load
    return root


def _default_build_directory(name: str) -> str:
    """The folder torch's ``load`` builds ``name`` in when not given one (created)."""
    from torch.utils import cpp_extension

    getter = getattr(cpp_extension, "_get_build_directory", None)
    if getter is not None:
        return getter(name, False)
    path = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


# ---- build locks --------------------------------------------------------------------------------

#: Torch's lock file in a build folder (FileBaton).
TORCH_LOCK_NAME = "lock"
#: memascend's builder lock beside it: flock-ed by the process building, holds its pid.
OWNER_LOCK_NAME = "memascend-build.pid"


@dataclass(frozen=True)
class LockState:
    """What holds torch's lock file of one build folder.

    Attributes:
        lock_path: ``<build folder>/lock``.
        live_pids: processes that have the lock file open (the builder) or work in the build folder
            (ninja, the compilers); empty when none does.
        owner_pid: the memascend builder holding the folder's ``flock``, or ``None``.
        age_s: seconds since the lock file was created.
    """

    lock_path: Path
    live_pids: tuple[int, ...]
    owner_pid: int | None
    age_s: float

    @property
    def stale(self) -> bool:
        """True when nothing is building: the lock was left by a killed build."""
        return not self.live_pids and self.owner_pid is None


def _processes_using(build_dir: Path, lock_stat: os.stat_result | None, proc: Path = Path("/proc")) -> list[int]:
    """Pids (other than this one) with ``build_dir`` (or a folder in it) as working directory or
    the lock file (same device and inode) open. Processes whose /proc entries this user cannot
    read are not seen (another user's build in this user's folder)."""
    me = os.getpid()
    target = os.path.realpath(build_dir)
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd == target or cwd.startswith(target + os.sep):
            found.append(int(entry.name))
            continue
        if lock_stat is not None and has_open(entry, lock_stat):
            found.append(int(entry.name))
    return found


def _owner_pid(build_dir: Path) -> int | None:
    """Pid of the live memascend builder holding ``build_dir``'s flock, or ``None``."""
    path = build_dir / OWNER_LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def lock_state(build_dir: Path) -> LockState | None:
    """The state of ``build_dir``'s torch lock, or ``None`` when there is no lock file."""
    lock = build_dir / TORCH_LOCK_NAME
    try:
        st = os.stat(lock)
    except FileNotFoundError:
        return None
    return LockState(lock, tuple(_processes_using(build_dir, st)), _owner_pid(build_dir), max(0.0, time.time() - st.st_mtime))


def find_build_locks(roots: list[Path]) -> list[LockState]:
    """Torch lock files under build roots (``<root>/<op>/lock`` and torch's default layout
    ``<root>/py<XY>_<accel>/<op>/lock``), with what holds each."""
    states = []
    for root in roots:
        if not root.is_dir():
            continue
        for lock in sorted({*root.glob(f"*/{TORCH_LOCK_NAME}"), *root.glob(f"*/*/{TORCH_LOCK_NAME}")}):
            state = lock_state(lock.parent)
            if state is not None:
                states.append(state)
    return states


def _say(message: str) -> None:
    print(f"memascend: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def guarded_build(name: str, build_dir: Path, *, quiet_s: float = 2.0, poll_s: float = 0.1,
                  confirm_s: float = 0.5) -> Iterator[None]:
    """Hold ``build_dir`` for one ``cpp_extension.load`` of op ``name``; clear a stale torch lock first.

    1. Takes the folder's ``flock`` (``memascend-build.pid``), polling; after ``quiet_s`` says once
       ``waiting for the build of NAME by pid N``. A killed holder's flock is released by the
       kernel, so this never waits on a dead process.
    2. While torch's ``lock`` exists: if a process has it open or works in the folder (a builder
       that does not use this protocol, or ninja/compilers orphaned by a killed builder), says
       once that it waits for that pid and polls; if none does, twice ``confirm_s`` apart, the lock
       was left by a killed build: it is removed with one line naming it, and the op is built anew.

    Signals (Ctrl-C, SIGTERM through :class:`memascend.train.swapdir.TerminationAsInterrupt`)
    interrupt the waits: they sleep in Python.

    Args:
        name: the op (for the messages).
        build_dir: the folder torch builds it in (created when missing).
        quiet_s: how long to wait silently for another memascend builder before saying so.
        poll_s: seconds between polls.
        confirm_s: a lock is stale only when seen unheld this long apart.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / OWNER_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start, announced = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if not announced and time.monotonic() - start >= quiet_s:
                    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
                    _say(f"waiting for the build of {name} by pid {text or '?'} ({build_dir})")
                    announced = True
                time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _clear_torch_lock(name, build_dir, poll_s=poll_s, confirm_s=confirm_s)
        yield
    finally:
        os.close(fd)  # releases the flock


def _clear_torch_lock(name: str, build_dir: Path, *, poll_s: float, confirm_s: float) -> None:
    lock = build_dir / TORCH_LOCK_NAME
    announced_pid, unheld_since = None, None
    while True:
        try:
            st = os.stat(lock)
        except FileNotFoundError:
            return
        users = _processes_using(build_dir, st)
        if users:
            unheld_since = None
            if announced_pid is None:
                announced_pid = users[0]
                _say(f"waiting for the build of {name} by pid {users[0]} ({lock})")
        elif unheld_since is None:
            unheld_since = (time.monotonic(), st.st_ino)
        elif time.monotonic() - unheld_since[0] >= confirm_s and unheld_since[1] == st.st_ino:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)
            _say(f"removed the stale build lock {lock} (a build of {name} was killed); building it again")
            return
        time.sleep(poll_s)


def cuda_build_available() -> bool:
    """True when torch has CUDA and an nvcc is present, so ``.cu`` sources can be compiled."""
    import torch
    from torch.utils import cpp_extension

    return bool(torch.version.cuda) and cpp_extension.CUDA_HOME is not None


@functools.cache
def load_op(
    name: str,
    sources: tuple[str, ...],
    cuda_sources: tuple[str, ...] = (),
    extra_ldflags: tuple[str, ...] = (),
    extra_cflags: tuple[str, ...] = (),
) -> ModuleType:
    """Import the prebuilt extension ``memascend_<name>`` or JIT-build it.

    Args:
        name: op name; the module is ``memascend_<name>``.
        sources: C++ sources relative to ``csrc/``.
        cuda_sources: ``.cu`` sources relative to ``csrc/``, added only when
            :func:`cuda_build_available`; the build then defines ``MEMASCEND_WITH_CUDA``.
        extra_ldflags: linker flags (e.g. ``-laio``).
        extra_cflags: extra compiler flags.

    Returns:
        The loaded extension module.

    Raises:
        OpBuildError: the compiler or a library is missing; the message names the op.
    """
    mod_name = f"memascend_{name}"
    prebuilt = os.environ.get("MEMASCEND_PREBUILT_DIR")
    if prebuilt and prebuilt not in sys.path:
        sys.path.insert(0, prebuilt)
    try:
        return importlib.import_module(mod_name)
    except ImportError:
        pass

    configure_builds()
    from torch.utils import cpp_extension

    srcs, cflags, with_cuda, build_dir = _build_plan(name, sources, cuda_sources, extra_ldflags, extra_cflags)
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name=mod_name,
            sources=stage_sources(srcs, build_dir),
            extra_cflags=cflags,
            extra_cuda_cflags=["-O3", "-DMEMASCEND_WITH_CUDA"] if with_cuda else None,
            extra_ldflags=list(extra_ldflags),
            build_directory=str(build_dir),
            verbose=os.environ.get("MEMASCEND_VERBOSE_BUILD") == "1",
        )
    except Exception as exc:  # noqa: BLE001 - surfaced as one clear error
        raise OpBuildError(f"cannot build op '{name}': {str(exc).strip().splitlines()[-1]}") from exc


def _build_plan(name: str, sources: tuple[str, ...], cuda_sources: tuple[str, ...], extra_ldflags: tuple[str, ...],
                extra_cflags: tuple[str, ...]) -> tuple[list[str], list[str], bool, Path]:
    """(source paths, C++ flags, whether CUDA sources are built, build folder) of one op."""
    srcs = [str(CSRC_DIR / s) for s in sources]
    cflags = ["-O3", "-std=c++17", "-fvisibility=hidden", *extra_cflags]
    with_cuda = bool(cuda_sources) and cuda_build_available()
    if with_cuda:
        srcs += [str(CSRC_DIR / s) for s in cuda_sources]
        cflags.append("-DMEMASCEND_WITH_CUDA")
    # One folder per source content and flags, shared by every checkout (git worktree, CI clone) of
    # the same sources in one environment.
    digest = sources_digest(srcs, cflags, extra_ldflags)
    return srcs, cflags, with_cuda, ext_cache_dir(create=False) / f"memascend_{name}{'_cuda' if with_cuda else ''}-{digest}"


def _with_headers(sources: list[str]) -> set[Path]:
    """``sources`` and the headers in their folders (compiled in through ``#include "x.h"``)."""
    files = {Path(p) for p in sources}
    for src in list(files):
        files.update(q for pattern in ("*.h", "*.hpp", "*.cuh") for q in src.parent.glob(pattern) if q.is_file())
    return files


STAGED_SOURCES_DIR = "src"
"""Where an op's sources are copied inside its build folder (:func:`stage_sources`)."""


def stage_sources(sources: list[str], build_dir: Path) -> list[str]:
    """Copies of ``sources`` (and the headers beside them) inside ``build_dir``, to compile from.

    Torch writes the sources' absolute paths into the folder's ``build.ninja`` and ninja rebuilds
    whenever a command line changes: compiled from where each checkout lies, two checkouts of the
    same sources sharing the folder (it is named by content) would rebuild over each other at every
    load. Copies written only when missing or different (atomically), so their mtimes, and ninja's
    view, stay put.

    Returns:
        The copies' paths, in the order of ``sources``.
    """
    files = _with_headers(sources)
    staged_root = build_dir / STAGED_SOURCES_DIR
    for path in files:
        data = path.read_bytes()
        dst = staged_root / path.parent.name / path.name
        if dst.is_file() and dst.read_bytes() == data:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dst)
    return [str(staged_root / Path(p).parent.name / Path(p).name) for p in sources]


def op_build_dir(name: str, sources: tuple[str, ...], cuda_sources: tuple[str, ...] = (),
                 extra_ldflags: tuple[str, ...] = (), extra_cflags: tuple[str, ...] = ()) -> Path:
    """The folder :func:`load_op` JIT-builds op ``name`` in (same arguments): under
    :func:`ext_cache_dir`, named ``memascend_<name>[_cuda]-<digest of the sources' content and flags>``."""
    return _build_plan(name, sources, cuda_sources, extra_ldflags, extra_cflags)[3]


def sources_digest(sources: list[str], *flags: object) -> str:
    """A short digest of an op's sources and build flags (hex, 12 characters).

    Args:
        sources: the source files (their content counts, not their paths); the headers beside them
            count too, since they are compiled in.
        flags: compiler and linker flags.

    Returns:
        The digest: equal for the same content and flags wherever the tree lies.
    """
    h = hashlib.sha256()
    files = _with_headers(sources)
    for path in sorted(files, key=lambda q: (q.parent.name, q.name)):
        h.update(f"{path.parent.name}/{path.name}".encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr([list(f) if isinstance(f, (list, tuple)) else f for f in flags]).encode())
    return h.hexdigest()[:12]


def op_names(ops_dir: Path | None = None) -> list[str]:
    """Names of the ops: the loader modules in ``memascend/ops`` (``ops_dir``), all but ``build``,
    sorted. Each loader ``X.py`` has a ``load()`` building or importing ``memascend_X``."""
    ops_dir = ops_dir or Path(__file__).resolve().parent
    names = {m.name for m in pkgutil.iter_modules([str(ops_dir)]) if not m.name.startswith("_")} - _NOT_OPS
    return sorted(names)


def build_all() -> list[tuple[str, bool, str]]:
    """Build (or find prebuilt) every memascend op (:func:`op_names`).

    ``install.sh`` runs this (through :mod:`memascend.integrations.deepspeed.ops_build`, which also
    builds DeepSpeed's JIT ops) so that no training process compiles on first use. A first-use
    compile holds torch's build lock (``<build dir>/lock``) for a minute or more, and a process
    killed meanwhile (a memory cgroup's OOM kill, a timeout, Ctrl-C) leaves the lock behind:
    every later process that loads the op then waits on it forever.

    Returns:
        ``(name, ok, detail)`` per op (``memascend_<op>``); ``ok`` is false for an op that failed
        to build (``detail`` says why), else ``detail`` is the module's file.
    """
    configure_builds()
    results: list[tuple[str, bool, str]] = []
    for name in op_names():
        try:
            module = importlib.import_module(f"memascend.ops.{name}").load()
            results.append((f"memascend_{name}", True, str(getattr(module, "__file__", ""))))
        except OpBuildError as exc:
            results.append((f"memascend_{name}", False, str(exc)))
    return results


def report(results: list[tuple[str, bool, str]]) -> int:
    """Print one line per built op to stderr (``NAME: ok|FAILED DETAIL``); return the exit code
    (1 when one failed, else 0)."""
    failed = 0
    for name, ok, detail in results:
        print(f"{name}: {'ok' if ok else 'FAILED'} {detail}".rstrip(), file=sys.stderr)
        failed += not ok
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """``python3 -m memascend.ops.build``: build every memascend op; exit 1 if one failed, 2 on a
    usage error. DeepSpeed's ops too: ``python3 -m memascend.integrations.deepspeed.ops_build``."""
    args = sys.argv[1:] if argv is None else argv
    if args:
        print("usage: python3 -m memascend.ops.build", file=sys.stderr)
        return 2
    return report(build_all())


if __name__ == "__main__":
    from memascend.ops.build import main as _main  # one module instance (its state) for the loaders too

    raise SystemExit(_main())
