"""Instrumentation for the SIGTERM tests: marks when the training process enters a phase.

``memascend finetune`` runs the job in a child under a supervising parent
(:mod:`memascend.train.supervisor`), so the hook goes in as a ``sitecustomize`` module on
``PYTHONPATH``: in the job process only (``MEMASCEND_SUPERVISED=1``), once the named module has been
imported (never earlier: finetune sets torch's THP variable before torch loads), its function is
wrapped to run :data:`ACTION` on the first call. The work stays real; only a marker is added.
"""

from __future__ import annotations

from pathlib import Path

_SITECUSTOMIZE = r'''
import importlib.abc, importlib.util, os, signal, sys, threading, time

_MODULE, _QUALNAME, _ARG = os.environ["MEMASCEND_TEST_HOOK"].split(":")
_MARKER = os.environ["MEMASCEND_TEST_MARKER"]
_DELAY_S = float(os.environ.get("MEMASCEND_TEST_DELAY_S", "-1"))
_fired = []


def _fire():
    # Negative delay: only mark the moment (the test sends the signal). Otherwise, after the delay,
    # record the time and send SIGTERM to the supervising parent, as a user's kill would (it is
    # forwarded to this process).
    if _DELAY_S < 0:
        open(_MARKER, "w").close()
        return
    def _kill():
        time.sleep(_DELAY_S)
        with open(_MARKER, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getppid(), signal.SIGTERM)
    threading.Thread(target=_kill, daemon=True).start()


def _wrap(module):
    owner_name, _, attr = _QUALNAME.rpartition(".")
    owner = getattr(module, owner_name) if owner_name else module
    original = getattr(owner, attr)
    def hooked(*args, **kwargs):
        arg = args[1] if owner_name else (args[0] if args else None)
        if not _fired and (_ARG == "" or arg == _ARG):
            _fired.append(True)
            _fire()
        return original(*args, **kwargs)
    setattr(owner, attr, hooked)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        loader_exec = spec.loader.exec_module
        def exec_module(module):
            loader_exec(module)
            _wrap(module)
        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("MEMASCEND_SUPERVISED") == "1":
    sys.meta_path.insert(0, _Finder())
'''


def hook_env(tmp_path: Path, *, module: str, qualname: str, arg: str = "", marker: Path,
             delay_s: float | None = None) -> dict[str, str]:
    """Environment entries that install the hook in the job process.

    Args:
        module, qualname: the function to wrap (``Class.method`` wraps a method; then ``arg`` is
            compared with the first argument after ``self``, else with the first argument).
        marker: file written on the first matching call (with a delay: the time SIGTERM was sent).
        delay_s: ``None``: only mark; a number: SIGTERM the supervising parent this long after.
    """
    site = tmp_path / "sitehook"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    import os

    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p),
        "MEMASCEND_TEST_HOOK": f"{module}:{qualname}:{arg}",
        "MEMASCEND_TEST_MARKER": str(marker),
    }
    if delay_s is not None:
        env["MEMASCEND_TEST_DELAY_S"] = str(delay_s)
    return env
