"""Hostile answers and hostile tasks: a misbehaving coordinator, fuzzed leases, and a task that
hunts for the agent's secrets. Each ends in a reason and a clean state; the agent keeps running."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from badcoord import BadCoordinator, answer, drip, lease_answer
from conftest import TokenCoordinator
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, trusted_runner
from harness import AgentProcess, argv_job
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashnode.attempt import Attempt, Outcome
from flashnode.config.settings import Settings
from flashnode.coordinator.client import Coordinator
from flashnode.coordinator.lease import Task
from flashnode.coordinator.messages import NodeCapabilities, NodeRegistration
from flashnode.errors import CoordinatorError, CoordinatorUnavailable

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")


@pytest.fixture
def bad() -> Iterator[BadCoordinator]:
    server = BadCoordinator()
    yield server
    server.close()


def registration() -> NodeRegistration:
    return NodeRegistration(node_id="n1", hostname="h", capabilities=NodeCapabilities())


def test_invalid_json_and_huge_claim_answers_are_survived(
    bad: BadCoordinator, start_agent: Callable[..., AgentProcess]
) -> None:
    bad.claims = [
        answer(200, b"{not json"),
        answer(200, b"[" + b"1," * (5 << 20) + b"1]"),
        lease_answer(1),
    ]
    agent = start_agent(bad.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    assert [c[0] for c in bad.completes] == ["ls-000000000001"]
    assert bad.count("/leases/claim") == 3
    # One line for the failure episode (not one per bad answer), one when claims work again.
    assert agent.log.count("claim failing") == 1 and "claim answer is not JSON" in agent.log
    assert "claim works again" in agent.log


def test_trusted_work_missing_its_pool_or_fallback_is_refused_and_never_runs(
    bad: BadCoordinator, start_agent: Callable[..., AgentProcess], drop_dir: Path
) -> None:
    marker = drop_dir / "ran"
    argv = ["sh", "-c", f"touch {marker}; echo '{{}}' > metrics.json"]
    bad.claims = [
        lease_answer(1, argv=argv, pool=None),
        lease_answer(2, argv=argv, isolation={"tier": "sandboxed", "allowFallback": False}),
        lease_answer(3, argv=argv, isolation={"tier": "sandboxed", "allowFallback": "true"}),
        lease_answer(4, argv=argv, pool="someone-elses-pool"),
    ]
    agent = start_agent(bad.url, *TRUSTED, "--max-tasks", "4", env=FAST)
    assert agent.wait(60) == 0, agent.log
    reasons = dict(bad.fails)
    assert "must name a pool" in reasons["ls-000000000001"]
    assert "does not allow running outside a sandbox" in reasons["ls-000000000002"]
    assert "not a boolean" in reasons["ls-000000000003"]
    assert "is not one this node serves" in reasons["ls-000000000004"]
    assert not marker.exists() and bad.completes == []


def test_absurd_lease_seconds_still_run_and_commit(
    bad: BadCoordinator, start_agent: Callable[..., AgentProcess]
) -> None:
    bad.claims = [
        lease_answer(i, ls) for i, ls in enumerate(["0", "-5", "NaN", "1e308", "Infinity"])
    ]
    agent = start_agent(bad.url, *TRUSTED, "--max-tasks", "5", env=FAST)
    assert agent.wait(60) == 0, agent.log
    assert len(bad.completes) == 5


def test_a_dripping_answer_is_cut_off_by_the_deadline(bad: BadCoordinator) -> None:
    bad.overrides["/v1alpha1/nodes/register"] = drip(
        b'{"node_id": "n1", "status": "registered"}', 0.5
    )
    client = Coordinator(bad.url, answer_deadline=2.0)
    start = time.monotonic()
    with pytest.raises(CoordinatorUnavailable, match="too slow"):
        client.register(registration())
    assert time.monotonic() - start < 5
    client.close()


def test_redirects_are_not_followed_and_credentials_stay_home(bad: BadCoordinator) -> None:
    elsewhere = BadCoordinator()
    try:
        bad.overrides["/v1alpha1/leases/claim"] = answer(
            307, None, {"Location": elsewhere.url + "/v1alpha1/leases/claim"}
        )
        client = Coordinator(bad.url, token="secret-token", join_code="secret-join")
        with pytest.raises(CoordinatorError, match="redirect 307 refused"):
            client.claim("n1")
        client.close()
        assert elsewhere.requests == []
        assert bad.requests[-1][3]["Authorization"] == "Bearer secret-token"
    finally:
        elsewhere.close()


def test_a_5xx_storm_is_met_with_backoff(
    bad: BadCoordinator, start_agent: Callable[..., AgentProcess]
) -> None:
    bad.overrides["/v1alpha1/leases/claim"] = answer(503, {"detail": "overloaded"})
    agent = start_agent(bad.url, *TRUSTED, env=FAST)
    agent.wait_log("claim failing")
    time.sleep(10)  # the storm's duration
    assert agent.proc.poll() is None
    # Backoff 1, 2, 4, 8 s (jittered): about 4 claims in 10 s, never one per tick.
    assert bad.count("/leases/claim") <= 6
    assert agent.log.count("claim failing") == 1


# --- fuzzed leases ---------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
payloads = st.fixed_dictionaries(
    {},
    optional={
        "argv": json_values | st.lists(st.text(max_size=12), max_size=3),
        "module": json_values,
        "env": json_values | st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
        "inputs": json_values
        | st.dictionaries(st.text(max_size=8), st.text(max_size=30), max_size=2),
        "unpack_inputs": json_values,
        "isolation": json_values | st.fixed_dictionaries({"allowFallback": json_values}),
        "pool": json_values | st.just("team-a"),
        "output_prefix": json_values | st.just("jobs/j1/task-000/"),
        "task_id": json_values,
        "timeout_seconds": json_values,
        "gpus": json_values,
        "checkpoint": json_values,
        "datasets": json_values,
    },
)


class CheckedFakeRunner(FakeRunner):
    """The trusted runner's checks, with a fake start: nothing is run on the host."""

    def check(self, task: Task, settings: Settings) -> None:
        runner = trusted_runner()
        runner.check(task, runner.settings)


