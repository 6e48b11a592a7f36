"""Process memory: the resident set size, and handing freed heap pages back to the system.

Invariant: ``trim_heap`` changes which pages the process holds, never what it can read; both
helpers are no-ops (returning 0 / False) where the platform lacks them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_libc: ctypes.CDLL | None = None


def rss_bytes() -> int:
    """The resident set size of this process now (``/proc/self/statm``), 0 if unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def trim_heap() -> bool:
    """Return free heap memory to the system (glibc ``malloc_trim``): freed tensors smaller
    than the allocator's mmap threshold stay in the heap otherwise, and RSS would not fall."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return False
        _libc = ctypes.CDLL(name)
    trim = getattr(_libc, "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


__all__ = ["rss_bytes", "trim_heap"]
