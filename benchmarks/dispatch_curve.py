"""Dispatch latency against idle requests (issue 31): one agent at a time on the real coordinator,
for each pace the idle node's requests per minute and the dispatch latency p50 after a quiet
period. This coordinator tells a node nothing about waiting work but a claim's own answer (its
heartbeat answers ``{"status": "ok"}``, an empty claim 204 with no body), so a node learns of
new work only by claiming: the curve is what polling costs.

    .venv/bin/python benchmarks/dispatch_curve.py [--samples 12] [--idle 45] [--out FILE]

Each point: ``name=VAR:VALUE,...`` environment for our agent (``FLASHNODE_*`` settings), or
``old`` (0.4.1). Run after ``benchmarks/run`` (its venvs). Not a test: nothing asserts.
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
            idle = bench.idle(server, count_file, kind, args.idle, env=env)
            lat = bench.dispatch(server, kind, args.samples, env=env, quiet=(low, high))
            out["points"][name] = {
                "env": env,
                "requests_per_min": idle["requests_per_min"],
                "dispatch_p50_s": statistics.median(lat),
                "dispatch_p95_s": bench.pct(lat, 0.95),
                "dispatch_s": lat,
                "load_1min": load,
            }
            r = out["points"][name]
            print(
                f"{name:10} {r['requests_per_min']:6.1f} requests/min  dispatch p50"
                f" {r['dispatch_p50_s']:.2f} s p95 {r['dispatch_p95_s']:.2f} s (load {load:.1f})",
                flush=True,
            )
    finally:
        server.close()
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