def _run(data: Any) -> tuple[Outcome, FakeCoordinator]:
    with tempfile.TemporaryDirectory() as tmp:
        clock = FakeClock()
        coord = FakeCoordinator(clock)
        outcome = Attempt(context(Path(tmp), clock, coord, CheckedFakeRunner()), data).run()
        return outcome, coord


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=payloads, lease_seconds=json_values)
def test_fuzzed_payloads_end_in_an_outcome_with_a_reason(
    payload: dict[str, Any], lease_seconds: Any
) -> None:
    data = {
        "lease_id": "ls-1",
        "task_id": "task-000",
        "job_id": "j1",
        "lease_seconds": lease_seconds,
        "payload": payload,
    }
    outcome, coord = _run(data)
    fails = [c[2][1] for c in coord.calls if c[1] == "fail"]
    if outcome is Outcome.FAILED:
        assert len(fails) == 1 and fails[0].strip() and len(fails[0]) <= 500
    else:
        # LAPSED: a task this node should not have been given (a module task on a node without
        # task_python): not the task's fault, so nothing is reported.
        assert outcome in (Outcome.COMMITTED, Outcome.LAPSED) and fails == []


@settings(max_examples=200, deadline=None)
@given(data=json_values)
def test_fuzzed_lease_envelopes_never_crash(data: Any) -> None:
    outcome, _ = _run(data)
    assert outcome in (Outcome.DROPPED, Outcome.FAILED, Outcome.COMMITTED, Outcome.LAPSED)


# --- a task that hunts for the agent's secrets -------------------------------------------------

HUNT = r"""
import json, os, sys, time
needles = [n.encode() for n in sys.argv[1:]]
found, scanned, deadline = [], 0, time.monotonic() + 20
roots = ['/etc', '/tmp', '/var', '/home', '/root', '/opt', '/run', os.environ.get('FLASHML_WORK_DIR', '.')]
def check(path):
    global scanned
    try:
        with open(path, 'rb') as fh:
            data = fh.read(1 << 20)
    except OSError:
        return
    scanned += 1
    if any(n in data for n in needles):
        found.append(path)
for pid in os.listdir('/proc'):
    if pid.isdigit():
        for name in ('environ', 'cmdline'):
            check(f'/proc/{pid}/{name}')
for root in roots:
    for dirpath, dirnames, filenames in os.walk(root):
        if time.monotonic() > deadline:
            break
        for f in filenames:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p) and os.path.isfile(p):
                check(p)
for k, v in os.environ.items():
    if any(n in (k + v).encode() for n in needles):
        found.append('env:' + k)
json.dump({'found': found, 'scanned': scanned, 'argv': sys.argv[1:] and 'given'}, open('metrics.json', 'w'))
"""


def test_a_task_searching_everything_it_can_read_finds_no_secret(
    token_coordinator: TokenCoordinator, start_agent: Callable[..., AgentProcess]
) -> None:
    tc = token_coordinator
    token, join_code = tc.token, tc.join_code
    # The task reads the secrets' halves from its argv and looks for them whole: the needle it
    # searches for is then in no argv of any process.
    halves = [token[:10], token[10:], join_code[:11], join_code[11:]]
    script = HUNT.replace(
        "needles = [n.encode() for n in sys.argv[1:]]",
        "a = sys.argv[1:]; needles = [(a[0] + a[1]).encode(), (a[2] + a[3]).encode()]",
    )
    job = tc.server.submit(argv_job(["python3", "-c", script, *halves]))
    agent = start_agent(
        tc.server.url,
        *TRUSTED,
        *tc.agent_args(),
        "--max-tasks",
        "1",
        env={**FAST, **tc.agent_env()},
    )
    assert agent.wait(60) == 0, agent.log
    assert tc.server.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    report = json.loads(tc.server.artifact(f"jobs/{job}/task-000/metrics.json"))
    if os.geteuid() == 0:  # a task run as the agent's own user can read what the agent can
        assert report["found"] == [], report
    assert report["scanned"] > 10
    assert token not in agent.log and join_code not in agent.log
