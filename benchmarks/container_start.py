"""Time to a container task's first step, its image cached: from the claim (the coordinator's
``LEASE_CLAIMED`` event) to the task's first instruction, for our agent's docker runner (and
flashnode 0.4.1's, where it runs the image), against a bare client on the same engine: the
``docker run`` CLI and the Docker SDK's create and start, each from its own call. The task
writes ``/proc/uptime`` first thing (a container shares the host's kernel and its clock), so
every figure is one clock's. Contenders alternate; medians; the load is stated.

    .venv/bin/python benchmarks/container_start.py [--rounds 8]

Needs a Docker engine and busybox (the tests' image, imported without a registry). Benchmarks,
not tests: nothing here asserts. Raw figures go to benchmarks/container_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import bench
import docker
from bench import HERE, CoordinatorServer, free_port
from boxes import IMAGE, box_job, import_image

if not Path(bench.OURS[0]).exists():
    bench.OURS = [str(bench.ROOT / ".venv" / "bin" / "flashnode"), "work"]

OUT = HERE / "container_start.json"
FIRST = "cat /proc/uptime > /work/out/started"  # the task's first step
TASK = ["sh", "-c", FIRST + "; echo '{}' > /work/out/metrics.json"]


def uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def wall_to_uptime() -> float:
    """What to add to a wall-clock time to read it on /proc/uptime's clock (to 10 ms)."""
    return uptime() - time.time()


def bare_cli(engine: Any) -> float:
    out = Path(tempfile.mkdtemp(prefix="bench-start-"))
    out.chmod(0o777)
    t0 = uptime()
    subprocess.run(
        ["docker", "run", "--rm", "--network", "none", "-v", f"{out}:/work/out", IMAGE, "sh", "-c", FIRST],
        check=True,
        capture_output=True,
    )
    started = float((out / "started").read_text().split()[0])
    shutil.rmtree(out)
    return started - t0


def bare_sdk(engine: Any) -> float:
    out = Path(tempfile.mkdtemp(prefix="bench-start-"))
    out.chmod(0o777)
    t0 = uptime()
    container = engine.containers.run(
        IMAGE,
        ["sh", "-c", FIRST],
        detach=True,
        network_mode="none",
        volumes={str(out): {"bind": "/work/out", "mode": "rw"}},
    )
    container.wait()
    container.remove(force=True)
    started = float((out / "started").read_text().split()[0])
    shutil.rmtree(out)
    return started - t0


class Node:
    """One agent (ours or 0.4.1) with the docker runner, kept for the contender's rounds."""

    def __init__(self, kind: str, server: CoordinatorServer) -> None:
        env = {
            "FLASHNODE_ALLOWED_IMAGES": IMAGE,
            "FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5",
            "FLASHNODE_UI_LISTEN": f"127.0.0.1:{free_port()}",
        }
        if kind == "ours":
            env["FLASHNODE_TASK_USER"] = ""  # a trusted runner's setting
        self.kind, self.server = kind, server
        # The last --runner wins: docker, after the trusted one bench.Agent names.
        self.agent = bench.Agent(kind, server.url, "unused", "--runner", "docker", env=env)

    def run(self, offset: float) -> float | None:
        job = self.server.submit(box_job(TASK, max_attempts=1))
        state = self.server.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=120)
        if state != "SUCCEEDED":
            return None
        [(task, seen)] = bench.events_by_task(self.server, job).items()
        if "LEASE_CLAIMED" not in seen:
            return None
        started = self.server.artifact(f"jobs/{job}/{task}/started")
        return float(started.split()[0]) - (seen["LEASE_CLAIMED"] + offset)

    def stop(self) -> None:
        self.agent.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--no-old", action="store_true")
    args = ap.parse_args()
    engine = docker.from_env(timeout=60)
    import_image(engine, IMAGE)
    root = Path(tempfile.mkdtemp(prefix="flashnode-bench-start-"))
    server = CoordinatorServer(root)
    server.start()
    offset = wall_to_uptime()
    raw: dict[str, list[float | None]] = {"docker run": [], "sdk": [], "ours": [], "old": []}
    loads = [os.getloadavg()[0]]
    try:
        for f in (bare_cli, bare_sdk):  # the image and the engine warm
            f(engine)
        for kind in ("ours", *(() if args.no_old else ("old",))):
            node = Node(kind, server)
            try:
                node.run(offset)  # its first task warms its own path
                for _ in range(args.rounds):
                    raw[kind].append(node.run(offset))
                    raw["docker run"].append(bare_cli(engine))
                    raw["sdk"].append(bare_sdk(engine))
            finally:
                node.stop()
            loads.append(os.getloadavg()[0])
    finally:
        server.close()
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median([v for v in vs if v is not None]) if any(vs) else None
           for k, vs in raw.items()}
    for k, v in med.items():
        print(f"{k:12s} {'-' if v is None else f'{v * 1000:.0f} ms'}")
    if med["ours"] and med["docker run"] and med["sdk"]:
        print(f"ours / docker run {med['ours'] / med['docker run']:.2f} x,"
              f" ours / sdk {med['ours'] / med['sdk']:.2f} x")
    OUT.write_text(
        json.dumps(
            {"when": time.strftime("%Y-%m-%d %H:%M"), "load": loads, "raw": raw, "median_s": med},
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
