"""The agent's C allocator settings (issue 44: a daemon that never grows): on glibc, a block
freed after the agent freed a bigger one still goes back to the system (glibc's dynamic mmap
threshold would keep it in a heap, resident). Each check runs in a fresh interpreter, so that
this test process's allocator is left as it is."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from flashnode import allocator

try:
    ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    GLIBC = True
except AttributeError:
    GLIBC = False

# Frees a 4 MiB block (mapped on its own: glibc would raise its threshold to 4 MiB), then asks
# for 1 MiB and says whether that one was mapped on its own too (``hblks``: blocks mapped).
PROBE = """
import ctypes, json, sys
from flashnode import allocator
done = allocator.settle() if sys.argv[1] == "settle" else {}
libc = ctypes.CDLL(None)
class Info(ctypes.Structure):
    _fields_ = [(k, ctypes.c_size_t) for k in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(4 << 20))
before = libc.mallinfo2().hblks
block = libc.malloc(1 << 20)
mapped = libc.mallinfo2().hblks - before
libc.free(block)
print(json.dumps({"done": done, "mapped": mapped}))
"""


def probe(how: str, env: dict[str, str] | None = None) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, how], capture_output=True, text=True, check=True, env=env
    )
    return dict(json.loads(out.stdout))


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_big_block_freed_goes_back_to_the_system_after_a_bigger_one() -> None:
    assert probe("as-is")["mapped"] == 0  # glibc as it comes: the 1 MiB came from a heap
    found = probe("settle")
    assert found["mapped"] == 1
    assert found["done"] == {
        "MALLOC_MMAP_THRESHOLD_": allocator.MMAP_THRESHOLD,
        "MALLOC_ARENA_MAX": allocator.ARENA_MAX,
    }


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_the_owners_own_malloc_settings_are_kept() -> None:
    env = dict(os.environ, MALLOC_ARENA_MAX="4", MALLOC_MMAP_THRESHOLD_="65536")
    assert probe("settle", env)["done"] == {}


def test_nothing_is_set_where_there_is_no_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoGlibc:
        def __getattr__(self, name: str) -> object:
            raise AttributeError(name)

    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: NoGlibc())
    assert allocator.settle({}) == {}
