"""A fleet on one coordinator (issue 31): N real agent processes, ours and then flashnode 0.4.1 the
same way, against one real flashruntime 0.6.1 coordinator on this machine; what each node costs
the coordinator and its owner as the fleet grows.

    .venv/bin/python benchmarks/fleet.py [--sizes 10,50,100,200] [--kinds ours,old] [--out DIR]

Run through ``benchmarks/fleet`` (it installs both agents' venvs and the task user). Per fleet
size and kind, on a fresh coordinator behind the request-counting wrapper (counting_app.py):

* **idle**: node-facing requests per second and the coordinator's CPU (% of a core) over a
  window, once every node is registered and has settled to its idle pace; the agents' total
  memory (each agent and what it started: resident, and proportional set size, which counts a
  page shared by k processes as 1/k of it);
* **burst**: 5 x N trivial tasks submitted at once (jobs of at most 500 tasks, back to back):
  time from the submission to the last commit, dispatch latency p50/p95 (submission to each
  task's own start, stamped by the task), claims answered 204 while a task was still waiting,
  and the coordinator's peak CPU (sampled every 0.5 s);
* **restart**: the coordinator stopped and started again on the same data (it forgets every
  node, docs/protocol.md §1.1): seconds from its first answer until every node is registered again,
  how long the re-registrations spread, and the peak of node-facing requests per second and per
  100 ms, against the idle rate.

Every node runs one slot. Ours run as root with ``task_user`` ``flashfleet``, so every node's
slot 0 runs as the one user ``flashfleet-0`` (a real fleet has one node per machine, each with
its own ``flashnode-task-0``): sharing one uid between nodes is safe here because every task is
this harness's own one-line shell, and stated as such; 0.4.1 runs its tasks as root, as it
always does. Ours run with the console off (one port per machine; 200 agents cannot share it);
0.4.1 is handed the pool by a heartbeat after it registers, as a control-plane proxy would (it
reports no pools; after the restart it registers without them, which the restart measure does not
need). Results are a JSON file per point, ``fleet.json``, a Markdown table and a PNG plot in
``--out``. Benchmarks, not tests: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from harness import CoordinatorServer, argv_job, wait_for  # noqa: E402

OURS = [str(HERE / ".venv-ours" / "bin" / "flashnode"), "work"]
OLD = [str(HERE / ".venv-041" / "bin" / "flashnode"), "work"]
FLEET_USER = "flashfleet"  # slot 0 of every node runs as flashfleet-0 (benchmarks/fleet makes it)
STAMP = ["sh", "-c", 'printf \'{"t": %s}\' "$(date +%s.%N)" > "$1"', "sh", "/work/out/metrics.json"]
JOB_MAX = 500  # tasks per job: the coordinator's task ids sort as strings past 999
NODE_PATHS = (
    "/v1alpha1/nodes/",
    "/v1alpha1/leases/",
    "/v1alpha1/attempts/",
    "/v1alpha1/artifacts/",
)


@dataclass
class Options:
    settle: float = 20.0  # after the last registration, before the idle window: idle pace
    idle: float = 60.0  # the idle window
    launch_per_s: float = 8.0  # agent starts per second
    ours: list[str] = field(default_factory=lambda: list(OURS))
    old: list[str] = field(default_factory=lambda: list(OLD))
    task_user: str = FLEET_USER
    env: dict[str, str] = field(default_factory=dict)  # more for every agent (FLASHNODE_*)
    after_restart: float = 5.0  # how long the restart's request peak is watched after all are back
    before_restart: float = 30.0  # after the burst: past the nodes' quick claims after work
    # As root, under /var/lib as an owner's state dir: not under /tmp, which a root agent's tasks
    # get a private copy of (the agent then starts no launch chain ahead: see harnesses.py).
    state_parent: Path = field(
        default_factory=lambda: Path(
            "/var/lib/flashnode-fleet" if os.geteuid() == 0 else tempfile.gettempdir()
        )
    )


# --- the coordinator's request log ------------------------------------------------------------


@dataclass
class Request:
    at: float  # monotonic, when it arrived
    method: str
    path: str
    status: int
    took: float

    @property
    def node_facing(self) -> bool:
        return self.method in ("POST", "PUT") and self.path.startswith(NODE_PATHS)


class RequestLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self, since: float = 0.0, until: float = float("inf")) -> list[Request]:
        out = []
        for line in self.path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 5:
                continue
            r = Request(float(parts[0]), parts[1], parts[2], int(parts[3]), float(parts[4]))
            if since <= r.at < until:
                out.append(r)
        return out


class CpuSampler:
    """The coordinator's CPU, % of one core, every ``every`` seconds while running."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        self.proc = psutil.Process(pid)
        self.every = every
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last, t0 = cpu_seconds(self.proc), time.monotonic()
        while not self._stop.wait(self.every):
            try:
                now, t1 = cpu_seconds(self.proc), time.monotonic()
            except psutil.Error:
                return
            self.samples.append((now - last) / (t1 - t0) * 100)
            last, t0 = now, t1


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


