"""A daemon that never grows (issue 44): one agent of ours runs many trivial tasks, then some
that write outputs, against the real flashruntime 0.6.1 coordinator, while this script samples
what could grow: the agent's resident memory, its threads, its open descriptors, its child
processes, and its state dir (bytes and entries, by top-level name).

    .venv/bin/python benchmarks/soak.py [--tasks 10000] [--with-outputs 1000]

Needs root (the agent runs tasks as its own users, ``flashsoak-N``, made here where missing, so
that it never shares a uid with the tests' ``flashnode-task-N`` or another engineer's agents).
Runs the agent from this checkout (``python -m flashnode``, on ``benchmarks/.venv-ours``'s
interpreter and dependencies where ``benchmarks/venvs`` made it); its state dir goes under
``/var/lib/flashnode-soak`` (not /tmp: see RESULTS.md, issue 31), its console on at a free port,
with a viewer logged in that polls what the console's page polls (``--no-viewer``: none). Also
runs bench.py's isolated floor before and after the soak, so the soak's per-task cycle can be
read against it. Writes the raw samples to ``benchmarks/soak.json``, the plot to
``benchmarks/soak.png`` (matplotlib, a benchmark-only dependency: ``benchmarks/venvs``
installs it), and prints a summary. ``--report`` redraws both from ``soak.json``. Not a test:
nothing here asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import pwd
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
from bench import TRIVIAL, events_by_task, pct  # noqa: E402
from harness import CoordinatorServer, argv_job, free_port, wait_for  # noqa: E402

# The agent's interpreter: benchmarks/.venv-ours (``benchmarks/venvs``: the package's own
# dependencies, as an owner's install has them) where it exists. The checkout's .venv also holds
# the test extras, and with pytest's pygments there httpx imports its CLI too: about 1 MB and
# 2,000 interned strings no owner's agent has (RESULTS.md, "A daemon that never grows").
OURS_PYTHON = HERE / ".venv-ours" / "bin" / "python"
AGENT_PYTHON = str(OURS_PYTHON if OURS_PYTHON.exists() else Path(sys.executable))
TASK_USER = "flashsoak"  # slot N runs as flashsoak-N
PARENT = Path("/var/lib/flashnode-soak")
DRAIN = signal.SIGRTMIN + 2  # what `flashnode drain` sends
OUTPUT_FILES = 3
OUTPUT_BYTES = 64 * 1024
# Three 64 KiB files and metrics.json.
WITH_OUTPUTS = [
    "sh",
    "-c",
    f'for f in a b c; do head -c {OUTPUT_BYTES} /dev/urandom > "$1/$f.bin"; done;'
    ' echo "{}" > "$1/metrics.json"',
    "sh",
    "/work/out",
]


def ensure_users(slots: int) -> None:
    for slot in range(slots):
        name = f"{TASK_USER}-{slot}"
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(
                [
                    *("useradd", "--system", "--user-group", "--no-create-home", "--home-dir"),
                    *("/", "--shell", "/usr/sbin/nologin", name),
                ],
                check=True,
            )


# --- what is sampled ----------------------------------------------------------------------------


STATUS_FIELDS = {
    "VmRSS": "rss",
    "RssAnon": "rss_anon",
    "RssFile": "rss_file",
    "RssShmem": "rss_shmem",
}


def proc_status(pid: int) -> dict[str, int]:
    """The process's resident memory (bytes: all, anonymous, file-backed, shared memory) and its
    thread count."""
    out = {"threads": 0, **dict.fromkeys(STATUS_FIELDS.values(), 0)}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in STATUS_FIELDS:
                out[STATUS_FIELDS[key]] = int(value.split()[0]) * 1024
            elif key == "Threads":
                out["threads"] = int(value.split()[0])
    return out


HEAP_MAX = 64 * 2**20  # a glibc thread arena's reservation on 64-bit (HEAP_MAX_SIZE)


def mappings(pid: int) -> dict[str, int]:
    """Resident bytes per mapping (``/proc/PID/smaps``), keyed by address range, permissions
    and file (anonymous: the range alone)."""
    out: dict[str, int] = {}
    key = ""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            head = line.split(None, 5)
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                name = head[5].strip() if len(head) > 5 else ""
                key = f"{head[0]} {head[1]} {name}".rstrip()
            elif head[0] == "Rss:":
                out[key] = int(head[1]) * 1024
    return out


def arenas(maps: dict[str, int]) -> int:
    """glibc thread arenas: anonymous mappings that start on a 64 MiB boundary, whose usable and
    reserved parts (``rw-p`` then ``---p``) add up to 64 MiB."""
    spans: dict[int, int] = {}
    for key in maps:
        rng, _perms, *name = key.split(" ", 2)
        if name:
            continue
        lo, hi = (int(x, 16) for x in rng.split("-"))
        spans[lo] = hi
    count = 0
    for lo, hi in spans.items():
        if lo % HEAP_MAX == 0:
            end = spans.get(hi, hi) if hi - lo < HEAP_MAX else hi
            if end - lo == HEAP_MAX:
                count += 1
    return count


def mapping_kind(key: str, maps: dict[str, int]) -> str:
    """What a mapping is: ``[heap]`` (glibc's main arena), ``arena`` (a thread arena: an
    anonymous mapping from a 64 MiB boundary), ``anon`` (the rest: pymalloc's arenas, large
    allocations, thread stacks), or its file (``file:NAME``) or pseudo-file (``[stack]``...)."""
    rng, _perms, *name = key.split(" ", 2)
    if name:
        return name[0] if name[0].startswith("[") else "file:" + name[0].rsplit("/", 1)[-1]
    lo = int(rng.split("-")[0], 16)
    return "arena" if lo % HEAP_MAX == 0 else "anon"


def by_kind(maps: dict[str, int]) -> dict[str, int]:
    """Resident bytes per kind of mapping (``mapping_kind``)."""
    out: dict[str, int] = {}
    for key, rss in maps.items():
        kind = mapping_kind(key, maps)
        out[kind] = out.get(kind, 0) + rss
    return out


def mapping_diff(before: dict[str, int], after: dict[str, int]) -> list[list[Any]]:
    """The mappings whose resident bytes changed most: [mapping, bytes before, after]."""
    keys = set(before) | set(after)
    changed = [[k, before.get(k, 0), after.get(k, 0)] for k in keys]
    changed = [c for c in changed if c[1] != c[2]]
    changed.sort(key=lambda c: -abs(c[2] - c[1]))
    return changed[:12]


def tree_size(path: Path) -> tuple[int, int]:
    """Disk used (bytes, by blocks) and entries (files and directories) under ``path``; what
    vanishes while it is walked is skipped."""
    used = entries = 0
    stack = [str(path)]
    while stack:
        top = stack.pop()
        with contextlib.suppress(OSError), os.scandir(top) as it:
            for e in it:
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    used += st.st_blocks * 512
                    entries += 1
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
    return used, entries


def state_breakdown(state: Path) -> dict[str, list[int]]:
    """Per top-level entry of the state dir: [bytes used, entries (itself included)]."""
    out: dict[str, list[int]] = {}
    with contextlib.suppress(OSError), os.scandir(state) as it:
        for e in it:
            with contextlib.suppress(OSError):
                st = e.stat(follow_symlinks=False)
                used, entries = st.st_blocks * 512, 1
                if e.is_dir(follow_symlinks=False):
                    u, n = tree_size(Path(e.path))
                    used, entries = used + u, entries + n
                out[e.name] = [used, entries]
    return out


class LedgerCount:
    """The ledger's outcomes so far, read incrementally (only what was appended)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.rest = b""
        self.outcomes: dict[str, int] = {}

    def read(self) -> int:
        with contextlib.suppress(FileNotFoundError), self.path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
            self.offset += len(data)
            *lines, self.rest = (self.rest + data).split(b"\n")
            for line in lines:
                outcome = str(json.loads(line).get("outcome"))
                self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        return sum(self.outcomes.values())


