"""The manifest of a memascend checkpoint: what proves a checkpoint folder complete and intact.

:data:`MANIFEST_NAME` (``memascend_checkpoint.json``) lists the step, the training dtype, the world
size, every parameter's name and shape, and the size and SHA-256 (per :data:`HASH_CHUNK_BYTES`
chunk) of every other file of the tag folder; it is written last, fsynced, by rank 0
(:mod:`memascend.train.checkpoints.save` calls :func:`write_manifest`). The parameter layout it records
(:func:`param_layout`) is what a resume compares with the run's model (:func:`check_compatible`).

Errors: a missing manifest or one for another model is :class:`UserError` (exit 2); a file whose
bytes differ from the manifest, or is missing or truncated, is :class:`IntegrityError` (exit 4),
naming the file and the byte range.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memascend.errors import IntegrityError, UserError
from memascend.io.durable import fsync_dir, write_text_durable

#: The completion marker and manifest of a checkpoint tag folder.
MANIFEST_NAME = "memascend_checkpoint.json"
#: Bytes hashed per SHA-256 digest: a mismatch is located to within this many bytes.
HASH_CHUNK_BYTES = 64 << 20
FORMAT_VERSION = 1


@dataclass
class Checkpoint:
    """A complete checkpoint found on disk.

    Attributes:
        load_dir: the folder holding the tag folder (``engine.load_checkpoint``'s ``load_dir``).
        tag: the tag folder's name (``global_step<N>``).
        manifest: the parsed :data:`MANIFEST_NAME`.
    """

    load_dir: Path
    tag: str
    manifest: dict = field(repr=False)
    manifest_s: float = 0.0
    """Seconds rank 0 spent hashing and fsyncing the files when this run saved it."""

    @property
    def total_bytes(self) -> int:
        """Bytes of the files the manifest lists (0 on ranks other than 0 after a save)."""
        return sum(int(e["bytes"]) for e in self.manifest.get("files", {}).values())

    @property
    def path(self) -> Path:
        return self.load_dir / self.tag

    @property
    def step(self) -> int:
        return int(self.manifest["step"])


def param_layout(module: Any) -> dict[str, list[int]]:
    """Every parameter's name and full shape, in registration order (tied weights once).

    Works on a meta-device model and on a ZeRO-3 model (whose partitioned parameters carry
    their full shape in ``ds_shape``).
    """
    out: dict[str, list[int]] = {}
    for name, p in module.named_parameters():
        shape = getattr(p, "ds_shape", None) or p.shape
        out[name] = [int(d) for d in shape]
    return out


def meta_param_layout(src: Any, model_cfg: Any, lora: Any = None) -> dict[str, list[int]]:
    """:func:`param_layout` of the run's model built on the meta device (no memory, no weights
    read), as :func:`memascend.train.preflight.meta_shape` builds it: what a checkpoint records and
    resume compares. ``lora`` (a :class:`~memascend.config.LoraConfig` with a rank): the model with
    its adapters, whose names and shapes the layout then holds too."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memascend.models.loading import from_scratch_config

    hf_cfg = from_scratch_config(model_cfg.from_scratch) if model_cfg.from_scratch else AutoConfig.from_pretrained(src.hf_dir)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_cfg)
    if lora is not None and lora.enabled:
        from memascend.models.lora import apply_lora

        meta = apply_lora(meta, lora, origin=src.origin)
    return param_layout(meta)


def _hash_file(path: Path, *, fsync: bool = False) -> tuple[int, list[str]]:
    """(bytes, SHA-256 per :data:`HASH_CHUNK_BYTES` chunk) of ``path``; with ``fsync`` the file's
    data is flushed to the device too."""
    digests = []
    size = 0
    with open(path, "rb") as f:
        while True:
            h = hashlib.sha256()
            left = HASH_CHUNK_BYTES
            while left:
                block = f.read(min(left, 8 << 20))
                if not block:
                    break
                h.update(block)
                left -= len(block)
            got = HASH_CHUNK_BYTES - left
            if got == 0 and digests:
                break
            digests.append(h.hexdigest())
            size += got
            if got < HASH_CHUNK_BYTES:
                break
        if fsync:
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return size, digests


def write_manifest(tag_dir: str | os.PathLike, info: dict) -> Path:
    """Hash and fsync every file under ``tag_dir``, fsync its folders, then write
    :data:`MANIFEST_NAME` (fsynced) with ``info`` and the files' sizes and digests.

    Args:
        info: run facts: ``step``, ``dtype``, ``world_size``, ``param_shapes`` (name -> shape) and
            anything else worth recording (engine, backend).

    Returns:
        The manifest's path.
    """
    root = Path(tag_dir)
    files = {}
    dirs = [root]
    for dirpath, dirnames, filenames in os.walk(root):
        dirs.extend(Path(dirpath) / d for d in dirnames)
        for name in sorted(filenames):
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if rel == MANIFEST_NAME:
                continue
            size, digests = _hash_file(p, fsync=True)
            files[rel] = {"bytes": size, "sha256": digests}
    for d in reversed(dirs):
        fsync_dir(d)
    manifest = {
        "format": FORMAT_VERSION,
        "complete": True,
        "created_unix": time.time(),
        "hash_chunk_bytes": HASH_CHUNK_BYTES,
        **info,
        "files": dict(sorted(files.items())),
    }
    path = root / MANIFEST_NAME
    write_text_durable(path, json.dumps(manifest, indent=1) + "\n")
    return path


