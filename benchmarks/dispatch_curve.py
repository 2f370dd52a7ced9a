"""Dispatch latency against idle requests (issue 31): one agent at a time on the real coordinator,
for each pace the idle node's requests per minute and the dispatch latency p50 after a quiet
period. This coordinator tells a node nothing about waiting work but a claim's own answer (its
heartbeat answers ``{"status": "ok"}``, an empty claim 204 with no body), so a node learns of
new work only by claiming: the curve is what polling costs.

    .venv/bin/python benchmarks/dispatch_curve.py [--samples 12] [--idle 45] [--out FILE]

Each point: ``name=VAR:VALUE,...`` environment for our agent (``FLASHNODE_*`` settings), or
``old`` (0.4.1). Per point:

* the idle node (``--warmup`` seconds after it registered, past its backoff's ramp): requests
  per minute, and, from the times its claims actually reached the coordinator, the wait from a
  moment drawn uniformly over the window to the next claim (p50, p95): what a job submitted at
  a random moment waits before this node can see it, at this pace;
* ``--samples`` dispatches after a quiet period of ``--quiet`` seconds since the last task
  (``bench.dispatch``): submission to the task's own start, end to end.

Run after ``benchmarks/run`` (its venvs). Not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench

DEFAULT_POINTS = (
    "old",
    "ours",
    "cap2=FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS:2",
    "cap3=FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS:3",
    "cap5=FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS:5",
    "cap1.4=FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS:1.4",
)


def parse(point: str) -> tuple[str, str, dict[str, str]]:
    if point in ("old", "ours"):
        return point, point, {}
    name, _, rest = point.partition("=")
    env = dict(pair.split(":", 1) for pair in rest.split(",") if pair)
    return name, "ours", env


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("points", nargs="*", default=list(DEFAULT_POINTS))
    p.add_argument("--samples", type=int, default=12)
    p.add_argument("--idle", type=float, default=45.0)
    p.add_argument("--warmup", type=float, default=20.0)
    p.add_argument("--quiet", default="4,8", help="quiet period before each sample: LOW,HIGH s")
    p.add_argument("--out", type=Path, default=bench.HERE / "dispatch_curve.json")
    args = p.parse_args()
    low, high = (float(x) for x in args.quiet.split(","))
    root = Path(tempfile.mkdtemp(prefix="flashnode-curve-"))
    count_file = root / "requests.log"
    count_file.touch()
    server = bench.CoordinatorServer(
        root,
        env={"FLASHNODE_BENCH_COUNT": str(count_file)},
        app="counting_app:app",
        app_path=(bench.HERE,),
    )
    server.start()
    out: dict[str, Any] = {"quiet_s": [low, high], "points": {}}
    try:
        for point in args.points:
            name, kind, env = parse(point)
            env = {"FLASHNODE_UI_LISTEN": "off", **env}
            load = os.getloadavg()[0]
            idle = idle_pace(server, count_file, kind, env, args.warmup, args.idle)
            lat = bench.dispatch(server, kind, args.samples, env=env, quiet=(low, high))
            out["points"][name] = {
                "env": env,
                **idle,
                "dispatch_p50_s": statistics.median(lat),
                "dispatch_p95_s": bench.pct(lat, 0.95),
                "dispatch_s": lat,
                "load_1min": load,
            }
            r = out["points"][name]
            print(
                f"{name:10} {r['requests_per_min']:6.1f} requests/min  next claim p50"
                f" {r['next_claim_p50_s']:.2f} s p95 {r['next_claim_p95_s']:.2f} s  dispatch p50"
                f" {r['dispatch_p50_s']:.2f} s p95 {r['dispatch_p95_s']:.2f} s (load {load:.1f})",
                flush=True,
            )
    finally:
        server.close()
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


def idle_pace(
    server: bench.CoordinatorServer,
    count_file: Path,
    kind: str,
    env: dict[str, str],
    warmup: float,
    seconds: float,
) -> dict[str, float]:
    agent = bench.Agent(kind, server.url, f"p{random.randrange(10**9)}", env=env)
    try:
        time.sleep(warmup)  # past the backoff's ramp from the agent's start
        t0 = time.monotonic()
        time.sleep(seconds)
        t1 = time.monotonic()
    finally:
        agent.stop()
    seen = []
    for line in count_file.read_text().splitlines():
        parts = line.split()
        if parts and t0 <= float(parts[0]) < t1:
            seen.append((float(parts[0]), parts[2]))
    claims = sorted(t for t, path in seen if path.endswith("/leases/claim"))
    rng = random.Random(0)
    waits = []
    for _ in range(10000):
        at = rng.uniform(claims[0], claims[-1])
        waits.append(next(c for c in claims if c >= at) - at)
    return {
        "requests_per_min": len(seen) / (t1 - t0) * 60,
        "claims_per_min": len(claims) / (t1 - t0) * 60,
        "next_claim_p50_s": statistics.median(waits),
        "next_claim_p95_s": bench.pct(waits, 0.95),
    }


if __name__ == "__main__":
    sys.exit(main())
