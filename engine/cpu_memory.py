"""glibc's malloc, told to keep the engine's freed activations for reuse.

A decode call allocates and frees tens of MB of activations (full size, 16 rows x 1 frame).
Blocks that large glibc either maps fresh from the OS, or, once its adaptive thresholds have
risen, returns to it whenever the free top of the heap outgrows twice the largest block seen. So
every call page-faults its activations in again: 8,600-10,200 minor faults per call, 10-15% of its
time (bench/results/cpu-2core-stages/README.md). With blocks up to glibc's largest mmap threshold
(32 MB) served from the heap and the heap never trimmed below 512 MB, the same calls fault 0 times.

The cost is that the process keeps its peak heap; the engine's peak is bounded by `max_active`.
It is process-wide, so `EngineConfig.keep_freed_memory` turns it off for a process that minds.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 512 << 20


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (see above); False where the C library is not
    glibc, which keeps its own policy."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if applied:
        logger.info("malloc keeps freed blocks up to %d MB for reuse", MMAP_THRESHOLD >> 20)
    return applied