# --- the fleet ----------------------------------------------------------------------------------


class Fleet:
    """N agents of one kind, each with its own state dir and node id."""

    def __init__(self, kind: str, n: int, server: CoordinatorServer, pool: str, o: Options):
        self.kind, self.n, self.server, self.pool, self.o = kind, n, server, pool, o
        o.state_parent.mkdir(mode=0o755, exist_ok=True)
        self.root = Path(tempfile.mkdtemp(prefix=f"fleet-{kind}-{n}-", dir=o.state_parent))
        self.root.chmod(0o755)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.node_ids = [f"fleet-{kind}-{i:03d}-{random.randrange(16**6):06x}" for i in range(n)]

    def start(self) -> float:
        """Start every agent, paced; seconds until all are registered."""
        t0 = time.monotonic()
        base = {k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")}
        for i, node in enumerate(self.node_ids):
            state = self.root / f"a{i:03d}"
            state.mkdir(mode=0o755)
            env = base | self.o.env
            if self.kind == "ours":
                cmd = [*self.o.ours, "--coordinator", self.server.url, "--runner", "trusted"]
                cmd += ["--pool", self.pool, "--state-dir", str(state)]
                env |= {"FLASHNODE_NODE_ID": node, "FLASHNODE_UI_LISTEN": "off"}
                if os.geteuid() == 0:
                    env["FLASHNODE_TASK_USER"] = self.o.task_user
                else:
                    env["FLASHNODE_ALLOW_SAME_USER"] = "true"
            else:
                cmd = [*self.o.old, "--coordinator", self.server.url, "--runner", "trusted"]
                cmd += ["--log-json"]
                (state / "node-id").write_text(node + "\n")
                env |= {"FLASHNODE_STATE_DIR": str(state), "HOME": str(state)}
                env["FLASHNODE_WORKDIR"] = str(state)
            log = open(state / "agent.log", "wb")
            self.procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
            )
            log.close()
            time.sleep(1 / self.o.launch_per_s)  # a launch rate, not a synchronisation
        wait_for(
            f"{self.n} {self.kind} nodes to register",
            lambda: self.registered() >= set(self.node_ids) or self._dead(),
            timeout=60 + 5 * self.n,
            every=0.5,
        )
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                log = (self.root / f"a{i:03d}" / "agent.log").read_text(errors="replace")
                raise RuntimeError(f"agent {i} exited ({proc.returncode}):\n{log[-3000:]}")
        took = time.monotonic() - t0
        if self.kind == "old":
            # 0.4.1 reports no team pools: the coordinator takes them from a heartbeat, as a
            # control-plane proxy would send them.
            with httpx.Client(base_url=self.server.url + "/v1alpha1") as c:
                for node in self.node_ids:
                    c.post(f"/nodes/{node}/heartbeat", json={"node_id": node, "pools": [self.pool]})
        return took

    def _dead(self) -> bool:
        return any(p.poll() is not None for p in self.procs)

    def registered(self) -> set[str]:
        try:
            nodes = httpx.get(self.server.url + "/v1alpha1/nodes", timeout=30).json()
        except (httpx.HTTPError, ValueError):
            return set()
        return {n["node_id"] for n in nodes} & set(self.node_ids)

    def memory(self) -> dict[str, float]:
        """Every agent and what it started: resident and proportional set sizes, in MB."""
        rss = pss = 0
        per_agent = []
        for p in self.procs:
            try:
                root = psutil.Process(p.pid)
                family = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            mine = 0
            for q in family:
                try:
                    info = q.memory_full_info()
                except psutil.Error:
                    continue
                rss += info.rss
                pss += info.pss
                mine += info.rss
            per_agent.append(mine)
        return {
            "rss_total_mb": rss / 2**20,
            "pss_total_mb": pss / 2**20,
            "rss_per_node_mb": statistics.median(per_agent) / 2**20 if per_agent else 0.0,
            "pss_per_node_mb": pss / max(len(per_agent), 1) / 2**20,
        }

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.root, ignore_errors=True)


