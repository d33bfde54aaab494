"""Load a Hugging Face safetensors folder into a ZeRO-3 model one layer at a time.

``transformers``' ZeRO-3 path of ``from_pretrained`` (5.x, ``_load_pretrained_model``) builds the
model partitioned under ``deepspeed.zero.Init``, then reads *every* shard into one state dict on
rank 0 (``load_state_dict`` per file, merged) and only then copies module by module into the
partitions (``_load_state_dict_into_zero3_model``: ``GatheredParameters(modifier_rank=0)`` per
module). The host therefore holds the whole checkpoint's pages at once, however finely the model is
partitioned.

:func:`layerwise_zero3_loading` keeps ``from_pretrained`` (its model class, config, dtype, tied
weights, missing-key initialisation, ``eval()``, generation config) and changes only where the
tensors come from:

- every safetensors file is read as meta tensors (names, shapes and dtypes from the header; what
  ``transformers`` itself does on ranks other than 0);
- the copy into the partitions runs once per *group* of keys, a decoder layer (``model.layers.7.``)
  or one other module (``model.embed_tokens``, ``lm_head``): rank 0 opens the group's tensors with
  :func:`safetensors.safe_open` (memory-mapped, per tensor: no whole shard is read), and
  ``transformers``' own ``_load_state_dict_into_zero3_model`` copies them in (gather per module with
  ``modifier_rank=0``, copy, re-partition); the other ranks take part with meta tensors, as before;
- after each group its tensors are dropped (the mapping goes with them) and the files' cached pages
  are handed back with ``posix_fadvise(POSIX_FADV_DONTNEED)``, so neither the process (RSS) nor its
  cgroup (page cache) keeps more than about one layer of the checkpoint.

The weights are copied by the same code as stock's, from the same bytes, so the loaded model is
bit-identical to ``from_pretrained``'s (``tests/models/test_layerwise.py`` compares the gathered
state dicts: tied and untied, sharded and single-file, bf16 and fp32).

Where the two hooks are missing (another ``transformers`` layout) the context does nothing and
``from_pretrained`` loads as stock does; :func:`hooks_available` says which.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

_HOOKS = ("load_state_dict", "_load_state_dict_into_zero3_model")
"""The functions of ``transformers.modeling_utils`` the context replaces while it is open."""


def hooks_available() -> bool:
    """Whether the installed ``transformers`` has the two functions :func:`layerwise_zero3_loading` wraps."""
    import transformers.modeling_utils as mu

    return all(callable(getattr(mu, name, None)) for name in _HOOKS)


def group_key(key: str) -> str:
    """The load group of a checkpoint key: up to its first numeric part (``model.layers.7.mlp.up_proj.weight``
    -> ``model.layers.7``), else its module (``lm_head.weight`` -> ``lm_head``; a key without a dot is
    its own group)."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or key


def group_keys(keys: Iterable[str]) -> list[list[str]]:
    """``keys`` grouped by :func:`group_key`, groups in the order their first key comes, keys in
    their own order."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(group_key(key), []).append(key)
    return list(groups.values())


def drop_cached_pages(path: str) -> None:
    """Hand the page cache's clean pages of ``path`` back to the kernel (``POSIX_FADV_DONTNEED``);
    best effort (a platform without ``posix_fadvise`` or an unreadable file: nothing happens)."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


class _GroupReader:
    """Opens the real tensors of one group on rank 0, from the files :meth:`record` noted."""

    def __init__(self) -> None:
        self.file_of: dict[str, str] = {}

    def record(self, path: str, keys: Iterable[str]) -> None:
        for key in keys:
            self.file_of[key] = path

    @contextlib.contextmanager
    def tensors(self, keys: list[str], state_dict: dict) -> Iterator[dict]:
        """``{key: tensor}`` of ``keys``: memory-mapped from the key's safetensors file where it came
        from one (a ``.bin`` file's tensors are already in ``state_dict``). On leaving, the handles
        are closed and the files' cached pages dropped; the caller must have let go of the tensors."""
        from safetensors import safe_open

        out: dict = {}
        paths = sorted({self.file_of[k] for k in keys if k in self.file_of})
        with contextlib.ExitStack() as stack:
            handles = {p: stack.enter_context(safe_open(p, framework="pt")) for p in paths}
            for key in keys:
                path = self.file_of.get(key)
                out[key] = handles[path].get_tensor(key) if path is not None else state_dict[key]
            try:
                yield out
            finally:
                out.clear()
        for path in paths:
            drop_cached_pages(path)


