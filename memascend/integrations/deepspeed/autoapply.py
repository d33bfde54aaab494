"""memascend for a DeepSpeed job that asks for it in its config, with no line added to the job's code.

``memascend run -- COMMAND...`` starts COMMAND with :data:`ENV_VAR` set to ``1`` and :data:`SITE_DIR`
first on ``PYTHONPATH`` (:func:`child_env`). Every Python process of the job -- the launcher
(torchrun, ``deepspeed``, ``accelerate launch``) and the ranks it starts, which inherit the
environment -- then runs ``SITE_DIR/sitecustomize.py`` at start-up. That file (standard library only)
does nothing unless :data:`ENV_VAR` is ``1``; then it waits for ``import deepspeed`` and, once
DeepSpeed's package has loaded, calls :func:`install`. A process that never imports DeepSpeed pays
one import-path lookup at start-up and nothing after.

:func:`install` wraps the two places where DeepSpeed 0.19.8 first receives the job's config:

* ``deepspeed.zero.Init.__init__`` (``runtime.zero.partition_parameters.Init``): its
  ``config_dict_or_path`` (or the older ``config``). Hugging Face's ``from_pretrained`` builds the
  model under ``deepspeed.zero.Init(config_dict_or_path=deepspeed_config())`` when the Trainer's
  arguments name a ZeRO-3 config (HF Trainer, TRL, LLaMA-Factory, axolotl, accelerate), so this is
  where the parameter swapper is made, before any parameter exists;
* ``deepspeed.initialize`` (the ``deepspeed`` module's attribute, which transformers and accelerate
  look up at call time): its ``config``, ``config_params`` or ``args.deepspeed_config``. A model
  built outside ``zero.Init`` is partitioned here.

When that config -- a dict, a JSON file path, or DeepSpeed's base64 form -- holds a ``"memascend"``
section, the wrapper applies memascend with the section's settings (as
:func:`memascend.integrations.deepspeed.apply_from_config`) before DeepSpeed reads the config, and
rank 0 prints one line on stderr (:func:`applied_line`). A config without the section passes
through untouched; settings already applied (a script's own ``apply_from_config``) are left as
they are. ``revert()`` undoes what was applied, exactly as for a script that applied it itself; the
two wrappers stay (they pass everything through) until :func:`uninstall`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from memascend.config import DS_CONFIG_SECTION, MemAscendSettings
from memascend.errors import UserError

__all__ = ["ENV_VAR", "SITE_DIR", "applied_line", "child_env", "install", "installed", "section_of",
           "uninstall"]

ENV_VAR = "MEMASCEND_AUTOAPPLY"
"""Set to ``1`` by ``memascend run``: the start-up hook of :data:`SITE_DIR` is active in this process."""

SITE_DIR = Path(__file__).resolve().with_name("autoapply_site")
"""The folder ``memascend run`` puts first on ``PYTHONPATH``: it holds only ``sitecustomize.py``."""

_lock = threading.Lock()
_originals: dict[str, Any] = {}
"""``"initialize"`` / ``"Init.__init__"`` -> DeepSpeed's own function while :func:`install` is in force."""
_forwarding = threading.local()