# --- one point: a kind at a fleet size -----------------------------------------------------------


def run_point(kind: str, n: int, o: Options) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"flashnode-fleet-{kind}-{n}-"))
    count = root / "requests.log"
    count.touch()
    server = CoordinatorServer(
        root, env={"FLASHNODE_BENCH_COUNT": str(count)}, app="counting_app:app", app_path=(HERE,)
    )
    server.start()
    requests = RequestLog(count)
    pool = f"fleet{random.randrange(10**9)}"
    fleet = Fleet(kind, n, server, pool, o)
    out: dict[str, Any] = {"kind": kind, "n": n, "load_1min": [os.getloadavg()[0]]}
    try:
        out["start_s"] = fleet.start()
        time.sleep(o.settle)  # every node settles to its idle pace
        out["idle"] = idle(server, requests, o.idle)
        out["memory"] = fleet.memory()
        out["load_1min"].append(os.getloadavg()[0])
        out["burst"] = burst(server, requests, pool, n)
        out["load_1min"].append(os.getloadavg()[0])
        time.sleep(o.before_restart)
        out["restart"] = restart(server, requests, fleet)
        out["load_1min"].append(os.getloadavg()[0])
    finally:
        fleet.stop()
        server.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


def idle(server: CoordinatorServer, requests: RequestLog, seconds: float) -> dict[str, float]:
    assert server.proc is not None
    coordinator = psutil.Process(server.proc.pid)
    cpu0, t0 = cpu_seconds(coordinator), time.monotonic()
    time.sleep(seconds)
    t1 = time.monotonic()
    cpu = cpu_seconds(coordinator) - cpu0
    seen = [r for r in requests.read(t0, t1) if r.node_facing]
    kinds = Counter(r.path.rsplit("/", 1)[-1] for r in seen)
    return {
        "requests_per_s": len(seen) / (t1 - t0),
        "claims_per_s": kinds["claim"] / (t1 - t0),
        "heartbeats_per_s": kinds["heartbeat"] / (t1 - t0),
        "coordinator_cpu_percent": cpu / (t1 - t0) * 100,
        "answer_p50_ms": pct([r.took for r in seen], 0.5) * 1000 if seen else 0.0,
    }


