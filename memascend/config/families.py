"""Model families of ``--from-scratch``: which Hugging Face architecture a random-weight model has.

Each family is a ``transformers`` config class built from the from-scratch sizes (no download; the
tokenizer of the built-in model, 49,152 ids, serves all of them). A :class:`Family` records the
block's layout (biases, norms, MLP shape, grouped-query attention, dropout keys) so that the
parameter count (:func:`param_numel`) is known without building the model; a test checks it against
a meta-device instance of every family.

This module imports nothing of memascend (``memascend.config`` builds on it); its functions take
the from-scratch config (:class:`memascend.config.FromScratchConfig`) as ``fs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memascend.errors import UserError


@dataclass(frozen=True)
class Family:
    """The parameter layout of one decoder architecture.

    Attributes:
        config_class: name of its ``transformers`` config class.
        gated_mlp: SwiGLU MLP (gate, up, down: three ``hidden x intermediate`` matrices) instead of
            two (up, down).
        qkv_bias / out_bias / mlp_bias: biases on the q/k/v projections, on the attention output
            projection, on the MLP's matrices.
        norm_bias: the norms are LayerNorms with a bias (else RMSNorm, a weight only).
        norms_per_layer: norms in a block (two; one where attention and MLP read the same norm).
        lm_head_bias: the output projection has a ``vocab_size`` bias.
        grouped_kv: accepts ``num_kv_heads`` < ``num_heads`` (grouped-query attention).
        dropout_keys: the config keys ``dropout`` sets.
        attention_dropout_key: the one of ``dropout_keys`` on the attention weights (the others are
            on the residual branches and the embedding).
        position_embeddings: a learned ``max_position_embeddings x hidden_size`` position embedding
            (GPT-2) instead of rotary positions.
        mlp_width_key: the config keyword of the MLP width.
        extra: further config keywords (token ids of the built-in tokenizer).
    """

    config_class: str
    gated_mlp: bool = True
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False
    norms_per_layer: int = 2
    lm_head_bias: bool = False
    grouped_kv: bool = True
    dropout_keys: tuple[str, ...] = ("attention_dropout",)
    attention_dropout_key: str = "attention_dropout"
    position_embeddings: bool = False
    mlp_width_key: str = "intermediate_size"
    extra: tuple[tuple[str, Any], ...] = (("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", 2))


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig"),
    "mistral": Family("MistralConfig"),
    "qwen2": Family("Qwen2Config", qkv_bias=True),
    # Parallel attention and MLP, fused qkv, LayerNorms, GELU MLP, partial rotary, untied by default.
    "gpt_neox": Family("GPTNeoXConfig", gated_mlp=False, qkv_bias=True, out_bias=True, mlp_bias=True,
                       norm_bias=True, grouped_kv=False, dropout_keys=("attention_dropout", "hidden_dropout")),
    # One LayerNorm per block feeding attention and MLP in parallel, partial rotary, lm_head bias.
    "phi": Family("PhiConfig", gated_mlp=False, qkv_bias=True, out_bias=True, mlp_bias=True, norm_bias=True,
                  norms_per_layer=1, lm_head_bias=True, dropout_keys=("attention_dropout", "resid_pdrop", "embd_pdrop")),
    # Learned position embeddings, LayerNorms, fused qkv (c_attn) and GELU MLP (c_fc, c_proj), all
    # with biases, tied by default; its config class defaults every dropout to 0.1.
    "gpt2": Family("GPT2Config", gated_mlp=False, qkv_bias=True, out_bias=True, mlp_bias=True, norm_bias=True,
                   grouped_kv=False, dropout_keys=("attn_pdrop", "resid_pdrop", "embd_pdrop"),
                   attention_dropout_key="attn_pdrop", position_embeddings=True, mlp_width_key="n_inner"),
}
"""``--from-scratch`` ``arch`` values and their layouts (``llama`` is the default)."""

PRESETS: dict[str, dict[str, Any]] = {
    # An untied Mistral shape (~67 M): GQA 8:2, MLP 3.5x as Mistral-7B, own lm_head.
    "mistral-0.07b": dict(arch="mistral", hidden_size=512, num_layers=5, num_heads=8, num_kv_heads=2,
                          intermediate_size=1792, tie_word_embeddings=False),
    # Qwen2 ties its embeddings at this size (Qwen2-0.5B): q/k/v biases, GQA 5:1.
    "qwen2-0.1b": dict(arch="qwen2", hidden_size=640, num_layers=10, num_heads=10, num_kv_heads=2,
                       intermediate_size=3072, tie_word_embeddings=True),
    # Pythia-shaped, untied, with dropout on attention and the residual stream.
    "gpt-neox-0.1b": dict(arch="gpt_neox", hidden_size=640, num_layers=8, num_heads=10,
                          tie_word_embeddings=False, dropout=0.1),
    # Phi-2-shaped (one norm per block, lm_head bias), untied, with dropout.
    "phi-0.1b": dict(arch="phi", hidden_size=640, num_layers=8, num_heads=10, tie_word_embeddings=False,
                     dropout=0.1),
    # GPT-2 small's layout at 16 M (12.6 M of it the tied 49,152 x 256 embedding), GPT-2's 1,024
    # positions and dropout 0.1: a model whose own tensors are smaller than stock's swap buffers.
    "gpt2-16m": dict(arch="gpt2", hidden_size=256, num_layers=4, num_heads=4, max_position_embeddings=1024,
                     tie_word_embeddings=True, dropout=0.1),
}
"""Sizes of the from-scratch presets of the non-Llama families (``memascend.config.FROM_SCRATCH_PRESETS``
holds them with the Llama presets)."""

STR_KEYS = frozenset({"arch"})
"""``--from-scratch`` keys whose value is a word."""
FLOAT_KEYS = frozenset({"dropout"})
"""``--from-scratch`` keys whose value is a fraction."""
BOOL_KEYS = frozenset({"tie_word_embeddings"})
"""``--from-scratch`` keys whose value is true or false."""


def family(arch: str) -> Family:
    """The family called ``arch``.

    Raises:
        UserError: an unknown name (the message lists the known ones).
    """
    try:
        return FAMILIES[arch]
    except (KeyError, TypeError):
        raise UserError(f"from-scratch model: unknown arch {arch!r} (known: {', '.join(FAMILIES)})") from None


def check(fs: Any) -> None:
    """Refuse sizes the family cannot build: grouped-query attention where it has none, a dropout
    outside ``[0, 1)``.

    Raises:
        UserError: one line naming the value.
    """
    fam = family(fs.arch)
    if not fam.grouped_kv and fs.kv_heads != fs.num_heads:
        raise UserError(f"from-scratch model: arch {fs.arch} has no grouped-query attention: num_kv_heads "
                        f"{fs.kv_heads} must equal num_heads {fs.num_heads} (or be left out)")
    if not 0.0 <= fs.dropout < 1.0:
        raise UserError(f"from-scratch model: dropout must be in [0, 1), got {fs.dropout}")


def default_intermediate(arch: str, hidden_size: int) -> int:
    """MLP width when none is given: ``8/3 * hidden_size`` rounded up to a multiple of 256 for the
    gated (SwiGLU) families, ``4 * hidden_size`` for the others."""
    if family(arch).gated_mlp:
        return -(-int(hidden_size * 8 / 3) // 256) * 256
    return 4 * hidden_size


def param_numel(fs: Any) -> int:
    """Parameter count (elements) of the from-scratch model ``fs``: tied input/output embeddings
    counted once, an untied output projection (``vocab_size x hidden_size``, plus its bias where
    the family has one) on top, and learned position embeddings (``max_position_embeddings x
    hidden_size``) where the family has them."""
    fam = family(fs.arch)
    h, i, v = fs.hidden_size, fs.mlp_size, fs.vocab_size
    kv = fs.kv_heads * (h // fs.num_heads)
    attn = 2 * h * h + 2 * h * kv + (h + 2 * kv if fam.qkv_bias else 0) + (h if fam.out_bias else 0)
    mlp = (3 if fam.gated_mlp else 2) * h * i + (i + h if fam.mlp_bias else 0)
    norm = (2 if fam.norm_bias else 1) * h
    per_layer = attn + mlp + fam.norms_per_layer * norm
    embeddings = (1 if fs.tie_word_embeddings else 2) * v * h + (v if fam.lm_head_bias else 0)
    embeddings += fs.max_position_embeddings * h if fam.position_embeddings else 0
    return embeddings + fs.num_layers * per_layer + norm


def hf_config(fs: Any):
    """The ``transformers`` config (``LlamaConfig``, ``MistralConfig``, ...) of the from-scratch
    model ``fs``; ``dropout`` goes to every dropout key of the family (0 included: GPT-2's class
    defaults them to 0.1)."""
    import transformers

    fam = family(fs.arch)
    kwargs: dict[str, Any] = dict(
        vocab_size=fs.vocab_size,
        hidden_size=fs.hidden_size,
        num_hidden_layers=fs.num_layers,
        num_attention_heads=fs.num_heads,
        max_position_embeddings=fs.max_position_embeddings,
        tie_word_embeddings=fs.tie_word_embeddings,
        **{fam.mlp_width_key: fs.mlp_size},
        **dict(fam.extra),
    )
    if fam.grouped_kv:
        kwargs["num_key_value_heads"] = fs.kv_heads
    kwargs.update({key: fs.dropout for key in fam.dropout_keys})  # 0.0 too: GPT-2's class default is 0.1
    return getattr(transformers, fam.config_class)(**kwargs)


def parse_value(key: str, value: str) -> Any:
    """The value of one ``key=value`` item of ``--from-scratch``: a word (``arch``), a fraction
    (``dropout``), true/false (``tie_word_embeddings``: also ``1``/``0``, ``yes``/``no``, any case)
    or an integer (every other key; ``1e3`` accepted).

    Raises:
        UserError: a value of the wrong kind, ``nan`` or ``inf``.
    """
    if key in STR_KEYS:
        return value.strip()
    if key in BOOL_KEYS:
        word = value.strip().lower()
        if word in ("true", "1", "yes", "false", "0", "no"):
            return word in ("true", "1", "yes")
        raise UserError(f"--from-scratch: value of '{key}' must be true or false, got '{value}'")
    try:
        number = float(value)
        return number if key in FLOAT_KEYS and number == number and abs(number) != float("inf") else int(number)
    except (ValueError, OverflowError):  # OverflowError: inf
        raise UserError(f"--from-scratch: value of '{key}' is not a finite number: '{value}'") from None