def child_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with :data:`ENV_VAR` = ``1`` and :data:`SITE_DIR` first on ``PYTHONPATH``
    (once: an entry already there moves to the front; empty entries are dropped, since an empty
    entry means the working directory)."""
    site = str(SITE_DIR)
    rest = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    return {**environ, ENV_VAR: "1", "PYTHONPATH": os.pathsep.join([site, *rest])}


def _decode(config: str) -> dict | None:
    """A JSON file path, or DeepSpeed's base64-encoded JSON (``DeepSpeedConfig`` accepts both)."""
    try:
        if Path(config).is_file():
            return json.loads(Path(config).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    try:
        return json.loads(base64.urlsafe_b64decode(config).decode("utf-8"))
    except (binascii.Error, ValueError):
        return None


def section_of(config: Any) -> Any:
    """The ``"memascend"`` section of a DeepSpeed config given to DeepSpeed, or ``None``.

    Args:
        config: a mapping, a JSON file path (``str`` or ``os.PathLike``), DeepSpeed's base64 form,
            or anything else DeepSpeed may get (``None``, a config object): no section.

    Returns:
        The section's value as given (validated when it is applied); ``None`` when the config has
        none or cannot be read here (DeepSpeed then reports a config it cannot read itself).
    """
    if isinstance(config, os.PathLike):
        config = os.fspath(config)
    if isinstance(config, str):
        config = _decode(config)
    if not isinstance(config, Mapping):
        return None
    return config.get(DS_CONFIG_SECTION)


def _describe(settings: MemAscendSettings) -> str:
    defaults = MemAscendSettings()
    changed = [f"{f.name}={json.dumps(getattr(settings, f.name))}" for f in dataclasses.fields(settings)
               if getattr(settings, f.name) != getattr(defaults, f.name)]
    return "defaults (every optimization on)" if not changed else "defaults except " + ", ".join(changed)


def applied_line(settings: MemAscendSettings, where: str, world_size: int) -> str:
    """The one stderr line a job's rank 0 prints when the start-up hook applied memascend.

    Args:
        settings: the settings applied.
        where: the DeepSpeed call whose config held the section (``deepspeed.zero.Init``).
        world_size: ranks of the job (``WORLD_SIZE``).
    """
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    return (f'memascend: applied to DeepSpeed ({ranks}; the "{DS_CONFIG_SECTION}" section of the config given to '
            f"{where}): settings: {_describe(settings)}")


def _apply_section(section: Any, where: str) -> None:
    """Apply the settings of ``section`` unless memascend is applied already; rank 0 says so.

    A section that does not parse, or settings the host cannot apply, end the process with one
    ``memascend: error: ...`` line and exit code 2 (the job asked for memascend and would otherwise
    train without it)."""
    import memascend.integrations.deepspeed as ma_ds

    if ma_ds.applied_settings() is not None:
        return
    rank0 = os.environ.get("RANK", "0") == "0"
    if not rank0:  # the enable_torch_thp notice, like the line below, once per job
        ma_ds._warn_torch_thp.done = True  # type: ignore[attr-defined]
    try:
        settings = ma_ds.apply(MemAscendSettings.from_mapping(section))
    except UserError as exc:
        print(f"memascend: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None
    if rank0:
        world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        print(applied_line(settings, where, world_size), file=sys.stderr, flush=True)


def _memascend_applied() -> bool:
    seam = sys.modules.get("memascend.integrations.deepspeed")
    return seam is not None and seam.applied_settings() is not None


def _bound(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name; empty when they do not fit (DeepSpeed then raises its own error)."""
    try:
        return dict(signature.bind(*args, **kwargs).arguments)
    except TypeError:
        return {}


def _initialize_config(arguments: dict[str, Any]) -> Any:
    for key in ("config", "config_params"):
        if arguments.get(key) is not None:
            return arguments[key]
    return getattr(arguments.get("args"), "deepspeed_config", None)


def make_initialize(original: Callable[..., Any], module: Any) -> Callable[..., Any]:
    """``deepspeed.initialize`` that applies a config's section first.

    Once memascend is applied (here or earlier), the call goes on through ``module.initialize`` as
    it is now -- the seam's own wrapper, which sizes the ``"auto"`` settings from the model -- and
    that wrapper's call back into this one reaches ``original``.

    Args:
        original: DeepSpeed's ``deepspeed.initialize``.
        module: the ``deepspeed`` module (where callers look ``initialize`` up).
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        if getattr(_forwarding, "active", False) or not _originals:
            return original(*args, **kwargs)
        section = section_of(_initialize_config(_bound(signature, args, kwargs)))
        if section is not None:
            _apply_section(section, "deepspeed.initialize")
        current = getattr(module, "initialize", initialize)
        if current is initialize or not _memascend_applied():
            return original(*args, **kwargs)
        _forwarding.active = True
        try:
            return current(*args, **kwargs)
        finally:
            _forwarding.active = False

    return initialize


def make_init(original: Callable[..., None]) -> Callable[..., None]:
    """``deepspeed.zero.Init.__init__`` that applies a config's section before the context is made
    (and with it the parameter swapper).

    Args:
        original: DeepSpeed's ``Init.__init__``.
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        arguments = _bound(signature, (self, *args), kwargs) if _originals else {}
        config = arguments.get("config_dict_or_path")
        section = section_of(config if config is not None else arguments.get("config"))
        if section is not None:
            _apply_section(section, "deepspeed.zero.Init")
        original(self, *args, **kwargs)

    return __init__


def install() -> None:
    """Wrap ``deepspeed.initialize`` and ``deepspeed.zero.Init.__init__`` (see the module doc).

    Idempotent. Imports DeepSpeed (the start-up hook calls it once DeepSpeed has loaded).
    """
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import Init

    with _lock:
        if _originals:
            return
        _originals["initialize"] = deepspeed.initialize
        _originals["Init.__init__"] = Init.__dict__["__init__"]
        deepspeed.initialize = make_initialize(deepspeed.initialize, deepspeed)
        Init.__init__ = make_init(Init.__dict__["__init__"])


def uninstall() -> None:
    """Put DeepSpeed's own ``deepspeed.initialize`` and ``Init.__init__`` back (``is``-identical).

    Safe without :func:`install`. Settings already applied stay applied (``revert()`` undoes them).
    A ``deepspeed.initialize`` patched over the wrapper since (memascend applied) is restored by
    ``revert()`` to the wrapper, which then passes everything through to DeepSpeed.
    """
    with _lock:
        if not _originals:
            return
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import Init

        if deepspeed.initialize is not _originals["initialize"] and getattr(
                deepspeed.initialize, "__wrapped__", None) is _originals["initialize"]:
            deepspeed.initialize = _originals["initialize"]
        Init.__init__ = _originals["Init.__init__"]
        _originals.clear()


def installed() -> bool:
    """Whether :func:`install` is in force."""
    return bool(_originals)
