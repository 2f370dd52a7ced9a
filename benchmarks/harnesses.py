"""Why two per-task harnesses disagree (issue 31): bench.py's count and issue 31's, side by side,
from the same runs, and the set-ups that move them.

Each run is one agent (or a bare client) working through N trivial pool tasks on the real
coordinator; every run is counted both ways:

* ``per_task_ms`` (bench.py): wall time from the job's submission until the harness sees the job
  SUCCEEDED (it polls every 0.1 s), divided by N: it includes the wait for the agent's first
  claim (ours: its claim backoff, 0.5 s doubling; 0.4.1: its 1 s poll) and up to one poll;
* ``steady_ms`` (issue 31): (last commit - first claim) / N on the coordinator's own clock.

Contenders, alternated round by round so that drift hits each alike: ``floor`` (a bare client,
the task as root), ``floor-isolated`` (the bare client spawning each task with ``unshare --mount
--ipc`` and ``setpriv`` to a task user), ``ours`` (state dir under /var/lib, as bench.py and an
owner's), ``ours-tmp`` (its state dir under /tmp, as ``tempfile.mkdtemp()`` puts it: tasks get a
private /tmp, so the agent cannot start each slot's next launch chain ahead), ``old`` (0.4.1).

    .venv/bin/python benchmarks/harnesses.py [-n 50] [--rounds 3] [--out FILE] [--bin NAME=PATH]

``--bin NAME=PATH`` (repeatable) adds another flashnode executable as a contender named NAME,
run as ``ours`` is (an A/B of a change: e.g. a venv of main against one of the branch).

Run after ``benchmarks/run`` (its venvs). Not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import bench
from bench import CoordinatorServer, overhead_run

KINDS = ("floor", "floor-isolated", "ours", "ours-tmp", "old")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("-n", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--out", type=Path, default=bench.HERE / "harnesses.json")
    p.add_argument("--bin", action="append", default=[], help="NAME=PATH: another agent of ours")
    args = p.parse_args()
    bins = dict(b.split("=", 1) for b in args.bin)
    kinds = args.kinds.split(",") + list(bins)
    root = Path(tempfile.mkdtemp(prefix="flashnode-harnesses-"))
    server = CoordinatorServer(root)
    server.start()
    raw: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    loads: list[float] = []
    try:
        for _ in range(args.rounds):
            for kind in kinds:
                loads.append(os.getloadavg()[0])
                raw[kind].append(run(server, kind, args.n, bins.get(kind)))
                print(kind, json.dumps(raw[kind][-1]), flush=True)
    finally:
        server.close()
    summary = {
        kind: {
            key: statistics.median(r[key] for r in runs)
            for key in ("per_task_ms", "steady_ms", "p50_ms")
        }
        | {
            "steady_min_ms": min(r["steady_ms"] for r in runs),
            "steady_max_ms": max(r["steady_ms"] for r in runs),
        }
        for kind, runs in raw.items()
    }
    out = {"n": args.n, "rounds": args.rounds, "load_1min": loads, "summary": summary, "raw": raw}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for kind, s in summary.items():
        print(
            f"{kind:15} from submit {s['per_task_ms']:6.1f}  first claim->last commit"
            f" {s['steady_ms']:6.1f} ({s['steady_min_ms']:.1f}-{s['steady_max_ms']:.1f})"
            f"  claim->commit p50 {s['p50_ms']:5.1f} ms"
        )
    return 0


def run(server: CoordinatorServer, kind: str, n: int, exe: str | None = None) -> dict[str, Any]:
    if exe is not None:
        ours = bench.OURS[0]
        bench.OURS[0] = exe
        try:
            return overhead_run(server, "ours", n)
        finally:
            bench.OURS[0] = ours
    if kind != "ours-tmp":
        return overhead_run(server, kind, n)
    saved = bench.state_parent
    tmp = Path(tempfile.mkdtemp(prefix="bench-tmp-parent-"))
    tmp.chmod(0o755)
    bench.state_parent = lambda: tmp  # type: ignore[assignment]
    try:
        return overhead_run(server, "ours", n)
    finally:
        bench.state_parent = saved  # type: ignore[assignment]


if __name__ == "__main__":
    sys.exit(main())
