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


# Uploads 32 MiB under the agent's allocator settings, through a transport that hashes the body
# as it streams (keeping nothing), and prints the page faults the upload took.
UPLOAD = """
import hashlib, json, resource, sys, tempfile
import httpx
from flashnode import allocator
from flashnode.coordinator.client import Coordinator
allocator.settle()
class Sink(httpx.BaseTransport):
    def handle_request(self, request):
        digest = hashlib.sha256()
        for chunk in request.stream:
            digest.update(chunk)
        return httpx.Response(200, json={"sha256": digest.hexdigest()})
with tempfile.TemporaryFile() as fh:
    block = bytes(range(256)) * 4096
    for _ in range(32):
        fh.write(block)
    fh.flush()
    c = Coordinator("http://127.0.0.1:9", transport=Sink())
    fh.seek(0)
    c.upload("warm", fh, 1 << 20)
    fh.seek(0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c.upload("big", fh, 32 << 20)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_an_upload_reuses_its_chunks_memory_under_the_agents_allocator() -> None:
    """Under a fixed mmap threshold a chunk of the threshold's size or more is mapped, faulted in
    page by page and unmapped each time (a 1 GiB upload's read and hash took twice the CPU):
    32 MiB streamed may not cost a fault per page of it (8,192)."""
    out = subprocess.run([sys.executable, "-c", UPLOAD], capture_output=True, text=True, check=True)
    faults = int(out.stdout)
    assert faults < 1024, faults
