"""What the console's data says, without a browser or an agent: a job's name and state as the
coordinator gives them (hostile text escaped, asked once, a silent coordinator asked again
later), which attempts may have lowered the coordinator's scores and who caused each, and a
running task's pool and step as ``flashnode status`` shows them."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from harness import wait_for

from flashnode.config.settings import Settings
from flashnode.console import auth
from flashnode.console.app import App
from flashnode.console.lookups import MISS_KEEP_S, WANTED_MAX
from flashnode.console.server import Request
from flashnode.console.usage import UsageRing
from flashnode.console.wiring import Wiring
from flashnode.errors import CoordinatorUnavailable
from flashnode.owner import status

NOW = 1_800_000_000.0


class Coordinator:
    """GET /jobs/{id} and GET /nodes as a coordinator answers them; counts the asks."""

    def __init__(self, jobs: dict[str, Any]) -> None:
        self.jobs = jobs
        self.asked: list[str] = []
        self.down = False
        self.node_down = False

    def job_view(self, job_id: str) -> dict[str, Any] | None:
        self.asked.append(job_id)
        if self.down:
            raise CoordinatorUnavailable("job: 503 scripted")
        return self.jobs.get(job_id)

    def node_view(self, node_id: str) -> dict[str, Any] | None:
        if self.node_down:
            raise CoordinatorUnavailable("GET /nodes: ConnectError: connection refused")
        return {
            "node_id": node_id,
            "accepted_tasks": 3,
            "failed_attempts": 1,
            "abandoned_leases": 2,
            "reliability": 0.5,
            "placement_tier": "unproven",
        }


def job(name: str, state: str = "RUNNING") -> dict[str, Any]:
    return {"job_id": "x", "state": state, "spec": {"metadata": {"name": name}}}


def make_app(tmp_path: Path, coordinator: Coordinator, clock: list[float]) -> App:
    settings = Settings(coordinator="http://127.0.0.1:1", runner="trusted", state_dir=tmp_path)
    wiring = Wiring(
        state_dir=tmp_path,
        settings=lambda: settings,
        config_file=None,
        validate=lambda path: None,
        overridden=lambda key: None,
        reload=lambda: None,
        node_view=coordinator.node_view,
        ring=UsageRing(clock=lambda: clock[0]),
        clock=lambda: clock[0],
        job_view=coordinator.job_view,
    )
    gate = auth.Gate(clock=lambda: clock[0])
    return App(wiring, gate, frozenset({"console.test"}), "flashnode-console")


def get(app: App, path: str, query: dict[str, str], status_code: int = 200, **more: str) -> Any:
    token = auth.mint("view", app.gate.keys["view"], app.w.clock())
    found = app.gate.login(token)
    assert found is not None
    headers = {"host": "console.test", "cookie": f"flashnode-console={found[0]}", **more}
    response = app.handle(Request("GET", path, query, headers, b"", ("127.0.0.1", 1)))
    assert response.status == status_code, response.body
    return json.loads(response.body)


def test_data_goes_only_to_the_consoles_own_page(tmp_path: Path) -> None:
    """A page of another port of this host is same-site: its fetch carries the owner's cookie
    (SameSite ignores ports) but says where it comes from."""
    app = make_app(tmp_path, Coordinator({}), [NOW])
    for path in ("/api/state", "/api/jobs", "/api/history"):
        get(app, path, {}, 403, **{"sec-fetch-site": "same-site"})
        get(app, path, {}, 200, **{"sec-fetch-site": "same-origin"})


def test_a_jobs_name_and_state_are_asked_once_and_shown_escaped(tmp_path: Path) -> None:
    hostile = "train\x1b[2J\u202eevil"
    coordinator = Coordinator({"j1": job(hostile), "j2": job("sweep", "CANCELLED")})
    app = make_app(tmp_path, coordinator, [NOW])
    first = get(app, "/api/jobs", {"ids": "j1,j2,j1,../etc,j3"})
    assert set(first) == {"j1", "j2", "j3"}  # an id no job has is never put in a URL
    wait_for("the jobs looked up", lambda: all(j in app.lookups._jobs for j in first), 10)
    seen = get(app, "/api/jobs", {"ids": "j1,j2,j3"})
    assert "\x1b" not in seen["j1"]["name"] and "\u202e" not in seen["j1"]["name"]
    assert seen["j1"]["name"].startswith("train") and seen["j1"]["state"] == "running"
    assert seen["j2"] == {"name": "sweep", "state": "cancelled"}
    assert seen["j3"] == {"name": None, "state": None}
    get(app, "/api/jobs", {"ids": "j1,j2,j3"})
    app.lookups.close()
    assert sorted(coordinator.asked) == ["j1", "j2", "j3"]  # every open page asks: kept


def test_a_coordinator_that_did_not_answer_is_asked_again_after_a_while(tmp_path: Path) -> None:
    coordinator = Coordinator({"j1": job("train")})
    clock = [NOW]
    app = make_app(tmp_path, coordinator, clock)
    coordinator.down = True
    assert app.job("j1") == {"name": None, "state": None}
    wait_for("the lookup", lambda: coordinator.asked, 10)
    coordinator.down = False
    wait_for("the miss kept", lambda: "j1" in app.lookups._jobs, 10)
    assert app.job("j1")["name"] is None and not app.lookups._wanted  # not asked again at once
    clock[0] += MISS_KEEP_S + 1
    wait_for("the name", lambda: app.job("j1")["name"] == "train", 10)
    app.lookups.close()


def test_a_coordinator_that_never_answers_holds_no_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack: a coordinator that answers the agent's lookups never (or a page asking for
    many jobs): each request of the console still answers at once, from what is known."""
    release = threading.Event()
    coordinator = Coordinator({"j1": job("train")})

    def stuck(_: str) -> dict[str, Any] | None:
        release.wait(60)
        return None

    coordinator.job_view = stuck  # type: ignore[method-assign]
    coordinator.node_view = stuck  # type: ignore[method-assign]
    app = make_app(tmp_path, coordinator, [NOW])
    monkeypatch.setattr(status, "agent_alive", lambda pid: True)  # the snapshot's agent
    status.write(tmp_path, {"pid": 1, "node_id": "n1"})
    ids = ",".join(f"job{i}" for i in range(200))
    for _ in range(20):
        assert set(get(app, "/api/jobs", {"ids": ids})) == {f"job{i}" for i in range(64)}
        get(app, "/api/state", {})
        assert get(app, "/api/coordinator", {})["pending"] is True
    assert len(app.lookups._wanted) <= WANTED_MAX
    release.set()
    app.lookups.close()


