"""A run's checkpoints, its side of them: atomic saves, a manifest that proves completeness, verify,
pick, resume, prune, and one folder shared by several hosts.

A memascend checkpoint is a DeepSpeed checkpoint folder (``<root>/global_step<N>/``, what
``DeepSpeedEngine.save_checkpoint`` writes, plus the raw store's export under
``memascend_store/rank<NN>/``) with one more file, :data:`MANIFEST_NAME`
(``memascend_checkpoint.json``): the step, the training dtype, the world size, every parameter's
name and shape, and the size and SHA-256 (per :data:`~memascend.train.checkpoints.manifest.HASH_CHUNK_BYTES` chunk) of every other
file in the folder.

Saving (:func:`save_checkpoint`) is atomic: DeepSpeed writes into a staging folder beside the
target (``<root>/.partial-global_step<N>-<run id>/``) with ``save_latest=False``; once every rank
has written its files (the raw-store export included), rank 0 hashes and fsyncs every file,
writes the manifest last (fsynced), renames the tag folder into place, fsyncs ``<root>``, and only
then replaces ``<root>/latest`` (write, fsync, rename). A run killed at any point leaves either the
previous checkpoints untouched plus a ``.partial-*`` folder (never picked; removed by the next
save into that root once its process is gone) or the new checkpoint complete.

Periodic checkpoints (``--checkpoint-every N`` steps and/or ``--checkpoint-every-minutes M``) go
to ``<output>/checkpoints/global_step<N>/``; the newest ``--keep-checkpoints K`` are kept.
``--resume auto`` resumes the newest complete one there (and starts from step 0 when there is
none); ``--resume DIR`` resumes the tag ``DIR/latest`` names (or ``DIR`` itself when it is a tag
folder). Before DeepSpeed is started, resume checks the manifest against the run (parameter names
and shapes, dtype, world size) and every file's checksum, so an incomplete, foreign or corrupt
checkpoint stops the run with one line instead of training garbage.

Errors: an incomplete checkpoint or one made for another model is :class:`UserError` (exit 2); a
file whose bytes differ from the manifest, or is missing or truncated, is
:class:`IntegrityError` (exit 4), naming the file and the byte range.

The modules: :mod:`.manifest` (the manifest and the parameter layout it records), :mod:`.layout`
(tag folders, ``latest``, the periodic root, the complete checkpoints of a root), :mod:`.checks`
(space and foreign folders, before the first step), :mod:`.resume` (which checkpoint, verified, and
loading it), :mod:`.save` (atomic and periodic saves, pruning) and :mod:`.hosts` (several hosts, one
folder). What touches DeepSpeed's internals, the raw store's export and import inside DeepSpeed's
save and load and the exact restore of the optimizer state, is the seam's
(:mod:`memascend.integrations.deepspeed.store_checkpoint`, :mod:`~memascend.integrations.deepspeed.exact_resume`);
the store's own export format is :mod:`memascend.io.checkpoint`.
"""

from memascend.train.checkpoints.checks import (
    OPTIMIZER_BYTES_PER_PARAM,
    check_checkpoint_space,
    check_checkpoint_target,
    check_tag_folders,
    estimate_checkpoint_bytes,
)
from memascend.train.checkpoints.hosts import check_shared_folders, resolve_resume_everywhere
from memascend.train.checkpoints.layout import (
    CHECKPOINTS_SUBDIR,
    LATEST,
    PARTIAL_PREFIX,
    complete_checkpoints,
    memascend_checkpoint_entries,
    periodic_root,
    tag_for_step,
)
from memascend.train.checkpoints.manifest import (
    MANIFEST_NAME,
    Checkpoint,
    check_compatible,
    meta_param_layout,
    param_layout,
    read_manifest,
    verify_files,
    write_manifest,
)
from memascend.train.checkpoints.resume import (
    load_checkpoint,
    nothing_left,
    pick_reason,
    resolve_resume,
    verify_checkpoint,
)
from memascend.train.checkpoints.save import (
    PeriodicCheckpointer,
    prune,
    remove_stale_partials,
    save_checkpoint,
)

__all__ = [
    "CHECKPOINTS_SUBDIR", "LATEST", "MANIFEST_NAME", "OPTIMIZER_BYTES_PER_PARAM", "PARTIAL_PREFIX", "Checkpoint",
    "PeriodicCheckpointer", "check_checkpoint_space", "check_checkpoint_target", "check_compatible",
    "check_shared_folders",
    "check_tag_folders", "complete_checkpoints", "estimate_checkpoint_bytes", "load_checkpoint",
    "memascend_checkpoint_entries", "meta_param_layout", "nothing_left", "param_layout", "periodic_root",
    "pick_reason", "prune", "read_manifest", "remove_stale_partials", "resolve_resume", "resolve_resume_everywhere",
    "save_checkpoint",
    "tag_for_step", "verify_checkpoint", "verify_files", "write_manifest",
]
