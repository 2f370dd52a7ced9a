"""How long the coordinator works on after it records a task's events (issue 31): a bare client
(no agent) claims, uploads metrics.json and completes N trivial tasks, timing each call, and the
coordinator's own events (``LEASE_CLAIMED``, ``TASK_COMMIT_ACCEPTED``) are set against the calls.

profile.py counts "claim event -> attempt made" and "commit event - phases" from those events: what
of them is the coordinator's, after its event and before its answer, every client pays alike.

    .venv/bin/python benchmarks/coordinator_lag.py [-n 100]

Run after ``benchmarks/run`` (its venv). Not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from bench import TRIVIAL, CoordinatorServer, events_by_task, register_bare
from harness import argv_job


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("-n", type=int, default=100)
    args = p.parse_args()
    server = CoordinatorServer(Path(tempfile.mkdtemp(prefix="flashnode-lag-")))
    server.start()
    try:
        pool = f"p{random.randrange(10**9)}"
        params = [{} for _ in range(args.n)]
        job = server.submit(argv_job(TRIVIAL, pool=pool, params=params, max_attempts=1))
        api = server.url + "/v1alpha1"
        calls: dict[str, tuple[float, float, float, float]] = {}
        with httpx.Client() as c:
            node = register_bare(c, api, pool, "lag")
            while len(calls) < args.n:
                sent = time.time()
                r = c.post(api + "/leases/claim", json={"node_id": node})
                answered = time.time()
                if r.status_code == 204:
                    time.sleep(0.01)
                    continue
                lease = r.json()
                data = b"{}"
                c.put(
                    f"{api}/artifacts/{lease['payload']['output_prefix']}metrics.json", content=data
                )
                completing = time.time()
                c.post(
                    f"{api}/attempts/{lease['lease_id']}/complete",
                    json={"output_sha256": hashlib.sha256(data).hexdigest()},
                )
                calls[lease["task_id"]] = (sent, answered, completing, time.time())
        ev = events_by_task(server, job)
    finally:
        server.close()
    rows = [(calls[t], ev[t]) for t in calls if t in ev]
    ms = {
        "claim: sent -> event": [(e["LEASE_CLAIMED"] - c[0]) * 1e3 for c, e in rows],
        "claim: event -> answered": [(c[1] - e["LEASE_CLAIMED"]) * 1e3 for c, e in rows],
        "complete: sent -> event": [(e["TASK_COMMIT_ACCEPTED"] - c[2]) * 1e3 for c, e in rows],
        "complete: event -> answered": [(c[3] - e["TASK_COMMIT_ACCEPTED"]) * 1e3 for c, e in rows],
    }
    out = {
        k: {"p50": statistics.median(v), "p95": sorted(v)[int(len(v) * 0.95)]}
        for k, v in ms.items()
    }
    out["load_1min"] = os.getloadavg()[0]  # type: ignore[assignment]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