def training_dtype(ds_config: dict):
    """The floating dtype ZeRO-3's ``zero.Init`` gives the parameters for ``ds_config`` (as DeepSpeed
    0.19.8's ``Init._set_dtype`` reads it: ``bf16.enabled``, else ``fp16.enabled``, else fp32)."""
    import torch

    if (ds_config.get("bf16") or {}).get("enabled"):
        return torch.bfloat16
    if (ds_config.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


@contextlib.contextmanager
def constructed_in_training_dtype(ds_config: dict) -> Iterator[None]:
    """Torch's default dtype set to :func:`training_dtype` while a from-scratch model is built.

    Under ``zero.Init`` every floating tensor a module creates (``torch.empty`` in ``nn.Linear``,
    ``nn.Embedding``) is made in the default dtype (fp32) and then cast to the training dtype, so
    building the largest module briefly holds it in fp32 *and* in bf16 (three times its bf16 bytes)
    before it is partitioned. Made in the training dtype, it is held once. The weights do not change:
    ``transformers`` builds under ``no_init_weights`` and initialises each module later, gathered,
    in the training dtype either way; buffers made with an explicit dtype (rotary ``inv_freq``) keep
    it (``tests/models/test_layerwise.py`` compares the gathered models of several families).
    """
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(training_dtype(ds_config))
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def layerwise_zero3_loading() -> Iterator[bool]:
    """While open, ``from_pretrained`` under ZeRO-3 (``HfDeepSpeedConfig`` alive) loads a safetensors
    checkpoint a layer at a time (see the module's docstring); yields whether the hooks are in place
    (``False``: ``transformers`` lacks them or ZeRO-3 is not on, and loading is stock's). Not
    reentrant, not thread-safe:
    it swaps two functions of ``transformers.modeling_utils`` and puts them back on leaving.
    """
    import transformers.modeling_utils as mu
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not hooks_available() or not is_deepspeed_zero3_enabled():  # the meta state dict only suits ZeRO-3's path
        yield False
        return
    stock_load, stock_into = mu.load_state_dict, mu._load_state_dict_into_zero3_model
    reader = _GroupReader()

    def load_state_dict(checkpoint_file, *args, **kwargs):
        path = os.fspath(checkpoint_file)
        if args or not path.endswith(".safetensors"):  # .bin, or a calling convention this does not know
            return stock_load(checkpoint_file, *args, **kwargs)
        meta = stock_load(checkpoint_file, **{**kwargs, "map_location": "meta"})
        reader.record(path, meta)
        return meta

    def load_into_zero3(model_to_load, state_dict, *args, **kwargs):
        groups = group_keys(state_dict)
        if not groups:
            return stock_into(model_to_load, state_dict, *args, **kwargs)
        errors: list = []
        missing: set | None = None
        for keys in groups:
            if _rank() == 0:
                with reader.tensors(keys, state_dict) as group:
                    result = stock_into(model_to_load, group, *args, **kwargs)
            else:
                result = stock_into(model_to_load, {k: state_dict[k] for k in keys}, *args, **kwargs)
            group_errors, group_missing = result if isinstance(result, tuple) else (result, None)
            errors.extend(group_errors)
            if group_missing is not None:
                missing = set(group_missing) if missing is None else missing & set(group_missing)
        if missing is None:  # transformers 4.x: the error messages only
            return errors
        return errors, missing

    mu.load_state_dict, mu._load_state_dict_into_zero3_model = load_state_dict, load_into_zero3
    try:
        yield True
    finally:
        mu.load_state_dict, mu._load_state_dict_into_zero3_model = stock_load, stock_into
