"""Rules every C++/CUDA source under csrc/ keeps, checked on the sources themselves."""

from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"
STREAM_HEADERS = re.compile(r"#\s*include\s*<(iostream|istream|ostream|sstream|fstream|iomanip|locale)>")


def test_csrc_sources_exist():
    assert len(list(CSRC.rglob("*.cpp"))) >= 5


def test_no_iostreams_in_extensions():
    """No iostreams in the JIT-built extensions: a compiler that links libstdc++ statically into the
    shared object (a wrapper adding -static-libstdc++, GCC 13) leaves that copy's locale facets
    uninitialised, and the first stream extraction segfaults. Seen on an H200 host (2026-11-26): the
    pinned arena's /proc reader (an istringstream) crashed the first allocation of every memascend run
    there; /proc is read with C stdio and messages are built with std::to_string instead."""
    offenders = [f"{path.relative_to(CSRC)}: {m.group(0)}"
                 for path in sorted(CSRC.rglob("*")) if path.suffix in (".cpp", ".h", ".cu", ".cuh")
                 for m in STREAM_HEADERS.finditer(path.read_text())]
    assert offenders == []
