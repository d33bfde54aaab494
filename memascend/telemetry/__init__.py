"""Memory telemetry: a /proc sampler with phase markers, timeline CSV/PNG, run reports."""

from memascend.telemetry import footprint
from memascend.telemetry.sampler import MemorySampler, read_proc_io, read_proc_status

__all__ = ["footprint", "MemorySampler", "read_proc_status", "read_proc_io"]