def burst(server: CoordinatorServer, requests: RequestLog, pool: str, n: int) -> dict[str, Any]:
    total = 5 * n
    sizes = [min(JOB_MAX, total - i) for i in range(0, total, JOB_MAX)]
    assert server.proc is not None
    offset = time.time() - time.monotonic()  # the coordinator's wall clock -> monotonic
    with CpuSampler(server.proc.pid) as cpu:
        t0_mono, t0 = time.monotonic(), time.time()
        jobs = [
            submit(server, argv_job(STAMP, pool=pool, params=[{}] * size, max_attempts=1))
            for size in sizes
        ]
        submitted = time.monotonic()
        for job in jobs:
            wait_for(
                f"job {job} to end",
                lambda job=job: get(server, f"/jobs/{job}")["state"] in ENDED,
                timeout=300 + 3 * total,
                every=0.5,
            )
    claimed, committed, starts = [], [], []
    for job in jobs:
        for e in get(server, f"/jobs/{job}/events"):
            ts = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
            if e["type"] == "LEASE_CLAIMED":
                claimed.append(ts)
            elif e["type"] == "TASK_COMMIT_ACCEPTED":
                committed.append(ts)
        for path in (server.root / "data" / "artifacts" / "jobs" / job).glob("*/metrics.json"):
            try:
                starts.append(float(json.loads(path.read_text())["t"]) - t0)
            except (ValueError, KeyError, OSError):
                continue
    last_claim = max(claimed) - offset if claimed else submitted
    empty = [
        r
        for r in requests.read(submitted, last_claim)
        if r.path.endswith("/leases/claim") and r.status == 204
    ]
    return {
        "tasks": total,
        "committed": len(committed),
        "to_last_commit_s": max(committed) - t0 if committed else float("nan"),
        "dispatch_p50_s": pct(starts, 0.5) if starts else float("nan"),
        "dispatch_p95_s": pct(starts, 0.95) if starts else float("nan"),
        "submit_s": submitted - t0_mono,
        "empty_claims_while_waiting": len(empty),
        "coordinator_cpu_peak_percent": max(cpu.samples, default=0.0),
        "coordinator_cpu_mean_percent": statistics.mean(cpu.samples) if cpu.samples else 0.0,
    }


ENDED = {"SUCCEEDED", "FAILED", "PARTIAL", "CANCELLED"}


def get(server: CoordinatorServer, path: str) -> Any:
    """A job API read, waiting as long as a busy coordinator takes."""
    r = httpx.get(server.url + "/v1alpha1" + path, timeout=300)
    r.raise_for_status()
    return r.json()


def submit(server: CoordinatorServer, spec: dict[str, Any]) -> str:
    """Submit a job, waiting as long as a busy coordinator takes to accept hundreds of tasks."""
    r = httpx.post(server.url + "/v1alpha1/jobs", json=spec, timeout=600)
    r.raise_for_status()
    return str(r.json()["job_id"])


def restart(server: CoordinatorServer, requests: RequestLog, fleet: Fleet) -> dict[str, Any]:
    before = [r for r in requests.read(time.monotonic() - 10) if r.node_facing]
    idle_rate = len(before) / 10
    down = time.monotonic()
    server.stop()
    server.start()  # returns once it answers /healthz
    up = time.monotonic()
    wait_for(
        "every node to register again",
        lambda: fleet.registered() >= set(fleet.node_ids),
        timeout=120 + fleet.n,
        every=0.1,
    )
    all_back = time.monotonic()
    time.sleep(fleet.o.after_restart)  # the claims that follow the re-registrations
    seen = [r for r in requests.read(up - 1) if r.node_facing]
    registers = sorted(r.at for r in seen if r.path.endswith("/nodes/register"))
    per_s = Counter(int(r.at - up) for r in seen)
    per_100ms = Counter(int((r.at - up) * 10) for r in seen)
    return {
        "down_s": up - down,
        "all_registered_s": all_back - up,
        "registers": len(registers),
        "register_spread_s": registers[-1] - registers[0] if registers else 0.0,
        "peak_requests_per_s": max(per_s.values(), default=0),
        "peak_requests_per_100ms": max(per_100ms.values(), default=0),
        "idle_requests_per_s": idle_rate,
    }


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


# --- the report ----------------------------------------------------------------------------------


