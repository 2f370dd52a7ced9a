"""The agent's own cost of one upload: ``Coordinator.upload`` of a 1 GiB file to the real
coordinator, in a fresh interpreter with the agent's allocator settings (``allocator.settle``, as
``flashnode work`` does first), from each tree given, alternated: wall time, the process's CPU
time and its minor page faults.

    .venv/bin/python benchmarks/upload_cpu.py [--rounds N] [--mib M] TREE [TREE...]

Each TREE is a checkout whose ``flashnode`` package is imported (``PYTHONPATH``), with this
venv's dependencies. The wall time is mostly the coordinator's (it buffers, hashes and writes
the body); the CPU and the faults are the agent's. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from harness import CoordinatorServer  # noqa: E402

ONE = r"""
import json, os, sys, time
from flashnode import allocator
allocator.settle()
from flashnode.coordinator.client import Coordinator
def faults():
    with open("/proc/self/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[7])
url, path = sys.argv[1], sys.argv[2]
c, size = Coordinator(url), os.path.getsize(path)
t, cpu, f = time.perf_counter(), time.process_time(), faults()
with open(path, "rb", buffering=0) as fh:
    c.upload(f"upload-cpu/{os.getpid()}", fh, size)
print(json.dumps({"wall": time.perf_counter() - t, "cpu": time.process_time() - cpu,
                  "faults": faults() - f}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("trees", nargs="+")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="upload-cpu-", dir="/var/tmp"))
    server = CoordinatorServer(root, env={"FLASHML_MAX_ARTIFACT_MB": str(args.mib + 1)})
    server.start()
    try:
        blob = root / "blob"
        block = bytes(range(256)) * 4096  # 1 MiB, not zeros
        with blob.open("wb") as out:
            for _ in range(args.mib):
                out.write(block)
        got: dict[str, list[dict[str, float]]] = {tree: [] for tree in args.trees}
        for _ in range(args.rounds):
            for tree in args.trees:
                out = subprocess.run(
                    [sys.executable, "-c", ONE, server.url, str(blob)],
                    env={**os.environ, "PYTHONPATH": str(Path(tree).resolve())},
                    cwd=root,  # not a checkout's: ``-c`` puts the cwd first on sys.path
                    capture_output=True,
                    text=True,
                    check=True,
                )
                got[tree].append(json.loads(out.stdout))
                shutil.rmtree(server.root / "data" / "artifacts" / "upload-cpu", ignore_errors=True)
        for tree, runs in got.items():
            med = {k: statistics.median(r[k] for r in runs) for k in ("wall", "cpu", "faults")}
            each = ", ".join(f"{r['cpu']:.2f}" for r in runs)
            print(
                f"{tree}: wall {med['wall']:.2f} s, CPU {med['cpu']:.2f} s ({each}),"
                f" minor faults {med['faults']:.0f}"
            )
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
