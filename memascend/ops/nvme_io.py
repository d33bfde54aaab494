"""Loader of the direct I/O engine op (``csrc/nvme_io``): io_uring + O_DIRECT, CRC32C.

The store on top of it is :mod:`memascend.io.store`; call that (or
:mod:`memascend.integrations.deepspeed.swap_backend`), not this module.
"""

from __future__ import annotations

from types import ModuleType

from memascend.ops.build import load_op

SOURCES = ("nvme_io/engine.cpp", "nvme_io/crc32c.cpp", "nvme_io/bindings.cpp")


def load() -> ModuleType:
    """Import or JIT-build ``memascend_nvme_io`` (links ``-luring`` and ``-laio``; io_uring is used where the kernel allows it, else libaio).

    Returns:
        The extension module: class ``Engine`` (``submit_write``/``submit_read``/``wait``/``done``/
        ``close``), ``JobResult``, ``crc32c(tensor, nbytes=-1, crc=0)``, ``crc32c_bytes``,
        ``crc32c_hardware()``, ``aligned_empty(nbytes, align_bytes=4096)``.

    Raises:
        memascend.ops.build.OpBuildError: the op can be neither imported nor built (e.g. liburing
            headers missing: ``apt install liburing-dev``).
    """
    return load_op("nvme_io", SOURCES, extra_ldflags=("-luring", "-laio"))
