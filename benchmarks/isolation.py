"""What each isolation level costs a container task (issue 45): runc (the host's kernel) against
gVisor (``runsc``, a kernel of its own in user space), on the same engine, image and lockdown the
docker runner uses (no network, read-only root, every capability dropped, no new privileges,
an unprivileged user).

* start: a container that runs ``true``, from the create to its exit (create, start, wait),
  and its removal;
* syscalls: ``dd bs=1`` copying 100,000 bytes, /dev/zero to /dev/null (200,000 read and write
  calls);
* processes: 300 ``/bin/true`` started one after another from ``sh`` (fork, exec, wait);
* files: 2,000 files made and listed in the container's ``/tmp`` (open, stat, getdents);
* compute: a loop of 300,000 additions in ``sh`` (no system call).

The workloads time themselves inside the container with ``/proc/uptime`` (each kernel's own
clock, read at 10 ms), so a container's start is not in them. The runtimes alternate round by
round; medians; ratios are runsc / runc from this one run.

    .venv/bin/python benchmarks/isolation.py [--rounds 7]

Needs a Docker engine with runsc registered (``.ci/run`` does it; docs/owner-manual.md,
"Isolation") and busybox (busybox-static). Benchmarks, not tests: nothing here asserts. Raw
figures go to benchmarks/isolation.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import tarfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import docker

HERE = Path(__file__).resolve().parent
OUT = HERE / "isolation.json"
IMAGE = "flashnode-bench/isolation:1"
APPLETS = ["sh", "true", "cat", "dd", "seq", "touch", "ls", "wc", "mkdir", "rm"]
RUNTIMES = ("runc", "runsc")

CLOCK = "read up _ < /proc/uptime; echo $up"
WORKLOADS = {
    "syscalls": "dd if=/dev/zero of=/dev/null bs=1 count=100000 2>/dev/null",
    "processes": "for i in $(seq 300); do /bin/true; done",
    "files": "mkdir /tmp/f && cd /tmp/f && for i in $(seq 2000); do : > $i; done"
    " && ls -l | wc -l > /dev/null && cd / && rm -r /tmp/f",
    "compute": "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done",
}


def image(engine: Any) -> str:
    """The benchmark's image, imported from the local busybox (no registry)."""
    try:
        engine.images.get(IMAGE)
        return IMAGE
    except docker.errors.ImageNotFound:
        pass
    busybox = shutil.which("busybox")
    if busybox is None:
        raise SystemExit("busybox (busybox-static) is needed to build the image")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ("bin", "tmp", "proc", "sys", "dev"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(busybox, "bin/busybox")
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(info)
    repo, tag = IMAGE.split(":")
    engine.api.import_image_from_data(buf.getvalue(), repository=repo, tag=tag)
    return IMAGE


def locked_down(runtime: str) -> dict[str, Any]:
    """The docker runner's sandbox (``runners/container/runner.py``), under ``runtime``."""
    return {
        "runtime": runtime,
        "user": "65534:65534",
        "network_mode": "none",
        "read_only": True,
        "tmpfs": {"/tmp": "rw,nosuid,nodev,size=64m,mode=1777"},
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"],
        "ipc_mode": "private",
        "pids_limit": 4096,
        "mem_limit": 512 * 1024 * 1024,
    }


def start(engine: Any, runtime: str) -> tuple[float, float]:
    """Seconds from the create of a ``true`` container to its exit, and to remove it."""
    t0 = time.perf_counter()
    container = engine.containers.create(IMAGE, ["true"], **locked_down(runtime))
    container.start()
    code = container.wait(timeout=120)["StatusCode"]
    t1 = time.perf_counter()
    container.remove(force=True)
    t2 = time.perf_counter()
    if code != 0:
        raise SystemExit(f"true exited {code} under {runtime}")
    return t1 - t0, t2 - t1


def workload(engine: Any, runtime: str, script: str) -> float:
    """Seconds the workload took inside the container, on its own kernel's clock."""
    text = f"{CLOCK}; {script}; {CLOCK}"
    container = engine.containers.create(IMAGE, ["sh", "-c", text], **locked_down(runtime))
    try:
        container.start()
        code = container.wait(timeout=600)["StatusCode"]
        out = container.logs(stdout=True, stderr=True).decode().split()
    finally:
        container.remove(force=True)
    if code != 0 or len(out) != 2:
        raise SystemExit(f"{script!r} under {runtime}: exit {code}, {out}")
    return float(out[1]) - float(out[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    engine = docker.from_env(timeout=300)
    runtimes = engine.info().get("Runtimes") or {}
    if "runsc" not in runtimes:
        raise SystemExit("the engine has no runsc runtime: see docs/owner-manual.md, Isolation")
    image(engine)
    for runtime in RUNTIMES:  # warm: the image's layers, runsc's binary in the page cache
        start(engine, runtime)
    raw: dict[str, dict[str, list[float]]] = {r: {} for r in RUNTIMES}
    load = []
    for n in range(args.rounds):
        order = RUNTIMES if n % 2 == 0 else RUNTIMES[::-1]
        for runtime in order:
            runs = raw[runtime]
            made, removed = start(engine, runtime)
            runs.setdefault("start", []).append(made)
            runs.setdefault("remove", []).append(removed)
            for name, script in WORKLOADS.items():
                runs.setdefault(name, []).append(workload(engine, runtime, script))
        load.append(os.getloadavg()[0])
    medians = {r: {k: statistics.median(v) for k, v in raw[r].items()} for r in RUNTIMES}
    result = {
        "when": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}",
        "engine": engine.version().get("Version"),
        "runsc": runtimes["runsc"],
        "rounds": args.rounds,
        "load_1min": [round(x, 2) for x in load],
        "medians_s": medians,
        "raw_s": raw,
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['when']}, {result['machine']}, docker {result['engine']}, {args.rounds} rounds")
    print("| measure | runc | runsc | runsc / runc |")
    print("|---|---|---|---|")
    for key in ("start", "remove", *WORKLOADS):
        a, b = medians["runc"][key], medians["runsc"][key]
        ratio = f"{b / a:.1f} x" if a > 0 else "(runc under the clock's 10 ms)"
        print(f"| {key} (s) | {a:.3f} | {b:.3f} | {ratio} |")
    print(f"load (1 min) during the rounds: {min(load):.2f} to {max(load):.2f}")


if __name__ == "__main__":
    main()