def test_the_scores_are_explained_with_the_attempts_that_lowered_them_and_who_caused_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(status, "agent_alive", lambda pid: True)  # the snapshot's agent
    coordinator = Coordinator(
        {"own": job("buggy"), "gone": job("sweep", "CANCELLED"), "old": job("old")}
    )
    app = make_app(tmp_path, coordinator, [NOW])
    lines = [
        {
            "job_id": "old",
            "task_id": "t0",
            "outcome": "failed",
            "ended_at": NOW - 900,
            "reason": "before this agent started",
        },
        {"job_id": "own", "task_id": "t1", "outcome": "committed", "ended_at": NOW - 50},
        {
            "job_id": "own",
            "task_id": "t2",
            "outcome": "failed",
            "ended_at": NOW - 40,
            "reason": "exit code 3\nTraceback ...",
        },
        {
            "job_id": "gone",
            "task_id": "t3",
            "outcome": "lost",
            "ended_at": NOW - 30,
            "reason": "lease lost (410: lease not live)",
        },
        {
            "job_id": "own",
            "task_id": "t4",
            "outcome": "lost",
            "ended_at": NOW - 20,
            "reason": "lease lost (410: revoked: no progress within 60s)",
        },
        {
            "job_id": "own",
            "task_id": "t5",
            "outcome": "lapsed",
            "ended_at": NOW - 10,
            "reason": "the agent stopped",
        },
    ]
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    # Registered again (a reload) after t0 ended: the coordinator's count starts there.
    status.write(
        tmp_path, {"pid": 1, "node_id": "n1", "started_at": NOW - 2000, "registered_at": NOW - 100}
    )
    assert app.coordinator_view() == {"error": "asking the coordinator", "pending": True}
    view = wait_for(
        "the node and its jobs looked up",
        lambda: (
            (v := app.coordinator_view()).get("lowered_by")
            and any(x["cause"].startswith("cancelled") for x in v["lowered_by"])
            and v
        ),
        10,
    )
    app.lookups.close()
    assert view["reliability"] == 0.5 and view["placement_tier"] == "unproven"
    assert "accepted" in view["explained"]["reliability"]
    assert "unproven" in view["explained"]["placement_tier"]
    causes = [(x["task_id"], x["cause"], x["reason"]) for x in view["lowered_by"]]
    assert causes == [
        ("t5", "this node let it go", "the agent stopped"),
        (
            "t4",
            "the coordinator took the lease back",
            "lease lost (410: revoked: no progress within 60s)",
        ),
        ("t3", "cancelled by its author", "lease lost (410: lease not live)"),
        ("t2", "the job's own error", "exit code 3"),
    ]