def read_manifest(tag_dir: str | os.PathLike) -> dict:
    """The manifest of a tag folder.

    Raises:
        UserError: no manifest (the save never finished, or not a memascend checkpoint).
        IntegrityError: a manifest that does not parse or lacks its fields.
    """
    tag = Path(tag_dir)
    path = tag / MANIFEST_NAME
    if not path.is_file():
        raise UserError(
            f"checkpoint {tag} is incomplete: no {MANIFEST_NAME} (its save never finished, or it was not "
            "written by memascend); resume an earlier checkpoint or start again"
        )
    try:
        manifest = json.loads(path.read_text())
        if not (isinstance(manifest, dict) and manifest.get("complete") is True):
            raise ValueError("not marked complete")
        int(manifest["step"])
        if not isinstance(manifest["files"], dict) or not isinstance(manifest["param_shapes"], dict):
            raise ValueError("files/param_shapes are not tables")
        str(manifest["dtype"])
        int(manifest["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"checkpoint manifest {path} is damaged: {exc}") from None
    if int(manifest.get("format", 0)) != FORMAT_VERSION:
        raise UserError(f"checkpoint {tag} has manifest format {manifest.get('format')}, this memascend reads {FORMAT_VERSION}")
    return manifest


def verify_files(ck: Checkpoint, *, share: tuple[int, int] = (0, 1)) -> None:
    """Check the size and SHA-256 of every file the manifest lists (or this rank's share of them:
    file ``i`` of the sorted list when ``i % world == rank`` for ``share=(rank, world)``).

    Raises:
        IntegrityError: a file is missing, of another size, or its bytes differ (names the file and
            the byte range of the first differing chunk).
    """
    rank, world = share
    chunk = int(ck.manifest.get("hash_chunk_bytes", HASH_CHUNK_BYTES))
    if chunk != HASH_CHUNK_BYTES:
        raise IntegrityError(f"checkpoint manifest {ck.path / MANIFEST_NAME} is damaged: hash_chunk_bytes {chunk}")
    for i, (rel, entry) in enumerate(sorted(ck.manifest["files"].items())):
        if i % world != rank:
            continue
        path = ck.path / rel
        if not path.is_file():
            raise IntegrityError(f"checkpoint file {path} is missing: the checkpoint is damaged")
        size = path.stat().st_size
        if size != int(entry["bytes"]):
            raise IntegrityError(
                f"checkpoint file {path} is {size} bytes, the manifest says {entry['bytes']}: the checkpoint is damaged"
            )
        _, digests = _hash_file(path)
        for j, (got, want) in enumerate(zip(digests, entry["sha256"], strict=False)):
            if got != want:
                lo, hi = j * chunk, min(size, (j + 1) * chunk)
                raise IntegrityError(
                    f"checkpoint file {path} is corrupt: the SHA-256 of bytes {lo}..{hi} differs from the manifest's"
                )
        if len(digests) != len(entry["sha256"]):
            raise IntegrityError(f"checkpoint file {path} does not match its manifest entry: the checkpoint is damaged")


def check_compatible(ck: Checkpoint, *, param_shapes: dict[str, list[int]], dtype: str, world_size: int) -> None:
    """Refuse a checkpoint saved for another model, dtype or number of ranks.

    Raises:
        UserError: names the first difference.
    """
    m = ck.manifest
    if m["dtype"] != dtype:
        raise UserError(f"checkpoint {ck.path} was saved with --dtype {m['dtype']}; this run uses {dtype}: resume with --dtype {m['dtype']}")
    if int(m["world_size"]) != world_size:
        raise UserError(
            f"checkpoint {ck.path} was saved by {m['world_size']} rank(s); this run has {world_size}: "
            f"resume with --nproc {m['world_size']}"
        )
    saved = {k: list(v) for k, v in m["param_shapes"].items()}
    here = {k: list(v) for k, v in param_shapes.items()}
    if saved != here:
        for name, shape in here.items():
            if name not in saved:
                detail = f"parameter {name} {shape} is not in the checkpoint"
                break
            if saved[name] != shape:
                detail = f"parameter {name} is {saved[name]} in the checkpoint, {shape} in this model"
                break
        else:
            extra = next(k for k in saved if k not in here)
            detail = f"the checkpoint's parameter {extra} {saved[extra]} is not in this model"
        raise UserError(f"checkpoint {ck.path} was saved for a different model: {detail}")
