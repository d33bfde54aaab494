"""A run's inputs, read before anything heavy: the model source, the tokenizer, the token blocks and
the model's parameter layout (on the meta device), with the checks that need them.

The documents are read and tokenized in a short-lived child process (:mod:`memascend.data.prepare`):
the training process receives the token blocks, the tokenizer's number of ids and, when the run
saves a model, the tokenizer's saved files, and never loads the tokenizer itself."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from memascend.config import RunConfig
from memascend.errors import UserError
from memascend.telemetry import footprint
from memascend.train.preflight import check_output_dir, meta_shape
from memascend.train.startup_memory import trim_after_stage


@dataclasses.dataclass
class RunInputs:
    """What :func:`load_inputs` read.

    Attributes:
        src: the resolved model source (:func:`memascend.models.loading.resolve_model`).
        tokenizer: the tokenizer's saved files (:class:`memascend.data.prepare.SavedTokenizer`, whose
            ``save_pretrained`` writes them beside the saved model), or ``None`` when the run saves no
            model (only the saved model needs it once the token blocks exist).
        split: the training and held-out token blocks (:func:`memascend.data.build_blocks`).
        shape: the model's parameter layout (:class:`memascend.config.render.ModelShape`).
    """

    src: Any
    tokenizer: Any
    split: Any
    shape: Any


def load_inputs(cfg: RunConfig, out_dir: Path) -> RunInputs:
    """Resolve the model, have a child process read the data into token blocks
    (:mod:`memascend.data.prepare`), lay the model out on the meta device; hand back what loading left
    after each stage (:func:`trim_after_stage`) and mark the fixed-cost points ``tokenizer`` (what
    the tokenizer's part of the child's results holds here: its saved files) and ``data`` (the
    blocks, the meta-device model's imports: ``transformers``' model classes, imported without SciPy
    by :func:`memascend.models.loading.import_modeling_without_scipy`)
    (:mod:`memascend.telemetry.footprint`; the child's peak RSS:
    :func:`memascend.telemetry.footprint.note_child_peak` ``"data"``).

    Raises:
        UserError: ``--seq-len`` over the model's limit, an unusable ``--output``, unreadable data, a
            tokenizer that cannot be loaded, a from-scratch vocabulary smaller than the tokenizer's,
            LoRA settings the model refuses.
        RuntimeError: the data process died without sending its results.
    """
    from memascend.data import prepare
    from memascend.models.loading import import_modeling_without_scipy, max_positions, resolve_model

    src = resolve_model(cfg.model)
    limit = max_positions(src, cfg.model.from_scratch)
    if cfg.data.seq_len > limit:
        raise UserError(f"--seq-len {cfg.data.seq_len} exceeds the model's limit of {limit} tokens")
    check_output_dir(out_dir)
    with prepare.start(prepare.DataRequest.for_run(src, cfg)) as child:
        tokenizer = child.tokenizer()
        footprint.note_child_peak("data", child.peak_rss_bytes)
        trim_after_stage(cfg)
        footprint.mark("tokenizer")
        split = child.split()
    import_modeling_without_scipy()  # before the first model class is imported
    shape = meta_shape(src, cfg)
    if cfg.model.from_scratch and cfg.model.from_scratch.vocab_size < len(tokenizer):
        raise UserError(
            f"from-scratch vocab_size {cfg.model.from_scratch.vocab_size} is smaller than the tokenizer's "
            f"{len(tokenizer)}"
        )
    if not cfg.train.save_model:
        tokenizer = None  # only the saved model needs it again
    trim_after_stage(cfg)
    footprint.mark("data")
    return RunInputs(src=src, tokenizer=tokenizer, split=split, shape=shape)
