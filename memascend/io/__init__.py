"""Direct NVMe store: tensors swapped to a raw block device (or one preallocated file) without a
filesystem (MemAscend, arXiv 2505.23254, "direct NVMe engine").

Modules: :mod:`~memascend.io.device` (open/probe a device, refuse one in use),
:mod:`~memascend.io.extent` (aligned extent allocator), :mod:`~memascend.io.extent_table` (key to
extent, keys in flight), :mod:`~memascend.io.header` (store header
and extent table on disk), :mod:`~memascend.io.store` (:class:`TensorStore`),
:mod:`~memascend.io.errors`. The engine itself is the C++ op ``csrc/nvme_io``. The adapter that
hands the store to DeepSpeed's swappers as an aio handle lives in the seam
(:mod:`memascend.integrations.deepspeed.swap_backend`); this package does not know DeepSpeed.
"""
