"""memascend: host-memory-lean SSD-offloaded fine-tuning on DeepSpeed ZeRO-Infinity.

Implements the techniques of MemAscend (arXiv 2505.23254) on top of stock DeepSpeed 0.19.8 through
one reversible seam (:mod:`memascend.integrations.deepspeed`).
"""

__version__ = "0.1.0"
