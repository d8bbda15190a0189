"""Process-level tuning: allocation pattern and process lifetime.

Every read allocates megabyte-sized buffers. glibc serves those with mmap and
hands them back on free, so each read touches fresh pages that the kernel
must zero (and on VMs with free-page reporting, fault in from the host):
measured here, a fresh 2 MiB buffer costs ~1.5 ms, a reused one almost
nothing, and direct warm GETs went from ~1.8 to ~3.4 GB/s with freed memory
kept. :func:`keep_freed_memory` raises the mmap and trim thresholds so freed
buffers are reused. It changes the whole process, so the daemon and the
benchmark call it; the library never does on its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(mmap_threshold: int = 64 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Ask glibc to keep up to ``trim_threshold`` bytes of freed heap for reuse,
    and to serve allocations below ``mmap_threshold`` from the heap. Returns
    False where mallopt is unavailable (not glibc)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits
    (Linux prctl PR_SET_PDEATHSIG): a worker never outlives its supervisor,
    even one killed with SIGKILL. Returns False where unsupported."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        prctl = ctypes.CDLL(name, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return bool(prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0)
