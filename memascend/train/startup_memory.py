"""Host memory the start-up of a run hands back before training: what loading left behind.

Receiving the token blocks (the tokenizer and the documents' text stay in the short-lived data
process, :mod:`memascend.data.prepare`), laying the model out on the meta device, building the
model and ``deepspeed.initialize`` each free memory they allocated on the way (temporary tensors,
parsed JSON, modules' import-time garbage). glibc keeps freed heap memory resident in
its arenas until a trim, so it would stay in the run's RSS under every later phase; the memascend
engine's malloc policy (``enable_malloc_policy``) trims after each of these stages
(:func:`trim_after_stage`). Nothing computed changes: only which pages are resident.
"""

from __future__ import annotations

from memascend.config import RunConfig
from memascend.memory import host_allocator


def trim_after_stage(cfg: RunConfig) -> bool:
    """``malloc_trim(0)`` (:func:`memascend.memory.host_allocator.trim`) when ``cfg`` runs the
    memascend engine with its malloc policy on; stock runs are left as they are.

    Returns:
        ``True`` if glibc handed memory back.
    """
    if cfg.engine != "memascend" or not cfg.memascend.enable_malloc_policy:
        return False
    return host_allocator.trim()
