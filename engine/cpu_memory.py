"""How the process keeps its CPU memory: glibc's malloc told to keep the engine's freed
activations for reuse, and torch's large allocations in transparent huge pages.

**Freed activations.**

A decode call allocates and frees tens of MB of activations (full size, 16 rows x 1 frame).
Blocks that large glibc either maps fresh from the OS, or, once its adaptive thresholds have
risen, returns to it whenever the free top of the heap outgrows twice the largest block seen. So
every call page-faults its activations in again: 8,600-10,200 minor faults per call, 10-15% of its
time (bench/results/cpu-2core-stages/README.md). With blocks up to glibc's largest mmap threshold
(32 MB) served from the heap and the heap never trimmed below 512 MB, the same calls fault 0 times.

The cost is that the process keeps its peak heap; the engine's peak is bounded by `max_active`.
It is process-wide, so `EngineConfig.keep_freed_memory` turns it off for a process that minds.

**Huge pages.** An AR step at full size reads ~150 MB spread over separate allocations (the int8
weights, every row's context in every layer, the flow head) and writes each row's new keys and
values to scattered pages of the pool; in 4 KB pages most of those reads and writes first miss
the TLB. torch puts its allocations of 2 MB or more in transparent huge pages when
`THP_MEM_ALLOC_ENABLE=1`, which it reads once, at its first allocation. So importing
`intone.engine` sets it, unless it is set already or torch was imported first (then it is too
late, and the engine logs so). On the Xeon, full size at c=16 in the agent benchmark: no turn
ran dry in five runs against four of five with some, p95 254-265 ms in four of five against
267-376 (bench/results/cpu-2core-xeon-amx-2026-12-07). The kernel must allow them
(`/sys/kernel/mm/transparent_hugepage/enabled`: `madvise` or `always`). They cost resident
memory (a touched byte brings in 2 MB): a full-size engine of 16 rows after one request 1.95 GB
against 1.62. `THP_MEM_ALLOC_ENABLE=0` in the environment keeps 4 KB pages.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
KERNEL_HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/enabled")

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


# Whether torch had been imported when `request_huge_pages` ran: then its setting was fixed.
_torch_came_first = False


def request_huge_pages() -> None:
    """Ask torch for huge pages (see above) unless the environment says otherwise. Runs as
    `intone.engine` is imported, before it imports torch."""
    global _torch_came_first
    _torch_came_first = "torch" in sys.modules
    if not _torch_came_first:
        os.environ.setdefault(HUGE_PAGES_ENV, "1")


def huge_pages() -> str:
    """Whether torch's large allocations are in huge pages here, and if not, why: for the
    engine's log."""
    setting = os.environ.get(HUGE_PAGES_ENV)
    if setting is None and _torch_came_first:
        return f"off (torch was imported before intone.engine; set {HUGE_PAGES_ENV}=1 for them)"
    if setting != "1":
        return f"off ({HUGE_PAGES_ENV}={setting})"
    try:
        mode = KERNEL_HUGE_PAGES.read_text()
    except OSError:
        return "off (this kernel has no transparent huge pages)"
    if "[never]" in mode:
        return f"off (the kernel's transparent huge pages are 'never': {KERNEL_HUGE_PAGES})"
    return "on"
