"""Federated averaging end to end: the real coordinator, the real `run_fedavg` driver, and
flashnode agents whose workers commit metrics.json and delta.json."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from flashml_workloads.chunks import chunk_sequence, slot_start
from flashml_workloads.fedavg_driver import HttpCoordinator, RoundPlan, run_fedavg
from flashml_workloads.fedavg_weights import encode
from harness import AgentProcess, CoordinatorServer, argv_job, wait_for

TASK_PYTHON = os.environ.get("FLASHNODE_TEST_TASK_PYTHON", "/opt/flashnode-task-venv/bin/python")
POOL = "team-fed"
FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
WORKER = {
    "local_steps": 3,
    "lr": 0.1,
    "batch_size": 8,
    "seed": 0,
    "in_dim": 4,
    "hidden": 8,
    "out_dim": 2,
    "dataset_size": 64,
}


def agents(
    start_agent: Callable[..., AgentProcess], url: str, n: int = 2, **env: str
) -> list[AgentProcess]:
    return [
        start_agent(
            url,
            "--runner",
            "trusted",
            "--pool",
            POOL,
            env={**FAST, "FLASHNODE_TASK_PYTHON": TASK_PYTHON, **env},
        )
        for _ in range(n)
    ]


def flatten(weights: dict[str, Any]) -> list[float]:
    return [x for name in sorted(weights) for x in weights[name]["data"]]


@pytest.mark.usefixtures("task_python")
def test_three_rounds_over_the_built_in_model(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    workers = agents(start_agent, coordinator.url)
    for a in workers:
        a.wait_log("registered as node")
    assert all("module tasks on" in a.log for a in workers)
    rounds: list[dict[str, Any]] = []
    result = run_fedavg(
        HttpCoordinator(coordinator.url),
        epochs=3,
        sync_every=1.0,
        total_chunks=4,
        slots=2,
        worker_params=WORKER,
        initial_weights={},
        expected_machines=2,
        round_timeout_s=120,
        poll_seconds=0.5,
        lease_seconds=60,
        pool=POOL,
        on_round=rounds.append,
    )
    assert len(rounds) == 3
    for r in rounds:
        # The driver moves on once a round's chunks are covered; its last tasks may still commit.
        assert (
            coordinator.wait_state(r["job_id"], {"SUCCEEDED", "FAILED", "PARTIAL"}, timeout=120)
            == "SUCCEEDED"
        )
        assert r["clipped"] == [] and r["participants"] >= 1
    weights = [flatten(h["weights"]) if "weights" in h else None for h in result["history"]]
    if all(w is not None for w in weights):
        assert all(a != b for a, b in zip(weights, weights[1:]))
    assert all(math.isfinite(x) for x in flatten(result["weights"]))
    ledger = wait_for(
        "six attempts in the ledgers",
        lambda: len(x := [r for a in workers for r in a.ledger()]) == 6 and x,
    )
    assert {r["outcome"] for r in ledger} == {"committed"}


# --- rounds built from an argv worker script (the driver's build_round hook) ----------------

ARGV_WORKER = (
    "import json, sys\n"
    "chunks, scale, round_ = json.loads(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])\n"
    "value = float('nan') if scale < 0 else 0.01 * scale\n"
    "json.dump({'w': {'shape': [2], 'data': [value, value]}}, open('delta.json', 'w'))\n"
    "json.dump({'chunks_done': chunks, 'delta_file': 'delta.json', 'local_steps': 1, 'loss': 0.5,"
    " 'round': round_, 'samples': 10 * len(chunks)}, open('metrics.json', 'w'))\n"
)


def argv_rounds(
    slots: int, total_chunks: int, scales: list[float]
) -> Callable[[int, str | None], RoundPlan]:
    """Rounds whose slot i runs the argv worker with delta scale scales[i] (negative: NaN)."""

    def build(round_idx: int, weights_uri: str | None) -> RoundPlan:
        target = total_chunks
        offset = (round_idx * target) % total_chunks
        budget = math.ceil(target / slots)
        params = [
            {
                "chunks": json.dumps(
                    chunk_sequence(slot_start(i, total_chunks, slots, offset), total_chunks, budget)
                ),
                "scale": scales[i],
                "round": round_idx,
            }
            for i in range(slots)
        ]
        script = ARGV_WORKER.replace("{", "{{").replace("}", "}}")  # argv tokens are templates
        body = argv_job(
            ["python3", "-c", script, "{chunks}", "{scale}", "{round}"],
            pool=POOL,
            params=params,
            max_attempts=1,
        )
        body["spec"]["retryPolicy"]["allowPartial"] = (
            True  # a refused worker must not fail the round
        )
        return {"body": body, "task_ids": [f"task-{i:03d}" for i in range(slots)]}

    return build


def one_argv_round(
    coordinator: CoordinatorServer, scales: list[float], round_timeout_s: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One real driver round over 6 chunks whose 3 slots run the argv worker with ``scales``:
    (the round's report, the driver's result)."""
    rounds: list[dict[str, Any]] = []
    result = run_fedavg(
        HttpCoordinator(coordinator.url),
        epochs=1,
        sync_every=1.0,
        total_chunks=6,
        slots=3,
        worker_params=WORKER,
        initial_weights=encode({"w": ([2], [0.0, 0.0])}),
        expected_machines=3,
        round_timeout_s=round_timeout_s,
        poll_seconds=0.5,
        pool=POOL,
        on_round=rounds.append,
        build_round=argv_rounds(3, 6, scales),
    )
    [r] = rounds
    return dict(r), result


