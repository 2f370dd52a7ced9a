"""Where our agent's time goes per task: one long run of trivial tasks against the real
coordinator, then the ledger's per-phase timers summed, the gaps between tasks from the
coordinator's events, and (optionally) the agent run under a profiler.

    .venv/bin/python benchmarks/profile.py [-n 300] [--wrap py-spy|strace] [--out DIR]

``--wrap py-spy``: ``py-spy record`` of the agent (all threads, idle ones left out), a
speedscope/flamegraph file and a top-functions summary in DIR. ``--wrap strace``: ``strace -c -f``
of the agent and everything it starts (the syscall table in DIR). Run it after ``benchmarks/run``
(it uses the venv that installed our agent as an owner would). Not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402
from bench import TRIVIAL, Agent, events_by_task  # noqa: E402
from harness import CoordinatorServer, argv_job  # noqa: E402

PHASES = (
    "prepare",
    "stage",
    "restore",
    "environment",
    "data",
    "execute",
    "check",
    "commit",
    "end",
)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("-n", type=int, default=300)
    p.add_argument("--wrap", choices=("none", "py-spy", "strace"), default="none")
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="flashnode-prof-")))
    p.add_argument("--kind", choices=("ours", "old"), default="ours")
    p.add_argument("--bin", help="another flashnode executable to run as ours (a baseline)")
    args = p.parse_args()
    if args.bin:
        bench.OURS[0] = args.bin
    args.out.mkdir(parents=True, exist_ok=True)
    wrap: list[str] = []
    if args.wrap == "py-spy":
        spy = HERE / ".venv-ours" / "bin" / "py-spy"
        wrap = [str(spy), "record", "-r", "250", "-o", str(args.out / "pyspy.txt")]
        wrap += ["-f", "raw", "--threads", "--"]
    elif args.wrap == "strace":
        wrap = ["strace", "-f", "-c", "-o", str(args.out / "strace.txt"), "--"]
    root = Path(tempfile.mkdtemp(prefix="flashnode-prof-coord-"))
    server = CoordinatorServer(root)
    server.start()
    try:
        pool = f"p{random.randrange(10**9)}"
        agent = Agent(args.kind, server.url, pool, "--max-tasks", str(args.n), wrap=wrap)
        coordinator = psutil.Process(server.proc.pid) if server.proc else None
        children = Children(agent.ps)
        cpu0 = _cpu(agent.ps, children, coordinator)
        job = server.submit(argv_job(TRIVIAL, pool=pool, params=[{}] * args.n, max_attempts=1))
        start = time.monotonic()
        server.wait_state(job, {"SUCCEEDED", "FAILED", "PARTIAL"}, timeout=3600)
        wall = time.monotonic() - start
        cpu1 = _cpu(agent.ps, children, coordinator)
        agent.proc.wait(120)  # --max-tasks: it exits by itself (and the profiler writes)
        ledger = agent.state / "ledger.jsonl"
        if ledger.exists():
            shutil.copy(ledger, args.out / "ledger.jsonl")
        agent.stop()
        ev = events_by_task(server, job)
    finally:
        server.close()
        shutil.rmtree(root, ignore_errors=True)
    report(args, wall, ev, cpu0, cpu1)
    return 0


class Children:
    """What the agent's children alive (its supervisors' fork server) did and reaped (the
    supervisors, their launch chains and tasks), read every 0.2 s: the fork server exits with
    the agent, unreaped by it, so its times never reach the agent's own children's."""

    def __init__(self, agent: psutil.Process) -> None:
        self.agent, self.seen = agent, {}
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while self.agent.is_running():
            with contextlib.suppress(psutil.Error):
                for child in self.agent.children():
                    with contextlib.suppress(psutil.Error):
                        c = child.cpu_times()
                        self.seen[child.pid] = (
                            c.user + c.system + c.children_user + c.children_system
                        )
            time.sleep(0.2)

    def total(self) -> float:
        return sum(self.seen.values())


def _cpu(
    agent: psutil.Process, children: Children, coordinator: psutil.Process | None
) -> tuple[float, ...]:
    """CPU seconds so far: the agent's own, what it started (reaped, and its children's:
    ``Children``), the coordinator's; NaN once the agent has exited (it exits after its last
    task, which may come before this is read)."""
    try:
        t = agent.cpu_times()
        own, started = t.user + t.system, t.children_user + t.children_system + children.total()
    except psutil.Error:
        own = started = float("nan")
    c = coordinator.cpu_times() if coordinator else None
    return own, started, (c.user + c.system) if c else float("nan")


def report(
    args: argparse.Namespace,
    wall: float,
    ev: dict[str, dict[str, float]],
    cpu0: tuple[float, ...],
    cpu1: tuple[float, ...],
) -> None:
    n = args.n
    claims = sorted(v["LEASE_CLAIMED"] for v in ev.values() if "LEASE_CLAIMED" in v)
    commits = sorted(v["TASK_COMMIT_ACCEPTED"] for v in ev.values() if "TASK_COMMIT_ACCEPTED" in v)
    cycles = [
        v["TASK_COMMIT_ACCEPTED"] - v["LEASE_CLAIMED"]
        for v in ev.values()
        if "TASK_COMMIT_ACCEPTED" in v and "LEASE_CLAIMED" in v
    ]
    gaps = [c - p for p, c in zip(commits, claims[1:], strict=False)]
    steady = (commits[-1] - claims[0]) / len(commits) if commits else float("nan")
    lines = [
        f"{n} tasks ({args.kind}, wrap {args.wrap}): {wall / n * 1000:.1f} ms/task from submit,"
        f" {steady * 1000:.1f} ms/task first claim to last commit",
        f"claim->commit p50 {statistics.median(cycles) * 1000:.1f} ms,"
        f" commit->next claim p50 {statistics.median(gaps) * 1000:.1f} ms",
        "CPU per task (ms), submit to success: agent {:.1f}, what it started {:.1f},"
        " coordinator {:.1f}".format(*((b - a) / n * 1000 for a, b in zip(cpu0, cpu1))),
    ]
    ledger = args.out / "ledger.jsonl"
    if ledger.exists():
        records = [json.loads(line) for line in ledger.read_text().splitlines()]
        keys = sorted({k for r in records for k in r.get("timings", {})}, key=_order)
        lines.append(f"{'phase':<14}{'mean ms':>9}{'p50 ms':>9}{'p95 ms':>9}")
        for k in keys:
            vals = sorted(r["timings"].get(k, 0.0) * 1000 for r in records)
            lines.append(
                f"{k:<14}{statistics.mean(vals):>9.2f}{vals[len(vals) // 2]:>9.2f}"
                f"{vals[int(len(vals) * 0.95)]:>9.2f}"
            )
        # Where claim -> commit goes outside the phases: the claim's answer until the attempt
        # exists (the loop), and the phases until the coordinator records the commit.
        by_task = {r["task_id"]: r for r in records}  # one attempt per task (max_attempts 1)
        lead, tail = [], []
        for task, v in ev.items():
            r = by_task.get(task)
            if r and "LEASE_CLAIMED" in v and "TASK_COMMIT_ACCEPTED" in v:
                lead.append((r["started_at"] - v["LEASE_CLAIMED"]) * 1000)
                phases = sum(x for k, x in r["timings"].items() if "." not in k and k != "end")
                tail.append((v["TASK_COMMIT_ACCEPTED"] - r["started_at"] - phases) * 1000)
        if lead:
            lines.append(
                f"claim event -> attempt made p50 {statistics.median(lead):.2f} ms;"
                f" commit event - (attempt made + phases) p50 {statistics.median(tail):.2f} ms"
            )
        outcomes: dict[str, int] = {}
        for r in records:
            outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
        lines.append(f"outcomes: {outcomes}")
    text = "\n".join(lines)
    print(text)
    (args.out / "summary.txt").write_text(text + "\n")
    print(f"files in {args.out}")


def _order(key: str) -> tuple[int, str]:
    base = key.split(".")[0]
    return (PHASES.index(base) if base in PHASES else len(PHASES), key)


if __name__ == "__main__":
    sys.exit(main())
