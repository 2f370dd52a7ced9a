"""One attempt against fakes: the three locks, malformed leases, outputs, and the lease keeper."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease, trusted_runner

from flashnode.attempt import Attempt, LeaseKeeper, Outcome
from flashnode.attempt.keeper import LAST_TRY_S
from flashnode.coordinator.lease import parse_lease
from flashnode.errors import CoordinatorUnavailable, LeaseLost


def run(
    tmp_path: Path, data: Any, runner: Any = None, **settings: Any
) -> tuple[Outcome, FakeCoordinator, Any]:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    runner = runner or FakeRunner()
    outcome = Attempt(context(tmp_path, clock, coord, runner, **settings), data).run()
    return outcome, coord, runner


def failure_reason(coord: FakeCoordinator) -> str:
    fails = [c[2][1] for c in coord.calls if c[1] == "fail"]
    assert len(fails) == 1, coord.calls
    return str(fails[0])


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({"pool": None}, "must name a pool"),
        ({"pool": "team-b"}, "pool 'team-b' is not one this node serves"),
        (
            {"isolation": {"tier": "sandboxed", "allowFallback": False}},
            "does not allow running outside",
        ),
        ({"isolation": None}, "does not allow running outside"),
        ({"isolation": {"tier": "sandboxed", "allowFallback": "yes"}}, "not a boolean"),
    ],
)
def test_trusted_runner_refuses_work_missing_a_lock(
    tmp_path: Path, payload: dict[str, Any], reason: str
) -> None:
    runner = trusted_runner()
    outcome, coord, _ = run(tmp_path, lease(**payload), runner=runner)
    assert outcome is Outcome.FAILED
    assert reason in failure_reason(coord)
    assert not (tmp_path / "attempts").exists() or not any((tmp_path / "attempts").iterdir())


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({"argv": None}, "exactly one of argv and module"),
        ({"argv": "echo hi"}, "argv is not a non-empty list"),
        ({"argv": ["echo", 3]}, "argv is not a list of strings"),
        ({"argv": []}, "argv is not a non-empty list"),
        ({"isolation": "sandboxed"}, "isolation is not an object"),
        ({"env": {"A": 1}}, "env 'A' is not a string"),
        ({"env": {"A=B": "x"}}, "not a valid variable"),
        ({"inputs": {"data": "file:///etc/passwd"}}, "not an artifact:// URI"),
        ({"inputs": {"data": "http://127.0.0.1:8080/x"}}, "not an artifact:// URI"),
        ({"inputs": {"data": "artifact://../etc/passwd"}}, "unsafe artifact key"),
        ({"output_prefix": "/abs/"}, "output_prefix"),
        ({"output_prefix": "jobs/../x/"}, "output_prefix"),
        ({"timeout_seconds": "soon"}, "timeout_seconds is not a number"),
        ({"timeout_seconds": float("nan")}, "positive finite"),
        ({"gpus": True}, "gpus is not a non-negative integer"),
        ({"gpus": 1}, "asks for 1 GPU(s); this node has 0"),
        ({"checkpoint": "every hour"}, "checkpoint is not an object"),
        (
            {"checkpoint": {}, "inputs": {"resume": "artifact://shared/r.json"}},
            "'resume' is reserved",
        ),
        (
            {"module": "os", "argv": None},
            "not on this node's allowlist",
        ),
    ],
)
def test_malformed_payload_fails_the_attempt_with_a_reason(
    tmp_path: Path, payload: dict[str, Any], reason: str
) -> None:
    outcome, coord, runner = run(tmp_path, lease(**payload))
    assert outcome is Outcome.FAILED
    assert reason in failure_reason(coord)
    assert runner.started == []


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        "x",
        {"lease_id": "ls-1"},
        {"lease_id": "../x", "task_id": "t", "job_id": "j", "payload": {}},
    ],
)
def test_unusable_lease_envelope_is_dropped_or_failed_without_running(
    tmp_path: Path, data: Any
) -> None:
    outcome, coord, runner = run(tmp_path, data)
    assert runner.started == []
    if isinstance(data, dict) and data.get("lease_id") == "ls-1":
        assert outcome is Outcome.FAILED and "malformed lease" in failure_reason(coord)
    else:
        assert outcome is Outcome.DROPPED and not [c for c in coord.calls if c[1] == "fail"]


def test_non_zero_exit_fails_with_exit_code_and_stderr_tail(tmp_path: Path) -> None:
    outcome, coord, _ = run(tmp_path, lease(), runner=FakeRunner(code=3))
    assert outcome is Outcome.FAILED
    assert failure_reason(coord) == "exit code 3: some error | last line"


def test_command_metrics_must_be_a_json_object(tmp_path: Path) -> None:
    outcome, coord, _ = run(tmp_path, lease(), runner=FakeRunner(metrics=[1, 2]))  # type: ignore[arg-type]
    assert outcome is Outcome.FAILED
    assert failure_reason(coord) == "metrics.json must contain a JSON object"  # the coordinator's
    assert not [c for c in coord.calls if c[1] == "upload"]


def test_commit_uploads_metrics_last_and_sends_its_sha(tmp_path: Path) -> None:
    outcome, coord, _ = run(tmp_path, lease(inputs={"data": "artifact://shared/d.csv"}))
    assert outcome is Outcome.COMMITTED
    uploads = [c[2] for c in coord.calls if c[1] == "upload"]
    assert uploads[-1] == "jobs/j1/task-000/metrics.json"
    (_, sha, evidence) = next(c[2] for c in coord.calls if c[1] == "complete")
    import hashlib

    assert sha == hashlib.sha256(coord.uploads["jobs/j1/task-000/metrics.json"]).hexdigest()
    assert evidence.exit_code == 0 and evidence.gpu_util_percent_mean is None
    assert "download" in [c[1] for c in coord.calls]
    assert not (tmp_path / "attempts" / "ls-000000000000").exists()  # workspace cleaned


def test_not_accepted_is_final(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FakeCoordinator(clock, accept=False)
    outcome = Attempt(context(tmp_path, clock, coord, FakeRunner()), lease()).run()
    assert outcome is Outcome.REJECTED
    assert [c[1] for c in coord.calls].count("complete") == 1
    assert "fail" not in [c[1] for c in coord.calls]


class FlakyUploads(FakeCoordinator):
    def __init__(self, clock: FakeClock, failures: int) -> None:
        super().__init__(clock)
        self.failures = failures

    def upload(self, key: str, fh: BinaryIO, size: int) -> str:
        if self.failures:
            self.failures -= 1
            self._log("upload-error", key)
            raise CoordinatorUnavailable("503")
        return super().upload(key, fh, size)


def test_upload_retries_transient_errors_with_backoff(tmp_path: Path) -> None:
    clock = FakeClock()
    coord = FlakyUploads(clock, failures=4)
    outcome = Attempt(context(tmp_path, clock, coord, FakeRunner()), lease()).run()
    assert outcome is Outcome.COMMITTED
    errors = coord.names("upload-error")
    g = [b - a for a, b in zip(errors, errors[1:])]
    assert len(errors) == 4 and all(x > 0 for x in g)


# --- the lease keeper ----------------------------------------------------------------------


class ScriptedHeartbeats:
    def __init__(self, clock: FakeClock, answers: list[Exception | None]) -> None:
        self.clock, self.answers, self.times = clock, answers, []  # type: ignore[var-annotated]

    def attempt_heartbeat(self, lease_id: str) -> None:
        self.times.append(self.clock.now)
        answer = self.answers.pop(0) if self.answers else LeaseLost("gone", 410)
        if answer is not None:
            raise answer


def keeper_run(
    lease_seconds: float, answers: list[Exception | None]
) -> tuple[LeaseKeeper, ScriptedHeartbeats, FakeClock]:
    clock = FakeClock()
    hb = ScriptedHeartbeats(clock, answers)
    data = lease()
    data["lease_seconds"] = lease_seconds
    lost = threading.Event()
    keeper = LeaseKeeper(hb, parse_lease(data), clock, lost.set)  # type: ignore[arg-type]
    start = clock.now
    keeper.run()
    hb.times = [t - start for t in hb.times]
    assert lost.is_set()
    return keeper, hb, clock


def test_keeper_renews_every_third_of_the_lease_and_stops_on_410() -> None:
    keeper, hb, _ = keeper_run(60, [None, None, LeaseLost("lease is no longer live", 410)])
    assert hb.times == [20, 40, 60]
    assert "410" in keeper.reason


@pytest.mark.parametrize(
    ("seconds", "interval"), [(3, 2), (600, 60), (0, 2), (-5, 2), (float("nan"), 2), (1e12, 60)]
)
def test_keeper_interval_is_clamped(seconds: float, interval: float) -> None:
    _, hb, _ = keeper_run(seconds, [None])
    assert hb.times[0] == interval


def test_keeper_retries_transport_errors_until_just_before_the_deadline() -> None:
    keeper, hb, _ = keeper_run(150, [None] + [CoordinatorUnavailable("down")] * 50)
    # Renewed at 50 s; then errors: retried sooner than the interval, the last try a second
    # before 50 + 150 s (a backoff step of up to 50 s would have given up 40 s early).
    assert hb.times[0] == 50
    assert len(hb.times) > 3
    assert hb.times[-1] == pytest.approx(50 + 150 - LAST_TRY_S)
    assert "deadline" in keeper.reason


def kept_in_the_outbox(tmp_path: Path) -> tuple[Any, FakeCoordinator]:
    """An attempt stopped while it committed its finished result: the result is kept in the
    outbox (its workspace sealed) for the next start; the context a next start would use."""
    from flashnode.errors import Stopped

    clock = FakeClock()
    coord = FakeCoordinator(clock)
    ctx = context(tmp_path, clock, coord, FakeRunner(metrics={"loss": 0.5}))
    first = Attempt(ctx, lease(0))

    def upload(key: str, fh: BinaryIO, size: int) -> str:  # the agent stops during the commit
        first.cancel(Stopped("agent stopping"), 0.0)
        return FakeCoordinator.upload(coord, key, fh, size)

    coord.upload = upload  # type: ignore[method-assign]
    assert first.run() is Outcome.LAPSED
    coord.upload = FakeCoordinator.upload.__get__(coord)  # type: ignore[method-assign]
    coord.calls.clear()
    return ctx, coord


def test_a_result_kept_in_the_outbox_is_read_back_checked_again_and_committed(
    tmp_path: Path,
) -> None:
    import hashlib

    ctx, coord = kept_in_the_outbox(tmp_path)
    record = ctx.outbox.read("ls-000000000000")
    assert record is not None and record.state.value == "finished" and record.evidence
    resumed = Attempt(ctx, record.lease, record.slot, record=record)
    assert resumed.resume() is Outcome.COMMITTED
    [(lease_id, sha, evidence)] = [c[2] for c in coord.calls if c[1] == "complete"]
    metrics = json.dumps({"loss": 0.5}).encode()
    assert (lease_id, sha) == ("ls-000000000000", hashlib.sha256(metrics).hexdigest())
    assert evidence == record.evidence  # the run's, as spooled: the run is not repeated
    assert coord.uploads["jobs/j1/task-000/metrics.json"] == metrics
    assert ctx.outbox.read("ls-000000000000") is None
    assert not (tmp_path / "attempts" / "ls-000000000000").exists()


def test_outputs_changed_after_they_were_spooled_fail_the_resumed_commit(
    tmp_path: Path,
) -> None:
    ctx, coord = kept_in_the_outbox(tmp_path)
    record = ctx.outbox.read("ls-000000000000")
    assert record is not None
    metrics = tmp_path / "attempts" / "ls-000000000000" / "out" / "metrics.json"
    metrics.write_text('{"loss": 0.0}')  # the same size, other bytes
    assert Attempt(ctx, record.lease, record.slot, record=record).resume() is Outcome.FAILED
    assert [c[2] for c in coord.calls if c[1] == "fail"] == [
        ("ls-000000000000", "outputs changed on disk after the attempt finished")
    ]
    assert not [c for c in coord.calls if c[1] in ("upload", "complete")]
    assert ctx.outbox.read("ls-000000000000") is None
