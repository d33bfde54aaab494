"""Host-memory management: the exact-size pinned arena (:mod:`memascend.memory.arena`) and the
buffer pools built on it (:mod:`memascend.memory.pool`).

Submodules are imported explicitly (``from memascend.memory.arena import PinnedArena``) so that
importing the package does not build a C++ op.
"""
