"""Hugging Face model ids (``--model Qwen/Qwen2.5-0.5B``) resolved to a local snapshot folder.

The local Hugging Face cache is looked at first (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``): a cached snapshot of the revision that has a config, a tokenizer and
weights is used without asking the Hub. Otherwise the files are downloaded with
``huggingface_hub.snapshot_download`` where the network allows (``HF_HUB_OFFLINE=1``: never).
Only the top-level files a run needs are fetched: ``*.json`` (config, tokenizer, weight index),
tokenizer vocabularies and chat templates, and the ``*.safetensors`` weights; ``*.bin`` weights
only when the repository has no safetensors, and no weights for ``--from-scratch`` (which needs the
tokenizer only).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from memascend.errors import UserError
from memascend.hub_ids import looks_like_repo_id

DEFAULT_REVISION = "main"

CONFIG_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")
"""Top-level files besides the weights: config, generation config, tokenizer files (json, BPE merges,
SentencePiece, tiktoken), chat templates."""
SAFETENSORS_PATTERNS = ("*.safetensors",)
BIN_PATTERNS = ("pytorch_model*.bin",)
TOP_LEVEL_ONLY = ("*/*",)
"""Files in sub-folders (``onnx/``, ``original/``, ...) are never fetched."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt", "tokenizer.tiktoken")


@dataclass(frozen=True)
class HubSnapshot:
    """A model id resolved to a snapshot folder of the local Hugging Face cache."""

    path: Path
    """The snapshot folder (``.../models--org--name/snapshots/<commit>``)."""
    repo_id: str
    """The id the user named."""
    revision: str
    """The revision asked for (branch, tag or commit)."""
    commit: str
    """The commit the revision resolved to."""
    downloaded: bool
    """Whether files were downloaded (``False``: all came from the cache)."""


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub model id ``org/name`` (not a ``.gguf`` file path)."""
    return looks_like_repo_id(name, (".gguf",))


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment when called."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` set to a true value (read when called)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def cached_commit(repo_id: str, revision: str | None) -> str | None:
    """The commit ``revision`` resolves to in the local cache (``None``: not cached): the one
    :func:`resolve_hub_model` used, read back without asking the Hub."""
    revision = revision or DEFAULT_REVISION
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    if (repo / "snapshots" / revision).is_dir():
        return revision
    try:
        commit = (repo / "refs" / revision).read_text().strip()
    except OSError:
        return None
    return commit if (repo / "snapshots" / commit).is_dir() else None


def missing_files(folder: Path, need_weights: bool) -> list[str]:
    """What a model folder lacks to be loaded: ``config.json``, a tokenizer, weights (all shards
    of a ``*.index.json``)."""
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        missing.append("tokenizer")
    if need_weights:
        shards = set()
        for index in folder.glob("*.index.json"):
            try:
                shards |= set(json.loads(index.read_text()).get("weight_map", {}).values())
            except (OSError, ValueError, AttributeError):
                missing.append(index.name)
        missing += sorted(s for s in shards if not (folder / s).is_file())
        if not shards and not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
            missing.append("weights (*.safetensors)")
    return missing


def resolve_hub_model(repo_id: str, revision: str | None, need_weights: bool) -> HubSnapshot:
    """The local snapshot folder of a Hub model: cached, else downloaded.

    Args:
        repo_id: ``org/name``.
        revision: branch, tag or commit (``None``: ``main``).
        need_weights: fetch the weights (``False`` for ``--from-scratch``: config and tokenizer only).

    Raises:
        UserError: naming the id: not cached (or cached without the files a run needs) while
            offline or the Hub cannot be reached, no such model (or gated/private), no such revision.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    revision = revision or DEFAULT_REVISION
    cache = hub_cache_dir()
    patterns = list(CONFIG_PATTERNS) + (list(SAFETENSORS_PATTERNS) if need_weights else [])
    kwargs = {"revision": revision, "cache_dir": str(cache), "ignore_patterns": list(TOP_LEVEL_ONLY)}
    try:
        cached = Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True, **kwargs))
    except (LocalEntryNotFoundError, ValueError):
        cached = None
    if cached is not None and not missing_files(cached, need_weights):
        return HubSnapshot(cached, repo_id, revision, cached.name, downloaded=False)
    if hub_offline():
        what = (f"has no snapshot of revision '{revision}'" if cached is None
                else f"lacks {', '.join(missing_files(cached, need_weights))} in snapshot {cached.name[:12]}")
        raise UserError(
            f"model not found: {repo_id} is not a local path, and the local Hugging Face cache ({cache}) {what} "
            "while HF_HUB_OFFLINE=1 forbids downloading it (unset HF_HUB_OFFLINE, or give a local folder)"
        )
    path = _download(repo_id, patterns, kwargs)
    if need_weights and not any(path.glob("*.safetensors")):
        path = _download(repo_id, patterns + list(BIN_PATTERNS), kwargs)  # a repository without safetensors
    if missing_files(path, need_weights):
        raise UserError(f"model {repo_id} (revision {revision}) has no {', '.join(missing_files(path, need_weights))} "
                        "in its top-level files: is it a causal language model?")
    return HubSnapshot(path, repo_id, revision, path.name, downloaded=True)


def _download(repo_id: str, patterns: list[str], kwargs: dict) -> Path:
    """``snapshot_download`` of ``patterns``, its errors as one line.

    Raises:
        UserError: naming the id and what went wrong.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, **kwargs))
    except RevisionNotFoundError:
        raise UserError(f"model {repo_id} has no revision '{kwargs['revision']}' on the Hugging Face Hub "
                        "(give a branch, tag or commit of it with --revision)") from None
    except (RepositoryNotFoundError, GatedRepoError):
        raise UserError(
            f"model not found: {repo_id} is neither a local path nor a model on the Hugging Face Hub "
            "(a private or gated one needs `hf auth login` and its access granted)"
        ) from None
    except LocalEntryNotFoundError:
        raise UserError(
            f"model not found: {repo_id} is not a local path, it is not in the local Hugging Face cache "
            f"({kwargs['cache_dir']}), and the Hub cannot be reached to download it (check the network, or give "
            "a local folder)"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise UserError(f"cannot download model {repo_id} from the Hugging Face Hub: "
                        f"{' '.join(str(exc).split())[:300]}") from None
