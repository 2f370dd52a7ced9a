"""The interned-strings table of a running CPython 3.11 (issue 44's soak): its slots, live
strings, usable slots left and entries, read out of ``/proc/PID/mem``.

    python3 benchmarks/interned.py PID [--every SECONDS]

Needs root (or the process's own user), a ``libpython3.11.so`` in the process's mappings (a
Python built with ``--enable-shared``, as pyenv's here) and ``nm`` to find its ``interned``
symbol (not exported: a library without its symbol table cannot be read). The offsets are those
of 3.11's ``PyDictObject`` and ``PyDictKeysObject``. A benchmark aid, not a test."""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import time


def library(pid: int) -> tuple[str, int]:
    """The process's libpython and where it is loaded."""
    for line in open(f"/proc/{pid}/maps"):
        parts = line.split()
        if len(parts) >= 6 and "libpython3.11.so" in parts[5] and int(parts[2], 16) == 0:
            return parts[5], int(parts[0].split("-")[0], 16)
    raise SystemExit(f"no libpython3.11.so mapped in process {pid}")


def symbol(path: str) -> int:
    for line in subprocess.run(["nm", path], capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "interned":
            return int(parts[0], 16)
    raise SystemExit(f"no 'interned' symbol in {path} (stripped?)")


def read(pid: int, where: int) -> dict[str, int]:
    with open(f"/proc/{pid}/mem", "rb") as mem:

        def word(addr: int, fmt: str = "<q") -> int:
            mem.seek(addr)
            return int(struct.unpack(fmt, mem.read(struct.calcsize(fmt)))[0])

        table = word(where, "<Q")
        keys = word(table + 32, "<Q")  # PyObject_HEAD, ma_used, ma_version_tag, ma_keys
        return {
            "slots": 1 << word(keys + 8, "<B"),  # dk_refcnt, dk_log2_size
            "live": word(table + 16),  # ma_used
            "usable": word(keys + 16),  # dk_usable
            "entries": word(keys + 24),  # dk_nentries
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pid", type=int)
    ap.add_argument("--every", type=float, default=0.0, help="sample until the process ends")
    args = ap.parse_args()
    path, base = library(args.pid)
    where = base + symbol(path)
    while True:
        try:
            row = read(args.pid, where)
        except OSError:
            return
        print(json.dumps({"t": round(time.time(), 3), **row}), flush=True)
        if not args.every:
            return
        time.sleep(args.every)


if __name__ == "__main__":
    main()