def test_a_cancel_after_its_job_was_asked_about_is_not_shown_as_the_coordinator_taking_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page showed a job (its name and state asked, kept for JOB_KEEP_S); its author then
    cancelled it and the node lost the lease (410): the cancel is said, not "the coordinator
    took the lease back" until the kept answer expires; the job is asked again once."""
    monkeypatch.setattr(status, "agent_alive", lambda pid: True)  # the snapshot's agent
    coordinator = Coordinator({"gone": job("sweep")})
    clock = [NOW]
    app = make_app(tmp_path, coordinator, clock)
    status.write(tmp_path, {"pid": 1, "node_id": "n1", "registered_at": NOW - 100})
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("")
    assert get(app, "/api/jobs", {"ids": "gone"})["gone"]["state"] is None  # being asked
    wait_for("the job asked about", lambda: app.job("gone")["state"] == "running", 10)
    coordinator.jobs["gone"] = job("sweep", "CANCELLED")  # its author cancels it
    line = {
        "job_id": "gone",
        "task_id": "t1",
        "outcome": "lost",
        "ended_at": NOW + 6,
        "reason": "lease lost (410: lease not live)",
    }
    ledger.write_text(json.dumps(line) + "\n")
    clock[0] = NOW + 10  # well within JOB_KEEP_S of the answer kept
    view = wait_for(
        "the cancel said",
        lambda: (
            (v := get(app, "/api/coordinator", {})).get("lowered_by")
            and v["lowered_by"][0]["cause"] == "cancelled by its author"
            and v
        ),
        10,
    )
    assert view["lowered_by"][0]["reason"] == "lease lost (410: lease not live)"
    for _ in range(5):
        get(app, "/api/coordinator", {})
        get(app, "/api/jobs", {"ids": "gone"})
    app.lookups.close()
    assert coordinator.asked.count("gone") == 2  # once for the page, once after the loss


def test_a_job_being_asked_about_is_not_asked_again_by_the_requests_made_meanwhile(
    tmp_path: Path,
) -> None:
    """The coordinator answers slowly (a loaded machine): the page's requests during the ask
    wait for its answer instead of each queueing one more ask of the same job."""
    coordinator = Coordinator({"slow": job("sweep")})
    asking, answer = threading.Event(), threading.Event()
    view = coordinator.job_view

    def slow(job_id: str) -> dict[str, Any] | None:
        asking.set()
        answer.wait(10)
        return view(job_id)

    coordinator.job_view = slow  # type: ignore[method-assign]
    app = make_app(tmp_path, coordinator, [NOW])
    assert get(app, "/api/jobs", {"ids": "slow"})["slow"]["state"] is None
    assert asking.wait(10)
    for _ in range(5):  # while that ask is under way
        assert get(app, "/api/jobs", {"ids": "slow"})["slow"]["state"] is None
    answer.set()
    wait_for("the job asked about", lambda: app.job("slow")["state"] == "running", 10)
    app.lookups.close()
    assert coordinator.asked == ["slow"]


def test_a_lease_this_node_gave_up_is_said_to_be_given_up_not_taken_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(status, "agent_alive", lambda pid: True)  # the snapshot's agent
    coordinator = Coordinator({"own": job("train")})
    app = make_app(tmp_path, coordinator, [NOW])
    reasons = [
        "lease could not be renewed before its deadline (attempt heartbeat: 503 down)",
        "credentials refused: 401 unknown token",
        "lease lost (410: revoked: no progress within 60s)",
    ]
    lines = [
        {"job_id": "own", "task_id": f"t{i}", "outcome": "lost", "ended_at": NOW - 30 + i}
        | {"reason": r}
        for i, r in enumerate(reasons)
    ]
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    status.write(tmp_path, {"pid": 1, "node_id": "n1", "registered_at": NOW - 100})
    view = wait_for(
        "the causes",
        lambda: (
            (v := app.coordinator_view()).get("lowered_by")
            and "asking" not in v["lowered_by"][0]["cause"]
            and v
        ),
        10,
    )
    app.lookups.close()
    assert [x["cause"] for x in view["lowered_by"]] == [
        "the coordinator took the lease back",
        "this node gave it up: the coordinator refused its credentials",
        "this node gave it up: the coordinator did not answer before the lease's deadline",
    ]