class Viewer:
    """A browser with the console open: logged in once through ``flashnode ui``'s link, then
    polling what the page polls."""

    def __init__(self, state: Path, listen: str) -> None:
        self.base = f"http://{listen}"
        self.client = httpx.Client(base_url=self.base, timeout=10, follow_redirects=True)
        self.ok = self.errors = 0
        link = wait_for("a console login link", lambda: self._link(state), timeout=30)
        self.client.get(link.replace(self.base, ""))

    @staticmethod
    def _link(state: Path) -> str | None:
        r = subprocess.run(
            [sys.executable, "-m", "flashnode", "ui", "--print-url", "--state-dir", str(state)],
            capture_output=True,
            text=True,
        )
        line = r.stdout.strip().splitlines()[-1:] if r.returncode == 0 else []
        return line[0] if line and "/login?token=" in line[0] else None

    def poll(self) -> None:
        for path in ("/api/state", "/api/charts?span=hour", "/api/history?limit=100"):
            try:
                r = self.client.get(path, headers={"Sec-Fetch-Site": "same-origin"})
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.errors += 1
            except httpx.HTTPError:
                self.errors += 1

    def close(self) -> None:
        self.client.close()


# ``--trace``: the agent run as ``python -c TRACE OUT EVERY ARGS...``, with tracemalloc on and a
# thread that every EVERY seconds collects, snapshots, and appends to OUT (JSON lines) the traced
# size, the live objects by type, and the biggest growths since its first snapshot. For finding
# a leak only: tracing slows the agent and costs memory, so its figures are not the soak's.
TRACE = """
import collections, gc, json, sys, threading, time, tracemalloc
out, every = sys.argv[1], float(sys.argv[2])
sys.argv = ["flashnode", *sys.argv[3:]]
tracemalloc.start(10)
def dump():
    base = first = last = None
    while True:
        time.sleep(every)
        gc.collect()
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__),
             tracemalloc.Filter(False, "<frozen importlib._bootstrap*>")])
        counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
        if base is None:
            base, first = snap, counts
        grown, grown_last = ([
            {"size": d.size_diff, "count": d.count_diff,
             "where": [f"{f.filename}:{f.lineno}" for f in d.traceback][-8:]}
            for d in snap.compare_to(since, "traceback")[:12]
        ] for since in (base, last or base))
        last = snap
        types = {k: v - first.get(k, 0) for k, v in counts.items() if v - first.get(k, 0)}
        with open(out, "a") as fh:
            fh.write(json.dumps({
                "t": time.time(), "traced": tracemalloc.get_traced_memory()[0],
                "objects": len(gc.get_objects()), "grown": grown, "grown_last": grown_last,
                "types": dict(sorted(types.items(), key=lambda kv: -abs(kv[1]))[:25]),
            }) + "\\n")
threading.Thread(target=dump, name="soak-trace", daemon=True).start()
from flashnode.cli.main import main
main(prog_name="flashnode")
"""


