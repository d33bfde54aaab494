"""Loader of the exact-size pinned arena op (``csrc/pinned_arena``).

The policy layer on top of it is :mod:`memascend.memory.arena`; call that, not this module.
"""

from __future__ import annotations

from types import ModuleType

from memascend.ops.build import load_op

SOURCES = ("pinned_arena/arena.cpp", "pinned_arena/cpu_allocator.cpp", "pinned_arena/bindings.cpp")


def load() -> ModuleType:
    """Import or JIT-build ``memascend_pinned_arena``.

    The op has no CUDA sources: libcudart is loaded at run time with ``dlopen`` (``-ldl``), so
    one build serves CPU-only and GPU hosts.

    Returns:
        The extension module (class ``Arena``, ``hugetlb_free_bytes``, ``memlock_limit_bytes``).

    Raises:
        memascend.ops.build.OpBuildError: the op can be neither imported nor built.
    """
    return load_op("pinned_arena", SOURCES, extra_ldflags=("-ldl",))
