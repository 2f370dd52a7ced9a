"""Bulk data (issue 44): outputs, checkpoints, a checkpoint restore and a dataset slice fetch of
200 MiB and 1 GiB, each against a bare httpx client's floor on the same real coordinator, and
against flashnode 0.4.1 where it can do the same work.

    .venv/bin/python benchmarks/bulk.py [--quick] [--rounds N] [--cases a,b] [--no-recycle]
        [--claim-backoff S]

As root (the trusted runner runs tasks as ``flashbulk-N``, made here where missing, so that it
never shares users with other agents or the tests). Per case and round, the contenders run in a
shuffled order, each against its own job and pool on the one coordinator; a round's figures are
the coordinator's own clock from the lease's claim to its accepted commit (for a restore: the
second attempt's claim), the agent's peak RSS above what it held just before (``VmHWM`` and
``VmRSS`` sampled every 20 ms), the coordinator's CPU and the load average then. An agent is
started, registered and claiming before its job is submitted (a restore's: after the seeding
attempt), and just before each job the case's size in page cache is written and freed
(``recycle``). Medians over the rounds, raw figures in ``benchmarks/bulk.json``. A benchmark,
not a test: nothing here asserts.

The floor does the same work with the least code: claim, run the same writer, then every file
read once (hashed as it streams) and PUT, the checkpoint's parts registered and committed, the
metrics PUT, complete; a restore GETs every part to disk hashing as it streams; a dataset slice
is one GET to disk hashed as it streams, then fsync'd (the agent's cache keeps it durable). A
``floor-par`` does the same with the files moved four at a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import platform
import pwd
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import CoordinatorServer, argv_job, wait_for  # noqa: E402

OURS = [str(ROOT / ".venv" / "bin" / "flashnode"), "work"]
OLD = [str(HERE / ".venv-041" / "bin" / "flashnode"), "work"]
TASK_USER = "flashbulk"  # slot N runs as flashbulk-N
MiB, GiB = 1 << 20, 1 << 30
CHUNK = MiB
PARALLEL = 4
BEFORE: list[str] = []  # the tree of the agent "before" runs from (--before)
RECYCLE = [True]  # page cache freed before each job (recycle); --no-recycle empties it
# Our agent's wait between two empty claims (--claim-backoff; drawn from half of it to all of it):
# when a job comes, the agent claims it within this, where the floor claims at once.
CLAIM_BACKOFF = ["0.5"]

# The task, for the agents and the floor alike. No braces: the coordinator formats a command
# with each task's params. Writes a 1 MiB pattern (not zeros: nothing on the way may shortcut).
WRITER = r"""
import hashlib, json, os, sys
mode, out, total, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
block = bytes(range(256)) * 4096
def write(path, size):
    h = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            b = block[:min(left, len(block))]
            f.write(b)
            h.update(b)
            left -= len(b)
    return h.hexdigest()