# --- the run ------------------------------------------------------------------------------------


class Agent:
    """Our agent from this checkout, as root, its tasks as ``flashsoak-N``."""

    def __init__(
        self,
        url: str,
        pool: str,
        slots: int,
        listen: str,
        trace: float | None = None,
        src: Path | None = None,
    ) -> None:
        """``src``: a tree whose ``flashnode`` package to run instead of this checkout's (a
        baseline: ``git archive REV flashnode | tar -x -C DIR``). The agent runs on the
        dependencies an owner's install has (``AGENT_PYTHON``), with this checkout's (or
        ``src``'s) package first on its path."""
        PARENT.mkdir(mode=0o755, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="soak-", dir=PARENT))
        self.dir.chmod(0o755)
        self.state = self.dir / "state"
        self.state.mkdir(mode=0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")}
        env |= {
            "PYTHONUNBUFFERED": "1",
            "FLASHNODE_TASK_USER": TASK_USER,
            "FLASHNODE_UI_LISTEN": listen,
            "FLASHNODE_SLOTS": str(slots),
        }
        env["PYTHONPATH"] = str(src if src is not None else ROOT)
        self.log = (self.dir / "agent.log").open("wb")  # beside the state dir, not in it
        self.proc = subprocess.Popen(
            [
                *(
                    (AGENT_PYTHON, "-c", TRACE, str(self.dir / "trace.jsonl"), str(trace))
                    if trace
                    else (AGENT_PYTHON, "-m", "flashnode")
                ),
                *("work", "--coordinator", url),
                *("--runner", "trusted", "--pool", pool, "--state-dir", str(self.state)),
            ],
            env=env,
            stdout=self.log,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
            cwd=self.dir,
        )
        self.ps = psutil.Process(self.proc.pid)

    def stop(self, keep: bool) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(DRAIN)
            time.sleep(1)
            if self.proc.poll() is None:
                self.proc.send_signal(DRAIN)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)


