"""From-scratch models: :class:`FromScratchConfig` (a random-weight model's shape), the named presets
(:data:`FROM_SCRATCH_PRESETS`) and ``--from-scratch``'s parser (:func:`parse_from_scratch`). The
families (Llama, Mistral, Qwen2, GPT-NeoX, Phi, GPT-2) and their parameter layouts are in
:mod:`memascend.config.families`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from memascend.config import families
from memascend.config.validate import dotted, validate_config
from memascend.errors import UserError


@dataclass(frozen=True, kw_only=True)
class FromScratchConfig:
    """A model with random weights, for scaling runs: a Llama unless ``arch`` names another family
    (:data:`memascend.config.families.FAMILIES`)."""

    hidden_size: int
    """Model width (d_model)."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Attention heads."""
    vocab_size: int = 49152
    """Vocabulary size; the tokenizer of the built-in model is used, so >= 49152 keeps ids valid."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None`` means ``num_heads``."""
    intermediate_size: int | None = None
    """MLP width; ``None`` means ``8/3 * hidden_size`` rounded up to a multiple of 256."""
    max_position_embeddings: int = 8192
    """Longest sequence the model accepts, in tokens."""
    tie_word_embeddings: bool = True
    """Whether the output projection (``lm_head``) shares the input embedding's weight (SmolLM2);
    ``False`` gives it its own ``vocab_size x hidden_size`` weight, as most production LLMs have."""
    arch: str = "llama"
    """Architecture: ``llama``, ``mistral``, ``qwen2``, ``gpt_neox``, ``phi`` or ``gpt2`` (``transformers``' config classes)."""
    dropout: float = 0.0
    """Dropout probability in ``[0, 1)``, set on every dropout of the family (attention, residual, embedding)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise UserError(f"from-scratch model: {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise UserError(
                f"from-scratch model: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        kv = self.kv_heads
        if kv <= 0 or self.num_heads % kv:
            raise UserError(f"from-scratch model: num_heads {self.num_heads} is not divisible by num_kv_heads {kv}")
        families.check(self)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def mlp_size(self) -> int:
        return self.intermediate_size or families.default_intermediate(self.arch, self.hidden_size)

    @property
    def param_numel(self) -> int:
        """Parameter count (elements), :func:`memascend.config.families.param_numel`."""
        return families.param_numel(self)


# Presets for scaling runs (the llama-* up to 3b: 49,152-token vocabulary, tied embeddings). llama-7b
# and llama-70b have the shapes of Llama-2-7B/70B (32,000-token vocabulary, untied lm_head): for
# `memascend plan`; training them needs a tokenizer of at most 32,000 ids (a Llama-2 model folder).
FROM_SCRATCH_PRESETS: dict[str, FromScratchConfig] = {
    "llama-tiny": FromScratchConfig(hidden_size=64, num_layers=2, num_heads=4, vocab_size=49152),
    "llama-0.1b": FromScratchConfig(hidden_size=576, num_layers=24, num_heads=9, num_kv_heads=3),
    "llama-0.3b": FromScratchConfig(hidden_size=1024, num_layers=20, num_heads=16, num_kv_heads=8),
    "llama-0.5b": FromScratchConfig(hidden_size=1280, num_layers=22, num_heads=20, num_kv_heads=4),
    "llama-1b": FromScratchConfig(hidden_size=2048, num_layers=20, num_heads=32, num_kv_heads=8),
    "llama-2b": FromScratchConfig(hidden_size=2304, num_layers=32, num_heads=18, num_kv_heads=6),
    "llama-3b": FromScratchConfig(hidden_size=3072, num_layers=26, num_heads=24, num_kv_heads=8),
    "llama-7b": FromScratchConfig(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                                  intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096,
                                  tie_word_embeddings=False),
    "llama-70b": FromScratchConfig(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                                   intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096,
                                   tie_word_embeddings=False),
    # The other families of the regression suite: memascend.config.families.PRESETS.
    **{name: FromScratchConfig(**sizes) for name, sizes in families.PRESETS.items()},
}


def parse_from_scratch(spec: str) -> FromScratchConfig:
    """Parse ``--from-scratch``: a preset name, ``key=value,...`` or a TOML/JSON file.

    Keys: ``hidden`` (or ``hidden_size``), ``layers``, ``heads``, ``kv_heads``, ``vocab``,
    ``intermediate``, ``max_positions`` (integers), ``tie_word_embeddings`` (``true``/``false``;
    default true), ``arch`` (a family of :data:`memascend.config.families.FAMILIES`; default ``llama``)
    and ``dropout`` (a fraction; default 0).

    Raises:
        UserError: unknown preset/key or invalid sizes.
    """
    if spec in FROM_SCRATCH_PRESETS:
        return FROM_SCRATCH_PRESETS[spec]
    aliases = {
        "hidden": "hidden_size",
        "layers": "num_layers",
        "heads": "num_heads",
        "kv_heads": "num_kv_heads",
        "vocab": "vocab_size",
        "intermediate": "intermediate_size",
        "max_positions": "max_position_embeddings",
    }
    path = Path(spec)
    raw: dict[str, Any]
    if path.suffix in (".toml", ".json"):
        if not path.is_file():
            raise UserError(f"from-scratch config file not found: {spec}")
        text = path.read_text()
        try:
            if path.suffix == ".toml":
                raw = tomllib.loads(text)
            else:
                import json

                raw = json.loads(text)
        except ValueError as exc:
            raise UserError(f"cannot parse from-scratch config {spec}: {' '.join(str(exc).split())}") from None
        if not isinstance(raw, dict):
            raise UserError(f"from-scratch config {spec} must hold a table/object of sizes, not {type(raw).__name__}")
    elif "=" in spec:
        raw = {}
        for item in spec.split(","):
            key, sep, value = item.partition("=")
            if not sep:
                raise UserError(f"--from-scratch: expected key=value, got '{item}'")
            raw[key.strip()] = families.parse_value(key.strip(), value)
    else:
        raise UserError(
            f"--from-scratch: unknown preset '{spec}' (presets: {', '.join(FROM_SCRATCH_PRESETS)}; "
            "or hidden=..,layers=..,heads=..,vocab=..)"
        )
    fields = {f.name for f in dataclasses.fields(FromScratchConfig)}
    kwargs = {}
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name not in fields:
            raise UserError(f"--from-scratch: unknown key '{key}'")
        kwargs[name] = value
    missing = {"hidden_size", "num_layers", "num_heads"} - kwargs.keys()
    if missing:
        raise UserError(f"--from-scratch: missing {', '.join(sorted(missing))}")
    return validate_config(FromScratchConfig, kwargs, lambda loc: f"--from-scratch: {dotted(loc)}")