def table(points: list[dict[str, Any]]) -> str:
    head = (
        "| kind | N | idle requests/s (per node/min) | idle coordinator CPU % | agents' memory,"
        " RSS per node / PSS total (MB) | burst 5N: to last commit (s) | dispatch p50 / p95 (s)"
        " | 204s while work waited | burst coordinator CPU peak %, ms per task | restart: all registered"
        " (s), spread (s) | restart peak requests/s (/100 ms) | load |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for p in sorted(points, key=lambda p: (p["n"], p["kind"])):
        i, m, b, r = p["idle"], p["memory"], p["burst"], p["restart"]
        rows.append(
            f"| {p['kind']} | {p['n']} | {i['requests_per_s']:.1f} ({i['requests_per_s'] / p['n'] * 60:.1f})"
            f" | {i['coordinator_cpu_percent']:.1f} | {m['rss_per_node_mb']:.1f} / {m['pss_total_mb']:.0f}"
            f" | {b['to_last_commit_s']:.1f} | {b['dispatch_p50_s']:.2f} / {b['dispatch_p95_s']:.2f}"
            f" | {b['empty_claims_while_waiting']} | {b['coordinator_cpu_peak_percent']:.0f},"
            f" {coordinator_ms_per_task(b):.0f}"
            f" | {r['all_registered_s']:.1f}, {r['register_spread_s']:.1f}"
            f" | {r['peak_requests_per_s']} ({r['peak_requests_per_100ms']})"
            f" | {'-'.join(f'{x:.1f}' for x in p['load_1min'])} |"
        )
    return "\n".join(rows) + "\n"


def coordinator_ms_per_task(b: dict[str, Any]) -> float:
    """The coordinator's CPU per burst task: its mean CPU over the burst times the burst's
    length (the samples span it), per task."""
    return (
        float(b["coordinator_cpu_mean_percent"]) / 100 * b["to_last_commit_s"] / b["tasks"] * 1000
    )


def plot(points: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("idle requests per node per minute", lambda p: p["idle"]["requests_per_s"] / p["n"] * 60),
        (
            "idle coordinator CPU per node (% of a core)",
            lambda p: p["idle"]["coordinator_cpu_percent"] / p["n"],
        ),
        ("agent memory per node, RSS (MB)", lambda p: p["memory"]["rss_per_node_mb"]),
        ("burst of 5 N: dispatch p50 (s)", lambda p: p["burst"]["dispatch_p50_s"]),
        (
            "burst of 5 N: coordinator CPU per task (ms)",
            lambda p: coordinator_ms_per_task(p["burst"]),
        ),
        (
            "restart: peak requests/s over idle rate",
            lambda p: (
                p["restart"]["peak_requests_per_s"] / max(p["restart"]["idle_requests_per_s"], 1e-9)
            ),
        ),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, value) in zip(axes.flat, panels, strict=True):
        for kind, label in (("ours", "flashnode (ours)"), ("old", "flashnode 0.4.1")):
            mine = sorted((p for p in points if p["kind"] == kind), key=lambda p: p["n"])
            if mine:
                ax.plot([p["n"] for p in mine], [value(p) for p in mine], "o-", label=label)
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("nodes (N)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle("A fleet on one flashruntime 0.6.1 coordinator: cost per node as the fleet grows")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="10,50,100,200")
    p.add_argument("--kinds", default="ours,old")
    p.add_argument("--out", type=Path, default=HERE)
    p.add_argument("--settle", type=float, default=20.0)
    p.add_argument("--idle", type=float, default=60.0)
    p.add_argument("--launch-per-s", type=float, default=8.0)
    p.add_argument("--ours", help="our agent's command (default: benchmarks/.venv-ours)")
    p.add_argument("--task-user", default=FLEET_USER)
    p.add_argument("--report", action="store_true", help="only the table and plot from fleet.json")
    args = p.parse_args(argv)
    o = Options(settle=args.settle, idle=args.idle, launch_per_s=args.launch_per_s)
    o.task_user = args.task_user
    if args.ours:
        o.ours = args.ours.split()
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "fleet.json"
    points: list[dict[str, Any]] = json.loads(results.read_text()) if results.exists() else []
    for n in () if args.report else (int(x) for x in args.sizes.split(",")):
        for kind in args.kinds.split(","):
            print(f"{kind} N={n} (load {os.getloadavg()[0]:.1f})", flush=True)
            point = run_point(kind, n, o)
            print(json.dumps(point), flush=True)
            points = [q for q in points if (q["kind"], q["n"]) != (kind, n)] + [point]
            results.write_text(json.dumps(points, indent=1) + "\n")
    (args.out / "fleet.md").write_text(table(points))
    print(table(points))
    try:
        plot(points, args.out / "fleet.png")
    except ImportError:
        print("no matplotlib: no plot (benchmarks/fleet installs it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
