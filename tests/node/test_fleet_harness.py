"""The fleet benchmark's harness (benchmarks/fleet.py), as a smoke test of ten nodes (the
benchmark's smallest fleet, at a quick pace: about half a minute): it runs, and each measure it
reports comes from what happened. The numbers are benchmarks, never asserted here (deselect with
``-m 'not fleet'``)."""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest
from harness import TASK_USER, shared_dir

pytestmark = [pytest.mark.integration, pytest.mark.fleet]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
fleet = importlib.import_module("fleet")

NODES = 10


def test_ten_nodes_go_through_idle_burst_and_restart_and_the_table_reports_them() -> None:
    states = shared_dir("flashnode-fleet-")
    states.chmod(0o755)  # the task user passes through to its workspace
    o = fleet.Options(
        settle=1.0,
        idle=2.0,
        launch_per_s=20.0,
        ours=[sys.executable, "-m", "flashnode", "work"],
        task_user=TASK_USER,
        # A quick pace, so that the smoke takes seconds: the sweep runs the defaults.
        env={"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "1", "FLASHNODE_HEARTBEAT_SECONDS": "1"},
        after_restart=0.5,
        before_restart=1.0,
        state_parent=states,
    )
    try:
        point = fleet.run_point("ours", NODES, o)
    finally:
        shutil.rmtree(states, ignore_errors=True)
    assert point["idle"]["heartbeats_per_s"] > 0 and point["idle"]["claims_per_s"] > 0
    assert point["memory"]["rss_per_node_mb"] > 10
    burst = point["burst"]
    assert burst["tasks"] == burst["committed"] == 5 * NODES
    assert 0 < burst["dispatch_p50_s"] <= burst["dispatch_p95_s"] <= burst["to_last_commit_s"]
    restart = point["restart"]
    assert restart["registers"] >= NODES and restart["peak_requests_per_s"] >= 3
    row = fleet.table([point]).splitlines()[-1]
    assert row.startswith(f"| ours | {NODES} |")