def test_the_coordinators_view_says_when_it_was_asked_and_a_failed_ask_is_never_shown_as_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack on the owner's judgement: a page opened 40 s into a coordinator outage must
    not show the view of before the outage as the coordinator's view now."""
    monkeypatch.setattr(status, "agent_alive", lambda pid: True)  # the snapshot's agent
    coordinator = Coordinator({})
    clock = [NOW]
    app = make_app(tmp_path, coordinator, clock)
    status.write(tmp_path, {"pid": 1, "node_id": "n1", "registered_at": NOW - 100})
    assert get(app, "/api/coordinator", {})["pending"] is True
    view = wait_for("the view", lambda: "online" in (v := get(app, "/api/coordinator", {})) and v)
    assert view["fetched_at"] == NOW and view["age_s"] == 0 and view["current"] is True
    assert view["failed"] is False and view["reliability"] == 0.5
    coordinator.node_down = True
    clock[0] = NOW + 40
    first = get(app, "/api/coordinator", {})  # the view of before the outage is not now's
    assert first["fetched_at"] == NOW
    assert first.get("current") is False or first.get("failed") is True
    assert first["asking"] is True  # the ask this request started: the page asks again soon
    failed = wait_for(
        "the failed ask", lambda: (v := get(app, "/api/coordinator", {}))["failed"] and v
    )
    assert "connection refused" in failed["error"] and failed["failed_at"] == NOW + 40
    assert "online" not in failed and "reliability" not in failed  # nothing shown as now's
    assert failed["last_known"]["reliability"] == 0.5
    assert failed["last_known"]["fetched_at"] == NOW and failed["last_known"]["age_s"] == 40
    coordinator.node_down = False
    clock[0] = NOW + 60
    back = wait_for(
        "the view again", lambda: "online" in (v := get(app, "/api/coordinator", {})) and v
    )
    assert back["fetched_at"] == NOW + 60 and back["current"] is True
    # The agent's own heartbeats fail since after that answer: not shown as now's either.
    problem = {"conversation": "node heartbeat", "since": NOW + 61, "error": "503 down"}
    status.write(
        tmp_path,
        {"pid": 1, "node_id": "n1", "registered_at": NOW - 100, "coordinator_problems": [problem]},
    )
    clock[0] = NOW + 62
    outage = get(app, "/api/coordinator", {})
    app.lookups.close()
    assert outage["failed"] is True and "online" not in outage
    assert "node heartbeat: 503 down" in outage["error"] and outage["failed_at"] == NOW + 61
    assert outage["last_known"]["fetched_at"] == NOW + 60


def test_the_view_only_level_gets_no_line_a_task_printed_in_the_status_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(status, "agent_alive", lambda pid: True)  # the snapshot's agent
    app = make_app(tmp_path, Coordinator({}), [NOW])
    attempt = {
        "lease_id": "ls-1",
        "job_id": "j1",
        "task_id": "t1",
        "phase": "execute",
        "last_output": "secret-42 | not claiming: forged",
    }
    # As an agent before this version wrote it (the line's text now carries no output).
    line = status.attempt_line(attempt, None) + ": " + attempt["last_output"]
    text = "running " + line + " | not claiming: paused by the owner"
    held = [{"rule": "pause", "reason": "paused by the owner", "fix": None, "suspends": False}]
    status.write(
        tmp_path,
        {
            "pid": 1,
            "node_id": "n1",
            "state": text,
            "running": [attempt],
            "controls": {"held_by": held},
        },
    )
    seen = get(app, "/api/state", {})
    assert "secret-42" not in json.dumps(seen)
    assert seen["agent"]["state"] == (
        "running ls-1 (j1/t1) execute | not claiming: paused by the owner"
    )
    assert seen["running"][0]["output"] is None and seen["running"][0]["output_hidden"] is True
    assert "secret-42" in app.state(owner=True)["agent"]["state"]  # the owner's level keeps it


def test_status_names_a_running_tasks_pool_and_the_newest_step_it_logged() -> None:
    attempt = {
        "lease_id": "ls-1",
        "job_id": "j1",
        "task_id": "t1",
        "phase": "execute",
        "pool": "team-a",
        "metrics_step": 42,
        "checkpoint_step": 40,
    }
    text = status.render({"node_id": "n1", "updated_at": NOW, "running": [attempt]}, now=NOW)
    assert "ls-1  j1/t1   pool team-a" in text
    assert "step logged  42" in text and "(step 40)" in text


def test_what_the_node_gave_reads_in_seconds_minutes_or_hours() -> None:
    assert [status.given_time(h) for h in (0, 0.005, 0.2, 3.44, 27.4)] == [
        "0 min",
        "18 s",
        "12 min",
        "3.4 h",
        "27 h",
    ]
    totals = {"today": {"outcomes": {"committed": 2}, "cpu_hours": 0.2, "gpu_hours": 0.0}}
    text = status.render({"node_id": "n1", "updated_at": NOW, "totals": totals}, now=NOW)
    assert "today: 2 committed, 0 failed, 0 lapsed; CPU 12 min, GPU 0 min" in text
