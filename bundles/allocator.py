"""The C allocator setting that keeps a command's peak memory to its buffers (glibc's mmap threshold)."""
from __future__ import annotations

import ctypes

MMAP_THRESHOLD_BYTES = 1 << 20    # blocks of this size and more get a mapping of their own
_M_MMAP_THRESHOLD = -3            # glibc's mallopt parameter number


def return_freed_buffers() -> None:
    """Make the C allocator give every block of MMAP_THRESHOLD_BYTES or more a mapping of its own, unmapped when
    freed. glibc otherwise raises that threshold to the largest block freed (up to 32 MiB), after which shard
    buffers are carved from per-thread arenas that keep them once freed: a million-file pack then holds a few
    hundred MB more than its buffers. Process-wide, so only the command-line entry points call it; a library
    caller keeps its allocator as it set it. Without glibc this does nothing."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
