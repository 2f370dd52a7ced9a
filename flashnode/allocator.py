"""The C allocator's settings for an agent that runs for months (issue 44): memory it frees
goes back to the system instead of staying resident.

glibc's malloc raises its mmap threshold each time a block it had mapped on its own is freed (up
to 32 MiB): from then on, blocks that big come from a heap (the main one, or the arena of the
thread that asked), and what they touched stays resident after they are freed. The agent frees
such blocks again and again: the interpreter's table of interned strings (about 1 MB, replaced
by a new one every few thousand attempts, as `pathlib` interns every path part and each attempt
has paths of its own), a read asking for 1 MiB. Measured in the soak, this made the agent's
resident memory step up by about 1 to 2 MB at a time, long after its warm-up, while the Python
heap stayed flat.

``settle`` fixes the threshold at glibc's own default (a fixed value turns off the dynamic one),
so that a block of 128 KiB or more is always mapped on its own and unmapped when it is freed,
and keeps the number of arenas small (the agent starts short-lived threads: a task's watchers, a
console request's), so that free memory is not spread over many heaps. An owner who set
``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_ARENA_MAX`` in the agent's environment keeps their own
value. Anywhere but glibc (musl, macOS) nothing is done.

The price of a fixed threshold is paid by a loop that allocates a block that big again and
again: each is mapped, its pages faulted in (zeroed by the kernel) and unmapped. Bulk data moves
in chunks of ``STREAM_CHUNK`` bytes, below the threshold, so that each comes from the heap and
reuses the last one's memory (a 1 GiB upload read in 1 MiB chunks took twice the CPU to read
and hash).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters (malloc.h)
M_ARENA_MAX = -8
MMAP_THRESHOLD = 128 * 1024  # glibc's default, fixed
ARENA_MAX = 2
# The bytes a stream (an upload, a copy, a hash) reads at a time: below MMAP_THRESHOLD with room
# for the object's header, so that a chunk is never a mapping of its own.
STREAM_CHUNK = 120 * 1024


def settle(env: Mapping[str, str] = os.environ) -> dict[str, int]:
    """Set what is set here (above) in this process's glibc malloc; what was set, by name."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc's alone: musl and macOS have none)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = {}
    for name, param, value in (
        ("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        ("MALLOC_ARENA_MAX", M_ARENA_MAX, ARENA_MAX),
    ):
        if name in env:
            continue  # the owner's own tuning
        if mallopt(param, value) == 1:
            done[name] = value
        else:
            log.debug("malloc: %s=%d was refused", name, value)
    return done