JUMP = 256 * 1024  # a step in resident memory between two samples that gets its mappings kept


class Maps:
    """The agent's mappings at the last sample, so that a step in its resident memory is kept
    with the mappings that made it."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}
        self.last_rss = 0
        self.jumps: list[dict[str, Any]] = []
        self.at_warmup: dict[str, int] | None = None

    def growth(self) -> dict[str, list[int]]:
        """Per kind of mapping: [resident bytes at the warm-up sample, at the last]."""
        before, after = by_kind(self.at_warmup or {}), by_kind(self.last)
        kinds = sorted(
            set(before) | set(after), key=lambda k: -abs(after.get(k, 0) - before.get(k, 0))
        )
        return {
            k: [before.get(k, 0), after.get(k, 0)] for k in kinds if before.get(k) != after.get(k)
        }


def sample(agent: Agent, ledger: LedgerCount, t0: float, maps: Maps, warmup: int) -> dict[str, Any]:
    pid = agent.proc.pid
    mem = proc_status(pid)
    now_maps = mappings(pid)
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    cpu = agent.ps.cpu_times()
    breakdown = state_breakdown(agent.state)
    ended = ledger.read()
    wall = time.time()
    if maps.last and abs(mem["rss"] - maps.last_rss) >= JUMP:
        maps.jumps.append(
            {
                "wall": time.strftime("%H:%M:%S", time.gmtime(wall)),
                "ended": ended,
                "rss_step": mem["rss"] - maps.last_rss,
                "mappings": mapping_diff(maps.last, now_maps),
            }
        )
    maps.last, maps.last_rss = now_maps, mem["rss"]
    if maps.at_warmup is None and ended >= warmup:
        maps.at_warmup = now_maps
    return {
        "t": round(time.monotonic() - t0, 2),
        "wall": round(wall, 1),
        "ended": ended,
        **mem,
        "arenas": arenas(now_maps),
        "mappings": len(now_maps),
        "fds": fds,
        "children": len(agent.ps.children(recursive=True)),
        "cpu_s": round(cpu.user + cpu.system, 2),
        "state_bytes": sum(v[0] for v in breakdown.values()),
        "state_entries": sum(v[1] for v in breakdown.values()),
        "state": breakdown,
        "load1": os.getloadavg()[0],
    }


def soak(args: argparse.Namespace) -> dict[str, Any]:
    ensure_users(args.slots)
    bench.TASK_USER = TASK_USER  # the isolated floor's task user: ours, slot 0
    root = Path(tempfile.mkdtemp(prefix="flashnode-soak-coord-"))
    server = CoordinatorServer(root)
    server.start()
    # A loaded coordinator with thousands of tasks may take more than the harness's 10 s to
    # take a job: a submission that timed out may still have made it, so none is retried.
    server.http.close()
    server.http = httpx.Client(base_url=server.url + "/v1alpha1", timeout=300.0)
    raw: dict[str, Any] = {
        "args": vars(args),
        "machine": {
            "host": platform.node(),
            "cores": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "kernel": platform.release(),
            "python": platform.python_version(),
        },
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "samples": [],
        "phases": [],
    }
    floors: list[float] = []
    agent: Agent | None = None
    viewer: Viewer | None = None
    try:
        if args.floor:
            floors.append(bench.overhead_run(server, "floor-isolated", args.floor)["steady_ms"])
            print(f"isolated floor: {floors[-1]:.1f} ms/task", flush=True)
        pool = f"soak{random.randrange(10**9)}"
        listen = f"127.0.0.1:{free_port()}"
        agent = Agent(server.url, pool, args.slots, listen, args.trace, args.src)
        raw["state_dir"] = str(agent.state)
        ledger = LedgerCount(agent.state / "ledger.jsonl")
        wait_for("the console", lambda: _answers(listen), timeout=60)
        if args.viewer:
            viewer = Viewer(agent.state, listen)
        plan = [("trivial", args.tasks, TRIVIAL), ("outputs", args.with_outputs, WITH_OUTPUTS)]
        jobs: list[tuple[str, str, int]] = []  # (phase, job id, tasks)
        submitted = 0
        t0 = time.monotonic()
        next_sample = t0
        maps = Maps()
        raw["jumps"] = maps.jumps
        for phase, count, command in plan:
            left = count
            raw["phases"].append({"phase": phase, "from_task": submitted, "tasks": count})
            while left > 0 or (phase == plan[-1][0] and ledger.read() < submitted):
                # Two batches ahead of the agent: it never waits for work.
                if left > 0 and submitted - ledger.read() < 2 * args.batch:
                    n = min(args.batch, left)
                    spec = argv_job(command, pool=pool, params=[{}] * n, max_attempts=1)
                    jobs.append((phase, server.submit(spec), n))
                    submitted += n
                    left -= n
                    continue
                if agent.proc.poll() is not None:
                    raise RuntimeError(f"the agent exited ({agent.proc.returncode})")
                now = time.monotonic()
                if now >= next_sample:
                    if viewer is not None:
                        viewer.poll()
                    s = sample(agent, ledger, t0, maps, args.warmup)
                    s["phase"] = phase
                    raw["samples"].append(s)
                    next_sample = now + args.every
                    print(
                        f"{s['t']:7.0f}s {s['ended']:6d} ended  rss {s['rss'] / 2**20:6.2f} MB"
                        f" (anon {s['rss_anon'] / 2**20:.2f} file {s['rss_file'] / 2**20:.2f}"
                        f" arenas {s['arenas']})"
                        f"  threads {s['threads']}  fds {s['fds']}  children {s['children']}"
                        f"  state {s['state_bytes'] / 2**20:6.2f} MB / {s['state_entries']}"
                        f"  load {s['load1']:.1f}",
                        flush=True,
                    )
                time.sleep(0.2)
        for _, job, _ in jobs:
            server.wait_state(job, {"SUCCEEDED", "FAILED", "PARTIAL"}, timeout=600)
        time.sleep(args.every)  # the last removals (a retired workspace, the log rotation)
        last = sample(agent, ledger, t0, maps, args.warmup)
        last["phase"] = "end"
        raw["samples"].append(last)
        raw["mapping_growth"] = maps.growth()
        raw["outcomes"] = ledger.outcomes
        raw["viewer"] = {"ok": viewer.ok, "errors": viewer.errors} if viewer else None
        raw["state_listing"] = sorted(os.listdir(agent.state))
        raw["cycle"] = cycles(server, jobs)
        if args.floor:
            floors.append(bench.overhead_run(server, "floor-isolated", args.floor)["steady_ms"])
            print(f"isolated floor: {floors[-1]:.1f} ms/task", flush=True)
        raw["floor_isolated_ms"] = floors
    except BaseException:
        # What was sampled is kept: the raw samples of a run cut short (the report reads it).
        args.out.with_suffix(".partial.json").write_text(json.dumps(raw, default=str))
        raise
    finally:
        if viewer is not None:
            viewer.close()
        if agent is not None:
            agent.stop(args.keep_state)
        server.close()
        shutil.rmtree(root, ignore_errors=True)
    return raw


def _answers(listen: str) -> bool:
    try:
        return httpx.get(f"http://{listen}/", timeout=1).status_code in (200, 401)
    except httpx.HTTPError:
        return False


def cycles(server: CoordinatorServer, jobs: list[tuple[str, str, int]]) -> dict[str, Any]:
    """Per phase, on the coordinator's clock: first claim -> last commit per task, and the
    claim -> commit p50 / p95."""
    out: dict[str, Any] = {}
    for phase in dict.fromkeys(p for p, _, _ in jobs):
        ev: dict[str, dict[str, float]] = {}
        for p, job, _ in jobs:
            if p == phase:
                ev.update({f"{job}/{k}": v for k, v in events_by_task(server, job).items()})
        claims = [v["LEASE_CLAIMED"] for v in ev.values() if "LEASE_CLAIMED" in v]
        done = [v for v in ev.values() if "TASK_COMMIT_ACCEPTED" in v and "LEASE_CLAIMED" in v]
        each = [v["TASK_COMMIT_ACCEPTED"] - v["LEASE_CLAIMED"] for v in done]
        if not done:
            continue
        last = max(v["TASK_COMMIT_ACCEPTED"] for v in done)
        out[phase] = {
            "committed": len(done),
            "steady_ms": (last - min(claims)) / len(done) * 1000,
            "p50_ms": pct(each, 0.5) * 1000,
            "p95_ms": pct(each, 0.95) * 1000,
        }
    return out


# --- the report ---------------------------------------------------------------------------------


def summary(raw: dict[str, Any], warmup: int) -> dict[str, Any]:
    samples = raw["samples"]
    after = [s for s in samples if s["ended"] >= warmup]
    first, last = after[0], after[-1]
    mb = 2**20

    def state_less_ledger(s: dict[str, Any]) -> tuple[int, int]:
        kept = {k: v for k, v in s["state"].items() if not k.startswith("ledger")}
        return sum(v[0] for v in kept.values()), sum(v[1] for v in kept.values())

    logs = [s["state"].get("logs", [0, 0]) for s in after]
    ledger = [s["state"].get("ledger.jsonl", [0, 0])[0] for s in samples]
    tasks = [s["ended"] for s in samples]
    # RSS trend after warm-up: least squares, MB per 1,000 tasks.
    xs, ys = [s["ended"] for s in after], [s["rss"] / mb for s in after]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs) or 1.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den * 1000
    return {
        "warmup_tasks": warmup,
        "rss_after_warmup_mb": first["rss"] / mb,
        "rss_end_mb": last["rss"] / mb,
        "rss_growth_mb": (last["rss"] - first["rss"]) / mb,
        "rss_min_max_after_warmup_mb": [min(ys), max(ys)],
        # Older runs sampled VmRSS only: their parts read 0.
        "rss_anon_growth_mb": (last.get("rss_anon", 0) - first.get("rss_anon", 0)) / mb,
        "rss_file_growth_mb": (last.get("rss_file", 0) - first.get("rss_file", 0)) / mb,
        "arenas_min_max": [
            min(s.get("arenas", 0) for s in after),
            max(s.get("arenas", 0) for s in after),
        ],
        "rss_slope_mb_per_1000_tasks": slope,
        "threads_min_max": [min(s["threads"] for s in after), max(s["threads"] for s in after)],
        "fds_min_max": [min(s["fds"] for s in after), max(s["fds"] for s in after)],
        "children_min_max": [min(s["children"] for s in after), max(s["children"] for s in after)],
        "state_less_ledger_max": [
            max(state_less_ledger(s)[0] for s in after) / mb,
            max(state_less_ledger(s)[1] for s in after),
        ],
        "state_less_ledger_end": [state_less_ledger(last)[0] / mb, state_less_ledger(last)[1]],
        "logs_dir_max_entries": max(e for _, e in logs),
        "ledger_bytes_per_task": (ledger[-1] - ledger[0]) / max(1, tasks[-1] - tasks[0]),
        "ledger_end_mb": ledger[-1] / mb,
        "agent_cpu_ms_per_task": (samples[-1]["cpu_s"] - samples[0]["cpu_s"])
        / max(1, tasks[-1] - tasks[0])
        * 1000,
        "load1_min_median_max": [
            min(s["load1"] for s in samples),
            statistics.median(s["load1"] for s in samples),
            max(s["load1"] for s in samples),
        ],
        "duration_s": samples[-1]["t"],
    }


def spark(values: list[float], width: int = 60) -> str:
    """An ASCII sparkline of ``values``, resampled to ``width`` points."""
    bars = " .:-=+*#%@"
    if not values:
        return ""
    step = max(1, len(values) // width)
    pts = [statistics.fmean(values[i : i + step]) for i in range(0, len(values), step)]
    lo, hi = min(pts), max(pts)
    span = (hi - lo) or 1.0
    return "".join(bars[int((v - lo) / span * (len(bars) - 1))] for v in pts)


def plot(raw: dict[str, Any], warmup: int, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    samples = raw["samples"]
    x = [s["ended"] for s in samples]
    mb = 2**20
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    panels: list[tuple[str, list[tuple[str, list[float]]]]] = [
        (
            "agent resident memory (MB)",
            [
                ("VmRSS", [s["rss"] / mb for s in samples]),
                ("RssAnon", [s.get("rss_anon", 0) / mb for s in samples]),
                ("RssFile", [s.get("rss_file", 0) / mb for s in samples]),
            ],
        ),
        (
            "threads, open descriptors, child processes",
            [
                ("threads", [s["threads"] for s in samples]),
                ("fds", [s["fds"] for s in samples]),
                ("children", [s["children"] for s in samples]),
            ],
        ),
        (
            "state dir less the ledger (MB)",
            [
                (
                    "all",
                    [
                        sum(v[0] for k, v in s["state"].items() if not k.startswith("ledger")) / mb
                        for s in samples
                    ],
                ),
                ("logs/ (keep_logs)", [s["state"].get("logs", [0, 0])[0] / mb for s in samples]),
            ],
        ),
        (
            "state dir entries less the ledger",
            [
                (
                    "all",
                    [
                        sum(v[1] for k, v in s["state"].items() if not k.startswith("ledger"))
                        for s in samples
                    ],
                ),
                ("logs/", [s["state"].get("logs", [0, 0])[1] for s in samples]),
            ],
        ),
        (
            "ledger.jsonl (MB): the audit ledger, one line per attempt",
            [("ledger", [s["state"].get("ledger.jsonl", [0, 0])[0] / mb for s in samples])],
        ),
        ("ms per task between samples; load (1 min)", []),
    ]
    for ax, (title, lines) in zip(axes.flat, panels, strict=True):
        for label, ys in lines:
            ax.plot(x, ys, label=label, lw=1)
        ax.set_title(title, fontsize=10)
        ax.axvline(warmup, color="grey", ls=":", lw=1)
        for p in raw["phases"][1:]:
            ax.axvline(p["from_task"], color="tab:red", ls="--", lw=1)
        ax.set_xlabel("attempts ended")
        if len(lines) > 1:
            ax.legend(fontsize=8)
    ax = axes.flat[-1]
    rate = [
        (b["t"] - a["t"]) / (b["ended"] - a["ended"]) * 1000
        for a, b in itertools.pairwise(samples)
        if b["ended"] > a["ended"]
    ]
    xr = [b["ended"] for a, b in itertools.pairwise(samples) if b["ended"] > a["ended"]]
    ax.plot(xr, rate, lw=1, label="ms/task")
    ax2 = ax.twinx()
    ax2.plot(x, [s["load1"] for s in samples], lw=1, color="tab:orange", label="load")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    fig.suptitle(
        "flashnode soak: one agent, trivial tasks then tasks with outputs (red dashed);"
        f" grey dotted: warm-up ({warmup} tasks)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def report(raw: dict[str, Any], warmup: int) -> str:
    s = summary(raw, warmup)
    raw["summary"] = s
    c = raw.get("cycle", {})
    floors = raw.get("floor_isolated_ms") or []
    lines = [
        f"soak: {raw['samples'][-1]['ended']} attempts in {s['duration_s']:.0f} s,"
        f" outcomes {raw.get('outcomes')}, {raw['machine']['cores']} cores,"
        f" load 1-min min/median/max {'/'.join(f'{v:.1f}' for v in s['load1_min_median_max'])}",
        f"RSS after {warmup} tasks {s['rss_after_warmup_mb']:.2f} MB, at the end"
        f" {s['rss_end_mb']:.2f} MB: {s['rss_growth_mb']:+.2f} MB (min/max after warm-up"
        f" {s['rss_min_max_after_warmup_mb'][0]:.2f}/{s['rss_min_max_after_warmup_mb'][1]:.2f};"
        f" trend {s['rss_slope_mb_per_1000_tasks']:+.3f} MB per 1,000 tasks)",
        f"of which anonymous {s['rss_anon_growth_mb']:+.2f} MB, file-backed"
        f" {s['rss_file_growth_mb']:+.2f} MB; glibc thread arenas {s['arenas_min_max']}",
        f"threads {s['threads_min_max']}, fds {s['fds_min_max']},"
        f" child processes {s['children_min_max']} (min, max after warm-up)",
        f"state dir less the ledger: max {s['state_less_ledger_max'][0]:.2f} MB /"
        f" {s['state_less_ledger_max'][1]} entries, at the end"
        f" {s['state_less_ledger_end'][0]:.2f} MB / {s['state_less_ledger_end'][1]};"
        f" logs/ at most {s['logs_dir_max_entries']} entries",
        f"ledger: {s['ledger_bytes_per_task']:.0f} bytes per attempt, {s['ledger_end_mb']:.1f} MB"
        f" at the end; agent CPU {s['agent_cpu_ms_per_task']:.1f} ms per attempt",
        "state dir at the end: " + ", ".join(raw.get("state_listing", [])),
    ]
    for phase, v in c.items():
        lines.append(
            f"cycle, {phase}: {v['steady_ms']:.1f} ms/task first claim -> last commit"
            f" ({v['committed']} committed), claim -> commit p50/p95"
            f" {v['p50_ms']:.1f}/{v['p95_ms']:.1f} ms"
        )
    if floors:
        ratio = c["trivial"]["steady_ms"] / statistics.fmean(floors) if "trivial" in c else 0
        lines.append(
            f"isolated floor before/after: {' / '.join(f'{f:.1f}' for f in floors)} ms/task;"
            f" trivial soak cycle {ratio:.2f} x their mean"
        )
    growth = raw.get("mapping_growth") or {}
    if growth:
        lines.append(
            "resident memory by mapping, warm-up -> end: "
            + ", ".join(f"{k} {(a - b) / 1024:+.0f} kB" for k, (b, a) in list(growth.items())[:6])
        )
    for jump in raw.get("jumps", []):
        top = ", ".join(f"{m[0]} {(m[2] - m[1]) / 1024:+.0f} kB" for m in jump["mappings"][:3])
        lines.append(
            f"RSS step {jump['rss_step'] / 1024:+.0f} kB at {jump['wall']} UTC, {jump['ended']}"
            f" ended: {top}"
        )
    samples = raw["samples"]
    lines.append("RSS     " + spark([x["rss"] for x in samples]))
    lines.append("threads " + spark([x["threads"] for x in samples]))
    lines.append("fds     " + spark([x["fds"] for x in samples]))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=10_000, help="trivial tasks")
    p.add_argument("--with-outputs", type=int, default=1_000, help="tasks with 3 x 64 KiB outputs")
    p.add_argument("--batch", type=int, default=500, help="tasks per job")
    p.add_argument("--warmup", type=int, default=500, help="tasks before the baseline sample")
    p.add_argument("--every", type=float, default=3.0, help="seconds between samples")
    p.add_argument("--slots", type=int, default=1)
    p.add_argument("--floor", type=int, default=300, help="isolated floor tasks (0: none)")
    p.add_argument("--no-viewer", dest="viewer", action="store_false")
    p.add_argument(
        "--trace",
        type=float,
        metavar="SECONDS",
        help="run the agent under tracemalloc, snapshots every SECONDS (finding a leak only)",
    )
    p.add_argument("--src", type=Path, help="run the flashnode package found in SRC (a baseline)")
    p.add_argument("--keep-state", action="store_true", help="leave the state dir and log")
    p.add_argument("--out", type=Path, default=HERE / "soak.json")
    p.add_argument("--report", action="store_true", help="redraw from --out, run nothing")
    args = p.parse_args()
    if args.report:
        raw = json.loads(args.out.read_text())
        args.warmup = raw["args"]["warmup"]
    else:
        # A soak stopped from outside (kill PID) stops like one interrupted: its agent drained,
        # its coordinator stopped, its samples kept in OUT.partial.json.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        if os.geteuid() != 0:
            print("soak.py runs its agent as root (tasks as flashsoak-N)", file=sys.stderr)
            return 2
        raw = soak(args)
    text = report(raw, args.warmup)
    print(text)
    args.out.write_text(json.dumps(raw, separators=(",", ":"), default=str) + "\n")
    if plot(raw, args.warmup, args.out.with_suffix(".png")):
        print(f"plot: {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
