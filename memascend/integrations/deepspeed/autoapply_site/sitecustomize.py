"""Start-up hook of ``memascend run`` (its folder is put first on ``PYTHONPATH``; Python's ``site``
imports this module at start-up).

Standard library only, and nothing at all unless ``MEMASCEND_AUTOAPPLY`` is ``1``: then one finder
on ``sys.meta_path`` waits for ``import deepspeed`` and, once DeepSpeed's package has loaded, hands
over to ``memascend.integrations.deepspeed.autoapply.install`` (which applies memascend only to a
job whose DeepSpeed config has a ``"memascend"`` section). A ``sitecustomize`` that this one
shadows (the next one on ``sys.path``) runs afterwards as it would have without this folder.
"""

import os
import sys

_ENV_VAR = "MEMASCEND_AUTOAPPLY"
_HERE = os.path.dirname(os.path.abspath(__file__))


class DeepSpeedImportHook:
    """A meta-path finder that only answers for ``deepspeed``: it lets the other finders find the
    package and runs :meth:`loaded` right after the package's ``__init__`` has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_install(module):
            try:
                exec_module(module)
            finally:
                loader.__dict__.pop("exec_module", None)
            self.loaded()

        try:
            loader.exec_module = exec_then_install  # this spec's loader only, until it has run
        except AttributeError:  # a loader that takes no attributes: DeepSpeed loads as it is
            return spec
        return spec

    def loaded(self):
        """Install memascend's wrappers on the DeepSpeed just loaded; if memascend cannot be imported
        in this Python, say so in one line (rank 0) and let DeepSpeed run as it is."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            from memascend.integrations.deepspeed import autoapply

            autoapply.install()
        except Exception as exc:  # the job itself must not fail here: it runs as it would without memascend
            if os.environ.get("RANK", "0") == "0":
                print(f"memascend: warning: memascend run: memascend cannot hook DeepSpeed in {sys.executable} "
                      f"({type(exc).__name__}: {exc}); DeepSpeed runs without it (install memascend into this "
                      "Python environment)", file=sys.stderr, flush=True)


def _run_shadowed_sitecustomize():
    """Run the ``sitecustomize`` module this one hides, if there is one further along ``sys.path``."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if os.environ.get(_ENV_VAR) == "1" and "deepspeed" not in sys.modules:
    sys.meta_path.insert(0, DeepSpeedImportHook())
_run_shadowed_sitecustomize()
