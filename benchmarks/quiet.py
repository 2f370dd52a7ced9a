"""What the agent itself costs while its task sleeps: ours (console on, no browser; then with the
console open in headless Chromium) and flashnode 0.4.1, each with one task that sleeps, against
the real coordinator. CPU is the agent's own process and, for ours, the task's supervisor (the
process that holds a trusted task; the task's own `sleep` is not counted), in % of one core,
from the kernel's per-thread run time (``/proc/PID/task/TID/schedstat``, nanoseconds); each of
our threads is named by ``py-spy dump`` where it is installed (``--py-spy PATH``).

    .venv/bin/python benchmarks/quiet.py [--seconds 120] [--rounds 2] [--py-spy PATH]

As root, ours runs its task as ``flashquiet-0`` (``useradd --system flashquiet-0``), no user a
test or another benchmark uses. Benchmarks, not tests: nothing here asserts. Raw figures go to benchmarks/quiet_agent.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import bench
from bench import Agent, CoordinatorServer, argv_job, wait_for

if not Path(bench.OURS[0]).exists():
    bench.OURS = [str(bench.ROOT / ".venv" / "bin" / "flashnode"), "work"]

OUT = bench.HERE / "quiet_agent.json"


def run_ns(pid: int) -> dict[int, int]:
    """Each thread's time on a CPU so far (ns)."""
    out: dict[int, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


def process_ns(pid: int) -> int:
    """The process's CPU time so far (ns), threads that ended included (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 10**9 // os.sysconf("SC_CLK_TCK")


def thread_names(py_spy: str | None, pid: int) -> dict[int, str]:
    """OS thread id -> the Python thread's name and where it waits (py-spy dump)."""
    if not py_spy:
        return {}
    try:
        dump = subprocess.run(
            [py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names: dict[int, str] = {}
    lines = dump.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r'Thread (0x[0-9A-Fa-f]+|\d+) \((\w+)\): "([^"]*)"', line)
        if not m:
            continue
        where = lines[i + 1].strip() if i + 1 < len(lines) else ""
        tid = m.group(1)
        names[int(tid, 16) if tid.startswith("0x") else int(tid)] = f"{m.group(3)}: {where}"
    return names


def sleeping(
    server: CoordinatorServer,
    kind: str,
    seconds: float,
    browser: bool,
    py_spy: str | None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    pool = f"p{random.randrange(10**9)}"
    port = bench.free_port()
    full_env = dict(env or {})
    if kind == "ours":
        full_env["FLASHNODE_TASK_USER"] = "flashquiet"  # its own task user: flashquiet-0
        full_env["FLASHNODE_REATTACH_SECONDS"] = "0"  # stopped, it takes its task along
        full_env["FLASHNODE_UI_LISTEN"] = f"127.0.0.1:{port}"
    agent = Agent(kind, server.url, pool, "--max-tasks", "1", env=full_env)
    job = server.submit(
        argv_job(
            ["sh", "-c", f'sleep {seconds + 30}; echo "{{}}" > "$1"', "sh", "/work/out/metrics.json"],
            pool=pool,
            max_attempts=1,
            lease_seconds=int(seconds + 120),
        )
    )
    page = None
    try:
        wait_for("the task to run", lambda: server.tasks(job)[0]["state"] == "LEASED", timeout=60)
        if browser:
            page = open_console(agent, port)
        time.sleep(5)  # the task's start is not its sleep
        procs = [agent.proc.pid]
        if kind == "ours":  # the supervisor holds the task: its cost is the agent's too
            procs += [c.pid for c in agent.ps.children() if "supervisor" in " ".join(c.cmdline())]
        before = {p: run_ns(p) for p in procs}
        whole = {p: process_ns(p) for p in procs}
        t0 = time.monotonic()
        time.sleep(seconds)
        after = {p: run_ns(p) for p in procs}
        wall = time.monotonic() - t0
        whole = {p: process_ns(p) - whole[p] for p in procs}
        names = thread_names(py_spy, agent.proc.pid) if kind == "ours" else {}
    finally:
        if page is not None:
            page["close"]()
    threads = []
    for p in procs:
        for tid, ns in after[p].items():
            used = ns - before[p].get(tid, 0)
            label = "supervisor" if p != agent.proc.pid else names.get(tid, str(tid))
            threads.append({"thread": label, "cpu_percent": used / 1e9 / wall * 100})
    # Threads that ended meanwhile (the console's per-request ones) count in the process's time.
    listed = sum(t["cpu_percent"] for t in threads)
    total = max(sum(whole.values()) / 1e9 / wall * 100, listed)
    threads.append({"thread": "threads that ended meanwhile", "cpu_percent": total - listed})
    threads.sort(key=lambda t: -t["cpu_percent"])
    agent.stop()
    return {"cpu_percent": total, "threads": threads, "seconds": wall, "load": os.getloadavg()}


def open_console(agent: Agent, port: int) -> dict[str, Any]:
    """The console's page open in headless Chromium, as an owner leaves a tab open."""
    from playwright.sync_api import sync_playwright

    ui = [bench.OURS[0], "ui", "--state-dir", str(agent.state), "--print-url"]
    link = subprocess.run(ui, capture_output=True, text=True, timeout=60, check=True).stdout
    pw = sync_playwright().start()
    browser = pw.chromium.launch(executable_path=shutil.which("chromium") or "chromium")
    page = browser.new_page()
    page.goto(link.strip())

    def close() -> None:
        browser.close()
        pw.stop()

    return {"page": page, "close": close}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--py-spy", default=shutil.which("py-spy"))
    ap.add_argument("--only", choices=("ours", "browser", "old"), action="append")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for our agent")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="flashnode-bench-quiet-"))
    server = CoordinatorServer(root)
    server.start()
    cases = {
        "ours": ("ours", False),
        "browser": ("ours", True),
        "old": ("old", False),
    }
    chosen = args.only or list(cases)
    raw: dict[str, list[dict[str, Any]]] = {c: [] for c in chosen}
    try:
        for _ in range(args.rounds):  # alternated: drift hits every contender alike
            for case in chosen:
                kind, browser = cases[case]
                env = dict(e.split("=", 1) for e in args.env) if kind == "ours" else None
                raw[case].append(sleeping(server, kind, args.seconds, browser, args.py_spy, env))
                print(case, f"{raw[case][-1]['cpu_percent']:.3f} %", flush=True)
    finally:
        server.close()
        shutil.rmtree(root, ignore_errors=True)
    for case, runs in raw.items():
        med = statistics.median(r["cpu_percent"] for r in runs)
        print(f"{case}: median {med:.3f} % of a core over {len(runs)} round(s)")
        for t in runs[-1]["threads"][:8]:
            print(f"    {t['cpu_percent']:.3f} %  {t['thread']}")
    OUT.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M"), "raw": raw}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