report = dict(mode=mode)
if mode == "out":
    for i in range(n):
        write(os.path.join(out, "data-%d.bin" % i), total // n)
elif mode == "ckpt":
    d = os.path.join(out, "ckpt", "checkpoint-1")
    os.makedirs(d)
    parts = []
    for i in range(n):
        name = "part-%d" % i
        parts.append(dict(key=name, sha256=write(os.path.join(d, name), total // n),
                          size_bytes=total // n))
    m = dict(step=1, world_size=1, framework="bench", storage_prefix=d, parts=parts)
    json.dump(m, open(os.path.join(d, "manifest.json.tmp"), "w"))
    os.rename(os.path.join(d, "manifest.json.tmp"), os.path.join(d, "manifest.json"))
elif mode == "restore":
    report["resume"] = os.environ.get("FLASHML_RESUME", "")
    if not report["resume"]:
        sys.exit(3)
elif mode == "data":
    report["size"] = os.stat(sys.argv[5]).st_size
json.dump(report, open(os.path.join(out, "metrics.json"), "w"))
"""


class Case:
    def __init__(self, name: str, kind: str, total: int, files: int) -> None:
        self.name, self.kind, self.total, self.files = name, kind, total, files

    def argv(self, extra: str = "") -> list[str]:
        args = ["python3", "-c", WRITER, self.kind, "/work/out", str(self.total), str(self.files)]
        return [*args, extra] if extra else args


def cases(quick: bool) -> list[Case]:
    small, big = (20 * MiB, 100 * MiB) if quick else (200 * MiB, GiB)
    s, b = ("20M", "100M") if quick else ("200M", "1G")
    return [
        Case(f"output {s} x1", "out", small, 1),
        Case(f"output {s} x4", "out", small, 4),
        Case(f"output {b} x1", "out", big, 1),
        Case(f"output {b} x4", "out", big, 4),
        Case(f"checkpoint {s} x4", "ckpt", small, 4),
        Case(f"checkpoint {b} x4", "ckpt", big, 4),
        Case(f"restore {b} x4", "restore", big, 4),
        Case(f"dataset {b} x1", "data", big, 1),
    ]


# --- helpers -----------------------------------------------------------------------------------


def task_users() -> None:
    for i in range(2):
        try:
            pwd.getpwnam(f"{TASK_USER}-{i}")
        except KeyError:
            subprocess.run(
                [
                    "useradd",
                    "--system",
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                    f"{TASK_USER}-{i}",
                ],
                check=True,
            )


def state_parent() -> Path:
    """Not under /tmp: a root agent's tasks get a private /tmp."""
    parent = Path("/var/lib/flashnode-bulk")
    parent.mkdir(mode=0o755, exist_ok=True)
    return parent


def cpu_seconds(pid: int) -> float:
    """A process's own CPU seconds (all its threads; not its children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stamps(server: CoordinatorServer, job: str) -> tuple[float, float]:
    """(last claim, accepted commit) of task-000, on the coordinator's clock."""
    claim = commit = float("nan")
    for e in server.events(job):
        if (e.get("data") or {}).get("task_id") != "task-000":
            continue
        ts = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
        if e["type"] == "LEASE_CLAIMED":
            claim = ts
        elif e["type"] == "TASK_COMMIT_ACCEPTED":
            commit = ts
    return claim, commit


def register_bare(c: httpx.Client, api: str, pool: str, name: str) -> str:
    node = f"{name}-{random.randrange(10**9)}"
    c.post(
        api + "/nodes/register",
        json={
            "node_id": node,
            "kubernetes_node": "",
            "hostname": name,
            "capabilities": {"pools": [pool], "dataset_cache_bytes": 8 * GiB},
            "unsandboxed_argv_capable": True,
            "module_capable": False,
        },
    ).raise_for_status()
    return node


def claim(c: httpx.Client, api: str, node: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = c.post(api + "/leases/claim", json={"node_id": node})
        if r.status_code == 200:
            return dict(r.json())
        time.sleep(0.02)
    raise RuntimeError("nothing to claim")


def streamed(path: Path, digest: Any) -> Iterator[bytes]:
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
            yield chunk


def put_file(c: httpx.Client, api: str, path: Path, key: str) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = path.stat().st_size
    r = c.put(
        f"{api}/artifacts/{key}",
        content=streamed(path, digest),
        headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
    )
    r.raise_for_status()
    assert r.json()["sha256"] == digest.hexdigest()
    return digest.hexdigest(), size


def get_file(c: httpx.Client, url: str, dest: Path, sync: bool = False) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with c.stream("GET", url) as r, dest.open("wb") as out:
        r.raise_for_status()
        for chunk in r.iter_bytes():  # as they arrive (re-chunking would copy)
            digest.update(chunk)
            out.write(chunk)
            size += len(chunk)
        if sync:
            out.flush()
            os.fsync(out.fileno())
    return digest.hexdigest(), size


def each(jobs: list[Callable[[], Any]], parallel: bool) -> list[Any]:
    if not parallel or len(jobs) < 2:
        return [job() for job in jobs]
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        return list(pool.map(lambda job: job(), jobs))


# --- the floor ---------------------------------------------------------------------------------


def floor(url: str, pool: str, case: Case, parallel: bool) -> dict[str, float]:
    """The floor's run; how long its writer (the task) took."""
    timings: dict[str, float] = {}
    api = url + "/v1alpha1"
    with httpx.Client(timeout=600) as c:
        node = register_bare(c, api, pool, "floor")
        lease = claim(c, api, node)
        lid, payload = lease["lease_id"], lease["payload"]
        prefix = payload["output_prefix"]
        work = Path(tempfile.mkdtemp(prefix="floor-", dir=state_parent()))
        try:
            (work / "out").mkdir()
            # The agent's tasks find the system's python3 (a task user cannot use root's
            # pyenv shims, which cost 0.1 s a start): so does the floor's writer.
            env = {**os.environ, "PATH": "/usr/local/bin:/usr/bin:/bin"}
            extra: list[str] = []
            if case.kind == "restore":
                env["FLASHML_RESUME"] = restore_floor(c, api, lease, work, parallel)
            if case.kind == "data":
                entry = payload["datasets"][0]["entries"][0]
                sha, size = get_file(c, entry["url"], work / "shard", sync=True)
                assert sha == entry["integrity"]["value"] and size == entry["size"]
                extra = [str(work / "shard")]
            argv = [a.replace("/work", str(work)) for a in payload["argv"]]
            began = time.monotonic()
            subprocess.run([*argv[:-1], *extra] if extra else argv, check=True, env=env)
            timings["writer"] = round(time.monotonic() - began, 4)
            out = work / "out"
            if case.kind == "out":
                files = sorted(out.glob("data-*"))
                began = time.monotonic()
                each([lambda p=p: put_file(c, api, p, prefix + p.name) for p in files], parallel)
                timings["upload"] = round(time.monotonic() - began, 4)
            if case.kind == "ckpt":
                d = out / "ckpt" / "checkpoint-1"
                base = f"{prefix}ckpt/{lid}/1/"
                files = sorted(d.iterdir())
                done = each(
                    [
                        lambda p=p: put_file(c, api, p, f"{base}checkpoint-1/{p.name}")
                        for p in files
                    ],
                    parallel,
                )
                parts = [
                    {"key": f"{base}checkpoint-1/{p.name}", "sha256": s, "size_bytes": n}
                    for p, (s, n) in zip(files, done, strict=True)
                ]
                ckpt = f"{api}/jobs/{lease['job_id']}/tasks/{lease['task_id']}/checkpoints"
                for part in parts:
                    c.post(
                        f"{ckpt}/parts", json={"attempt_id": lid, "step": 1, "part": part}
                    ).raise_for_status()
                c.post(
                    f"{ckpt}/commit",
                    json={
                        "attempt_id": lid,
                        "step": 1,
                        "expected_parts": parts,
                        "storage_prefix": "artifact://" + base,
                    },
                ).raise_for_status()
            sha, _ = put_file(c, api, out / "metrics.json", prefix + "metrics.json")
            r = c.post(f"{api}/attempts/{lid}/complete", json={"output_sha256": sha})
            assert r.json().get("accepted") is True, r.text
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return timings


def restore_floor(
    c: httpx.Client, api: str, lease: dict[str, Any], work: Path, parallel: bool
) -> str:
    ckpt = f"{api}/jobs/{lease['job_id']}/tasks/{lease['task_id']}/checkpoints"
    manifest = c.get(f"{ckpt}/latest").json()
    prefix = manifest["storage_prefix"][len("artifact://") :]
    dest = work / "resume"
    (dest / "checkpoint-1").mkdir(parents=True)

    def one(part: dict[str, Any]) -> None:
        rel = part["key"][len(prefix) :]
        sha, size = get_file(c, f"{api}/artifacts/{part['key']}", dest / rel)
        assert sha == part["sha256"] and size == part["size_bytes"]

    each([lambda p=p: one(p) for p in manifest["parts"]], parallel)
    return str(dest / "checkpoint-1")


def seed_checkpoint(url: str, pool: str, case: Case) -> None:
    """The first attempt of a restore case, by a bare client: the checkpoint (flashruntime's
    layout, ``case.files`` parts and a manifest) uploaded, registered and committed, then the
    lease failed, so the task is claimed again by the contender."""
    api = url + "/v1alpha1"
    with httpx.Client(timeout=600) as c:
        node = register_bare(c, api, pool, "seed")
        lease = claim(c, api, node)
        lid, payload = lease["lease_id"], lease["payload"]
        base = f"{payload['output_prefix']}ckpt/{lid}/1/"
        block = bytes(range(256)) * 4096
        size = case.total // case.files
        listed = []
        parts = []
        for i in range(case.files):
            digest = hashlib.sha256()

            def gen(digest: Any = digest) -> Iterator[bytes]:
                left = size
                while left:
                    b = block[: min(left, len(block))]
                    digest.update(b)
                    left -= len(b)
                    yield b

            key = f"{base}checkpoint-1/part-{i}"
            c.put(
                f"{api}/artifacts/{key}", content=gen(), headers={"Content-Length": str(size)}
            ).raise_for_status()
            listed.append({"key": f"part-{i}", "sha256": digest.hexdigest(), "size_bytes": size})
            parts.append({"key": key, "sha256": digest.hexdigest(), "size_bytes": size})
        manifest = json.dumps(
            {
                "step": 1,
                "world_size": 1,
                "framework": "bench",
                "storage_prefix": "x",
                "parts": listed,
            }
        ).encode()
        key = f"{base}checkpoint-1/manifest.json"
        c.put(f"{api}/artifacts/{key}", content=manifest).raise_for_status()
        parts.append(
            {
                "key": key,
                "sha256": hashlib.sha256(manifest).hexdigest(),
                "size_bytes": len(manifest),
            }
        )
        ckpt = f"{api}/jobs/{lease['job_id']}/tasks/{lease['task_id']}/checkpoints"
        for part in parts:
            c.post(
                f"{ckpt}/parts", json={"attempt_id": lid, "step": 1, "part": part}
            ).raise_for_status()
        c.post(
            f"{ckpt}/commit",
            json={
                "attempt_id": lid,
                "step": 1,
                "expected_parts": parts,
                "storage_prefix": "artifact://" + base,
            },
        ).raise_for_status()
        c.post(f"{api}/attempts/{lid}/fail", json={"reason": "seeded"}).raise_for_status()


# --- the agents --------------------------------------------------------------------------------


class Agent:
    def __init__(self, kind: str, url: str, pool: str, env: dict[str, str]) -> None:
        self.kind = kind
        self.state = Path(tempfile.mkdtemp(prefix=f"bulk-{kind}-", dir=state_parent()))
        self.state.chmod(0o755)
        base = {k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")}
        if kind in ("ours", "before"):
            cmd = [
                *(OURS if kind == "ours" else [sys.executable, "-m", "flashnode", "work"]),
                "--coordinator",
                url,
                "--runner",
                "trusted",
                "--pool",
                pool,
                "--state-dir",
                str(self.state),
                "--max-tasks",
                "1",
            ]
            if kind == "before":  # the same agent from another tree (an A/B): --before
                base["PYTHONPATH"] = BEFORE[0]
            elif os.environ.get("BULK_PYTHONPATH"):  # a debugging aid (a sitecustomize)
                base["PYTHONPATH"] = os.environ["BULK_PYTHONPATH"]
            base["FLASHNODE_TASK_USER"] = TASK_USER
            base["FLASHNODE_UI_LISTEN"] = "off"
            base["FLASHNODE_CLAIM_BACKOFF_MIN_SECONDS"] = CLAIM_BACKOFF[0]
            base["FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS"] = CLAIM_BACKOFF[0]
            base["FLASHNODE_MAX_OUTPUT_FILE_BYTES"] = str(2 * GiB)
            base["FLASHNODE_DATASET_CACHE_BYTES"] = str(4 * GiB)
            base["FLASHNODE_DATASET_ALLOW_PRIVATE_ORIGINS"] = "true"
        else:
            cmd = [
                *OLD,
                "--coordinator",
                url,
                "--runner",
                "trusted",
                "--log-json",
                "--max-tasks",
                "1",
            ]
            base["FLASHNODE_STATE_DIR"] = str(self.state)
            base["HOME"] = str(self.state)
        base.update(env)
        self.log = (self.state / "agent.log").open("wb")
        self.before = {n["node_id"] for n in httpx.get(url + "/v1alpha1/nodes", timeout=60).json()}
        self.url = url
        self.proc = subprocess.Popen(  # cwd: not a checkout's (-m puts it first on sys.path)
            cmd,
            env=base,
            stdout=self.log,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
            cwd=self.state,
        )
        self.node = wait_for(f"{kind} to register", self._registered, timeout=60)
        if kind == "old":
            httpx.post(
                f"{url}/v1alpha1/nodes/{self.node}/heartbeat",
                json={"node_id": self.node, "pools": [pool]},
                timeout=60,
            )
        time.sleep(0.5)  # settled after its start
        self.base_rss, self.base_hwm = self.status("VmRSS"), self.status("VmHWM")
        self.peak_rss = self.base_rss
        self.hwm = self.base_hwm
        self.cpu_base = self.cpu_last = self.cpu()
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._sample, daemon=True)
        self._watch.start()

    def _registered(self) -> str | None:
        nodes = httpx.get(self.url + "/v1alpha1/nodes", timeout=60).json()
        new = [n["node_id"] for n in nodes if n["node_id"] not in self.before]
        return new[0] if new else None

    def status(self, field: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def cpu(self) -> float:
        """The agent's own CPU seconds (its threads; not its tasks')."""
        return cpu_seconds(self.proc.pid)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak_rss = max(self.peak_rss, self.status("VmRSS"))
                self.hwm = max(self.hwm, self.status("VmHWM"))
                self.cpu_last = self.cpu()
            except (OSError, IndexError, ValueError):
                return

    def finish(self, timeout: float) -> dict[str, Any]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait(30)
        self._stop.set()
        self._watch.join()
        self.log.close()
        ledger = self.state / "ledger.jsonl"
        records = (
            [json.loads(x) for x in ledger.read_text().splitlines()] if ledger.exists() else []
        )
        log = (self.state / "agent.log").read_text(errors="replace")
        if os.environ.get("BULK_KEEP_LOGS"):
            keep = Path(os.environ["BULK_KEEP_LOGS"])
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{self.kind}-{self.node}.log").write_text(log)
        shutil.rmtree(self.state, ignore_errors=True)
        return {
            "rc": self.proc.returncode,
            "rss_increase_mb": (self.peak_rss - self.base_rss) / MiB,
            "hwm_increase_mb": (self.hwm - self.base_hwm) / MiB,
            "agent_cpu_s": round(self.cpu_last - self.cpu_base, 3),
            "base_rss_mb": self.base_rss / MiB,
            "timings": records[-1].get("timings") if records else None,
            "log_tail": log[-1500:] if self.proc.returncode else "",
        }


# --- one run -----------------------------------------------------------------------------------


def one(server: CoordinatorServer, case: Case, who: str, shard: dict[str, Any] | None) -> dict:
    pool = f"p{random.randrange(10**9)}"
    params: dict[str, Any] = {}
    argv = case.argv()
    if case.kind in ("ckpt", "restore"):
        params["checkpoint"] = {"interval_seconds": 600}
    if case.kind == "data":
        assert shard is not None
        params["dataset_slices"] = [[{"name": "ds", "entries": [shard]}]]
        argv = case.argv("/work/data/ds/" + shard["path"])
    spec = argv_job(argv, pool=pool, max_attempts=3, lease_seconds=600, **params)
    agent = None
    if not who.startswith("floor") and case.kind != "restore":
        # Started, registered and claiming before its job comes, as a daemon is: what is timed
        # is its work, not its start. (A restore's agent starts after the seed's attempt, which
        # it would otherwise claim itself.)
        agent = Agent(who, server.url, pool, {})
    load = os.getloadavg()[0]
    if case.kind != "restore":
        recycle(case)
    job = server.submit(spec)
    assert server.proc is not None
    coordinator_cpu = cpu_seconds(server.proc.pid)
    if case.kind == "restore":
        seed_checkpoint(server.url, pool, case)
        recycle(case)
    extra: dict[str, Any] = {}
    if who.startswith("floor"):
        extra["timings"] = floor(server.url, pool, case, parallel=who == "floor-par")
    else:
        agent = agent or Agent(who, server.url, pool, {})
        # It stops after its one task: waited for, not the coordinator asked every 0.1 s (3 ms
        # of its CPU each, taken from the agent's transfers on the one coordinator thread).
        extra = agent.finish(900)
        extra["state"] = server.job(job)["state"]
    server.wait_state(job, {"SUCCEEDED", "FAILED", "PARTIAL"}, timeout=60)
    claimed, committed = stamps(server, job)
    extra["coordinator_cpu_s"] = round(cpu_seconds(server.proc.pid) - coordinator_cpu, 3)
    clear_artifacts(server, job)
    return {"case": case.name, "who": who, "seconds": committed - claimed, "load": load, **extra}


def recycle(case: Case) -> None:
    """Page cache written and freed at once, enough for what the case writes (the task's files,
    the coordinator's copy of them, a download), just before each contender's job. On a VM
    whose host takes back the guest's free memory (virtio-balloon free page reporting, as here)
    a page that has been free for a few seconds costs about ten times a page's usual time when
    it is first written again (12 against 1 us for 4 KiB here); without this, which contender's
    writes got freshly freed pages depended on who ran right after a job's files were deleted.
    ``--no-recycle``: without it."""
    if not RECYCLE:
        return
    path = state_parent() / "recycle"
    block = bytes(MiB)
    with path.open("wb") as fh:
        for _ in range((2 * case.total + 256 * MiB) // MiB):
            fh.write(block)
    path.unlink()  # before its writeback: freed without touching the disk


def clear_artifacts(server: CoordinatorServer, job: str) -> None:
    """The job's objects off the coordinator's disk: 1 GiB each adds up."""
    shutil.rmtree(server.root / "data" / "artifacts" / "jobs" / job, ignore_errors=True)


def contenders(case: Case, skip_old: bool) -> list[str]:
    who = ["floor", "ours"]
    if case.files > 1 or case.kind == "restore":
        who.append("floor-par")
    if BEFORE:
        who.append("before")
    if case.kind in ("out", "data") and not skip_old:
        who.append("old")  # 0.4.1 ships single-file checkpoints only, restores only those
    return who


def machine() -> dict[str, Any]:
    disk = subprocess.run(
        ["df", "-h", "--output=source,fstype,size,avail", "/var/lib"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return {
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "disk": disk.strip(),
        "mem_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GiB, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--cases", default="", help="substrings of the case names to run, a,b")
    ap.add_argument("--no-old", action="store_true")
    ap.add_argument("--who", default="", help="only these contenders, a,b")
    ap.add_argument("--out", default=str(HERE / "bulk.json"))
    ap.add_argument("--before", default="", help="a tree of flashnode to A/B against")
    ap.add_argument("--table", default="", help="print the table of this bulk.json, run nothing")
    ap.add_argument("--no-recycle", action="store_true", help="no page cache freed before a job")
    ap.add_argument("--claim-backoff", default="0.5", help="our agent's claim backoff (s)")
    args = ap.parse_args()
    if args.table:
        print(table(Path(args.table)))
        return 0
    if args.before:
        BEFORE.append(args.before)
    CLAIM_BACKOFF[0] = args.claim_backoff
    if args.no_recycle:
        RECYCLE.clear()
    rounds = args.rounds or (1 if args.quick else 3)
    task_users()
    root = Path(tempfile.mkdtemp(prefix="bulk-coord-", dir=state_parent()))
    server = CoordinatorServer(root, env={"FLASHML_MAX_ARTIFACT_MB": "2048"})
    server.start()
    chosen = [
        c
        for c in cases(args.quick)
        if not args.cases or any(s in c.name for s in args.cases.split(","))
    ]
    results: list[dict[str, Any]] = []
    try:
        shard = None
        data = [c for c in chosen if c.kind == "data"]
        if data:
            shard = publish_shard(server, data[0].total)
        for case in chosen:
            for r in range(rounds):
                order = [w for w in contenders(case, args.no_old) if not args.who or w in args.who]
                random.shuffle(order)
                for who in order:
                    res = one(server, case, who, shard)
                    res["round"] = r
                    results.append(res)
                    print(
                        f"{case.name:22} {who:9} {res['seconds']:7.2f} s"
                        f"  rss+{res.get('rss_increase_mb', 0):6.1f} MB  load {res['load']:.2f}"
                        f"  coordinator cpu {res['coordinator_cpu_s']:.2f} s"
                        f"  {res.get('state', '')} {res.get('timings') or ''}",
                        flush=True,
                    )
                    if res.get("log_tail"):
                        print(res["log_tail"], flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    summary = summarise(results)
    Path(args.out).write_text(
        json.dumps(
            {
                "machine": machine(),
                "rounds": rounds,
                "recycle": bool(RECYCLE),
                "quick": args.quick,
                "summary": summary,
                "raw": results,
            },
            indent=1,
        )
        + "\n"
    )
    for row in summary:
        print(json.dumps(row))
    return 0


def publish_shard(server: CoordinatorServer, size: int) -> dict[str, Any]:
    """The dataset's shard, an object on the coordinator (its GET is the origin)."""
    block = bytes(range(256)) * 4096
    digest = hashlib.sha256()

    def gen() -> Iterator[bytes]:
        left = size
        while left:
            b = block[: min(left, len(block))]
            digest.update(b)
            left -= len(b)
            yield b

    with httpx.Client(timeout=600) as c:
        c.put(
            f"{server.url}/v1alpha1/artifacts/datasets/shard.bin",
            content=gen(),
            headers={"Content-Length": str(size)},
        ).raise_for_status()
    return {
        "path": "shard.bin",
        "url": f"{server.url}/v1alpha1/artifacts/datasets/shard.bin",
        "size": size,
        "integrity": {"kind": "sha256", "value": digest.hexdigest()},
    }


def table(path: Path) -> str:
    """The markdown table of a bulk.json, for RESULTS.md."""
    data = json.loads(path.read_text())
    lines = [
        "| case | floor (s) | floor, 4 at a time (s) | ours (s) | ours / best floor |"
        " ours: RSS increase (MB) | 0.4.1 (s) | 0.4.1: RSS increase (MB) | load |"
        " target (<= 1.3 x, <= 32 MB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["summary"]:
        old = row.get("old")
        lines.append(
            f"| {row['case']} | {row['floor']:.2f} | "
            + (f"{row['floor-par']:.2f}" if "floor-par" in row else "")
            + f" | {row['ours']:.2f} | {row['ratio']:.2f} | {row['rss_increase_mb']:.1f} | "
            + (f"{old:.2f} ({row['ratio_old']:.2f} x)" if old is not None else "cannot")
            + " | "
            + (f"{row['rss_increase_mb_old']:.0f}" if old is not None else "")
            + f" | {row['load']:.2f} | {'met' if row['met'] else '**missed**'} |"
        )
    return "\n".join(lines)


def summarise(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name in dict.fromkeys(r["case"] for r in results):
        mine = [r for r in results if r["case"] == name]
        med = {
            who: statistics.median(r["seconds"] for r in mine if r["who"] == who)
            for who in dict.fromkeys(r["who"] for r in mine)
        }
        best = min((v for k, v in med.items() if k.startswith("floor")), default=float("nan"))
        row: dict[str, Any] = {"case": name, **{k: round(v, 3) for k, v in med.items()}}
        row["floor_best"] = round(best, 3)
        row["ratio"] = round(med["ours"] / best, 3) if "ours" in med else None
        for who in ("old", "before"):
            if who in med:
                row[f"ratio_{who}"] = round(med[who] / best, 3)
                rss = [r["rss_increase_mb"] for r in mine if r["who"] == who]
                row[f"rss_increase_mb_{who}"] = round(max(rss), 1)
        rss = [r["rss_increase_mb"] for r in mine if r["who"] == "ours"]
        row["rss_increase_mb"] = round(max(rss), 1) if rss else None
        hwm = [r["hwm_increase_mb"] for r in mine if r["who"] == "ours"]
        row["hwm_increase_mb"] = round(max(hwm), 1) if hwm else None
        for who in ("ours", "before"):
            cpu = [r["agent_cpu_s"] for r in mine if r["who"] == who]
            if cpu:
                row[f"agent_cpu_s_{who}"] = round(statistics.median(cpu), 3)
            for phase in ("restore", "data", "commit.upload", "execute"):
                got = [(r.get("timings") or {}).get(phase) for r in mine if r["who"] == who]
                if got and all(got):
                    row[f"{phase}_s_{who}"] = round(statistics.median(got), 3)
        for who in med:  # the same bytes each: more CPU is the machine's, or asked of it
            cpu = [r["coordinator_cpu_s"] for r in mine if r["who"] == who]
            row[f"coordinator_cpu_s_{who}"] = round(statistics.median(cpu), 3)
        floors = [r["seconds"] for r in mine if r["who"] == "floor"]
        if floors:
            row["floor_range"] = [round(min(floors), 3), round(max(floors), 3)]
        row["load"] = round(statistics.median(r["load"] for r in mine), 2)
        spread = [r["seconds"] for r in mine if r["who"] == "ours"]
        row["ours_range"] = [round(min(spread), 3), round(max(spread), 3)] if spread else None
        row["met"] = bool(
            row["ratio"] is not None and row["ratio"] <= 1.3 and (row["rss_increase_mb"] or 0) <= 32
        )
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