def test_a_scaled_delta_is_clipped_and_named(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    agents(start_agent, coordinator.url)
    r, _ = one_argv_round(coordinator, [1.0, 1e6, 1.0], round_timeout_s=60)
    assert coordinator.wait_state(r["job_id"], {"SUCCEEDED", "FAILED", "PARTIAL"}) == "SUCCEEDED"
    assert [c["task_id"] for c in r["clipped"]] == ["task-001"]


def test_a_nan_delta_fails_at_the_agent_and_the_round_completes_from_the_others(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    workers = agents(start_agent, coordinator.url)
    r, result = one_argv_round(coordinator, [1.0, -1.0, 1.0], round_timeout_s=15)
    assert r["participants"] == 2
    assert all(math.isfinite(x) for x in flatten(result["weights"]))
    failed = [
        e["message"] for e in coordinator.events(r["job_id"]) if e["type"] == "TASK_ATTEMPT_FAILED"
    ]
    assert len(failed) == 1 and "parameter 'w'" in failed[0], failed
    assert any(rec["outcome"] == "failed" for a in workers for rec in a.ledger())


BIG_DELTA = (
    "import json, sys\n"
    "n = int(sys.argv[1])\n"
    "with open('delta.json', 'w') as f:\n"
    '    f.write(\'{"w": {"shape": [%d], "data": [\' % n)\n'
    "    row = ','.join(['0.001234567'] * 100000)\n"
    "    for i in range(n // 100000):\n"
    "        f.write(('' if i == 0 else ',') + row)\n"
    "    f.write(']}}')\n"
    "json.dump({'chunks_done': [0], 'delta_file': 'delta.json', 'local_steps': 1, 'loss': 0.5, 'round': 0, 'samples': 1}, open('metrics.json', 'w'))\n"
)


def test_a_300_mb_delta_is_checked_and_uploaded_in_bounded_memory(
    tmp_path: Path, start_agent: Callable[..., AgentProcess]
) -> None:
    server = CoordinatorServer(tmp_path / "big", env={"FLASHML_MAX_ARTIFACT_MB": "512"})
    server.root.mkdir()
    server.start()
    try:
        n = 25_000_000  # 12 bytes a value: about 300 MB
        job = server.submit(argv_job(["python3", "-c", BIG_DELTA, str(n)], pool=POOL))
        [agent] = agents(
            start_agent, server.url, n=1, FLASHNODE_MAX_OUTPUT_FILE_BYTES=str(512 << 20)
        )
        agent.wait_log("registered as node")
        proc = psutil.Process(agent.proc.pid)
        baseline = proc.memory_info().rss
        peak = [baseline]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                try:
                    peak[0] = max(peak[0], proc.memory_info().rss)
                except psutil.Error:
                    return
                time.sleep(0.05)

        threading.Thread(target=watch, daemon=True).start()
        assert server.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=180) == "SUCCEEDED", (
            agent.log
        )
        stop.set()
        size = next(
            a["size_bytes"]
            for a in server.http.get(f"/jobs/{job}/artifacts").json()
            if a["key"].endswith("delta.json")
        )
        assert size > 290_000_000
        growth = peak[0] - baseline
        print(
            f"\nagent RSS growth while checking and uploading a {size >> 20} MB delta: {growth >> 20} MB"
        )
        assert growth < 64 << 20
    finally:
        server.close()


def test_fedavg_output_checks_name_the_problem(tmp_path: Path) -> None:
    from flashnode.coordinator.checks import check_fedavg
    from flashnode.errors import AttemptFailed

    out = tmp_path
    good = {
        "chunks_done": [0],
        "delta_file": "delta.json",
        "local_steps": 1,
        "loss": 0.5,
        "round": 0,
        "samples": 1,
    }
    (out / "delta.json").write_text(json.dumps({"w": {"shape": [1], "data": [0.1]}}))

    def opener(name: str) -> Any:
        path = out / name
        return path.open("rb") if path.is_file() else None

    check_fedavg(good, opener)
    for change, reason in [
        ({"samples": None}, "lacks 'samples'"),
        ({"loss": "low"}, "'loss' has the wrong type"),
        ({"chunks_done": [True]}, "not a list of integers"),
        ({"delta_file": "../etc/passwd"}, "not a safe bare file name"),
        ({"delta_file": "missing.json"}, "not a file in out/"),
        ({"samples": -1}, "'samples' must be positive"),
        ({"samples": 0}, "'samples' must be positive"),
    ]:
        with pytest.raises(AttemptFailed, match=reason.replace("(", r"\(")):
            check_fedavg({**good, **change}, opener)
    check_fedavg({**good, "samples": 0, "chunks_done": []}, opener)  # uncredited: the driver skips
