"""The environment and data phases against fakes: which tasks get what, whose fault each ending
is, and that what they pin is released whatever way the attempt ends."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeClock, FakeCoordinator, FakeHandle, FakeRunner, context, lease

from flashnode.attempt import Attempt, Outcome
from flashnode.config.settings import Settings
from flashnode.coordinator.datasets import DatasetEntry
from flashnode.coordinator.lease import Lease, parse_task
from flashnode.errors import (
    AttemptFailed,
    AttemptLapsed,
    DataIntegrityError,
    EnvBuildFailed,
    EnvUnavailable,
)
from flashnode.evidence import inventory
from flashnode.evidence.gpupool import GpuPool
from flashnode.owner import status
from flashnode.runners.base import Handle, RunnerEnv, RunResult
from flashnode.runners.plan import RunnerFacts, TaskPlan
from flashnode.runners.registry import capabilities
from flashnode.runners.trusted import TrustedRunner
from flashnode.sandbox.workspace import Workspace

SHA = "ab" * 32
DEPS = ["--index-url https://pypi.example/simple", "numpy==2.0"]


class InstallingRunner(FakeRunner):
    """A fake runner standing in for the trusted one (the settings' runner: job environments);
    it remembers what each start saw of the workspace."""

    def __init__(self, code: int = 0) -> None:
        super().__init__(code)
        self.mount_points: list[bool] = []

    def facts(self, workspace: Workspace, slot: int) -> RunnerFacts:
        return RunnerFacts(python="/usr/bin/python3", path="/usr/bin:/bin")

    def start(self, plan: TaskPlan) -> Handle:
        self.mount_points = [
            (plan.workspace.root / dst.removeprefix("/work/")).is_dir() for _, dst in plan.views
        ]
        return super().start(plan)


class FakeEnv:
    def __init__(self, root: Path, built: bool, journal: list[str] | None = None) -> None:
        self.journal = journal if journal is not None else []
        self.key = "k" * 64
        self.path = root / "env"
        self.python = self.path / "bin" / "python"
        self.built = built
        self.build_seconds = 2.5 if built else 0.0
        self.released = 0

    def release(self) -> None:
        self.released += 1
        self.journal.append("environment")


class FakeEnvs:
    def __init__(
        self, root: Path, fail: Exception | None = None, journal: list[str] | None = None
    ) -> None:
        self.root, self.fail = root, fail
        self.journal = journal if journal is not None else []
        self.asked: list[tuple[str, tuple[str, ...]]] = []
        self.handed: list[FakeEnv] = []

    def acquire(
        self, python: str, lines: Sequence[str], *, stop: threading.Event, timeout_s: float
    ) -> FakeEnv:
        self.asked.append((python, tuple(lines)))
        if self.fail is not None:
            raise self.fail
        env = FakeEnv(self.root, built=not self.handed, journal=self.journal)
        self.handed.append(env)
        return env


class FakeShard:
    def __init__(self, entry: DatasetEntry, fetched: bool, journal: list[str]) -> None:
        self.entry, self.size, self.fetched, self.seconds = entry, entry.size, fetched, 0.1
        self.released = 0
        self.journal = journal

    def release(self) -> None:
        self.released += 1
        self.journal.append(f"shard {self.entry.path}")


class FakeData:
    def __init__(
        self,
        budget: int,
        fail: Exception | None = None,
        journal: list[str] | None = None,
        layout_fail: Exception | None = None,
    ) -> None:
        self.budget_bytes, self.fail, self.layout_fail = budget, fail, layout_fail
        self.journal = journal if journal is not None else []
        self.handed: list[FakeShard] = []
        self.laid_out: list[tuple[Path, int]] = []

    def acquire_all(self, entries: Sequence[DatasetEntry], *, stop: threading.Event) -> list[Any]:
        if self.fail is not None:
            raise self.fail
        shards = [FakeShard(e, i == 0, self.journal) for i, e in enumerate(entries)]
        self.handed += shards
        return shards

    def layout(self, handles: Sequence[FakeShard], dest: Path, *, task_uid: int) -> None:
        if self.layout_fail is not None:
            raise self.layout_fail
        self.laid_out.append((dest, task_uid))


def attempt(
    tmp_path: Path,
    runner: Any,
    payload: dict[str, Any],
    envs: Any = None,
    data: Any = None,
    **settings: Any,
) -> tuple[Outcome, FakeCoordinator, Attempt]:
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    ctx = context(tmp_path, clock, coord, runner, **settings)
    ctx = dataclasses.replace(ctx, envs=envs, data=data)
    a = Attempt(ctx, lease(**payload))
    return a.run(), coord, a


def fail_reasons(coord: FakeCoordinator) -> list[str]:
    return [str(c[2][1]) for c in coord.calls if c[1] == "fail"]


def slice_of(*sizes: int) -> list[dict[str, Any]]:
    entries = [
        {
            "path": f"part-{i}.bin",
            "url": f"https://data.example/{i}",
            "size": size,
            "integrity": {"kind": "sha256", "value": SHA},
        }
        for i, size in enumerate(sizes)
    ]
    return [{"name": "corpus", "entries": entries}]


# --- the payload ------------------------------------------------------------------------------


def _task(**payload: Any) -> Any:
    return parse_task(Lease.model_validate(lease(**payload)))


def test_local_inputs_and_datasets_parse_into_the_task() -> None:
    task = _task(local_inputs=["scans", "notes", "scans"], datasets=slice_of(3, 4))
    assert task.local_inputs == ("scans", "notes")
    assert [(e.dataset, e.path, e.size) for e in task.datasets] == [
        ("corpus", "part-0.bin", 3),
        ("corpus", "part-1.bin", 4),
    ]
    assert _task(local_inputs=[], datasets=[]).local_inputs == ()


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({"local_inputs": "scans"}, "local_inputs is not a list of labels"),
        ({"local_inputs": ["scans", 3]}, "local_inputs is not a list of labels"),
        ({"local_inputs": [f"l{i}" for i in range(65)]}, "more than 64 labels"),
        ({"datasets": {"name": "x"}}, "datasets is not a list"),
        ({"datasets": [{"name": "../x", "entries": []}]}, "is not a safe name"),
    ],
)
def test_malformed_data_requests_fail_with_a_reason(payload: dict[str, Any], reason: str) -> None:
    with pytest.raises(AttemptFailed, match=reason):
        _task(**payload)


# --- job environments -------------------------------------------------------------------------


def test_an_argv_task_runs_with_its_environment_first_on_path(tmp_path: Path) -> None:
    runner, envs = InstallingRunner(), FakeEnvs(tmp_path)
    outcome, _, a = attempt(tmp_path, runner, {"dependencies": DEPS, "python": "3.12"}, envs)
    assert outcome is Outcome.COMMITTED
    assert envs.asked == [("3.12", tuple(DEPS))]
    [plan] = runner.started
    assert plan.env["PATH"] == f"{tmp_path / 'env' / 'bin'}:/usr/bin:/bin"
    assert plan.env["VIRTUAL_ENV"] == str(tmp_path / "env") and plan.argv == ("true",)
    assert envs.handed[0].released == 1
    [record] = a.ctx.ledger.records()
    assert record["environment"] == {
        "key": "k" * 16,
        "python": "3.12",
        "built": True,
        "build_seconds": 2.5,
    }
    assert "environment" in record["timings"]


def test_a_module_task_runs_under_its_environments_interpreter(tmp_path: Path) -> None:
    runner, envs = InstallingRunner(), FakeEnvs(tmp_path)
    payload = {"argv": None, "module": "flashml_workloads.sgd_trainer", "dependencies": DEPS}
    outcome, _, _ = attempt(tmp_path, runner, payload, envs)
    assert outcome is Outcome.COMMITTED
    [plan] = runner.started
    assert plan.argv[:3] == (str(tmp_path / "env" / "bin" / "python"), "-m", payload["module"])
    assert plan.env["PATH"] == "/usr/bin:/bin" and "VIRTUAL_ENV" not in plan.env


def test_the_environment_is_released_when_the_task_fails(tmp_path: Path) -> None:
    envs = FakeEnvs(tmp_path)
    outcome, _, _ = attempt(tmp_path, InstallingRunner(code=3), {"dependencies": DEPS}, envs)
    assert outcome is Outcome.FAILED and envs.handed[0].released == 1


class NodeFaultHandle(FakeHandle):
    def result(self) -> RunResult:
        return RunResult(exit_code=None, cause="container engine unavailable", node_fault=True)


class EndingRunner(InstallingRunner):
    """A runner whose task ends the way ``ending`` says."""

    def __init__(self, ending: str) -> None:
        super().__init__(code=3 if ending == "the task fails" else 0)
        if ending == "the runner cannot start it":
            self.start_error = AttemptLapsed("cannot create the task's cgroup")
        elif ending == "the runner's start breaks":
            self.start_error = RuntimeError("a bug")
        self.ending = ending

    def start(self, plan: TaskPlan) -> Handle:
        handle = super().start(plan)
        return NodeFaultHandle(0) if self.ending == "the node loses the task" else handle


@pytest.mark.parametrize(
    ("ending", "outcome"),
    [
        ("the task fails", Outcome.FAILED),
        ("the node loses the task", Outcome.LAPSED),
        ("the runner cannot start it", Outcome.LAPSED),
        ("the runner's start breaks", Outcome.FAILED),
    ],
)
def test_what_the_phases_hold_is_released_once_the_last_first_however_the_attempt_ends(
    tmp_path: Path, ending: str, outcome: Outcome
) -> None:
    journal: list[str] = []
    envs, data = FakeEnvs(tmp_path, journal=journal), FakeData(100, journal=journal)
    payload = {"dependencies": DEPS, "datasets": slice_of(30, 20)}
    got, _, _ = attempt(tmp_path, EndingRunner(ending), payload, envs, data)
    assert got is outcome
    assert journal == ["shard part-0.bin", "shard part-1.bin", "environment"]


def test_a_data_phase_that_fails_after_pinning_releases_its_pins_and_the_environment(
    tmp_path: Path,
) -> None:
    journal: list[str] = []
    envs = FakeEnvs(tmp_path, journal=journal)
    data = FakeData(100, journal=journal, layout_fail=AttemptLapsed("cannot lay out the slices"))
    payload = {"dependencies": DEPS, "datasets": slice_of(30, 20)}
    runner = InstallingRunner()
    got, _, _ = attempt(tmp_path, runner, payload, envs, data)
    assert got is Outcome.LAPSED and runner.started == []
    assert journal == ["shard part-0.bin", "shard part-1.bin", "environment"]


def test_a_runner_whose_image_holds_the_base_builds_nothing(tmp_path: Path) -> None:
    runner, envs = FakeRunner(), FakeEnvs(tmp_path)
    outcome, _, a = attempt(tmp_path, runner, {"dependencies": DEPS}, envs, runner_name="docker")
    assert outcome is Outcome.COMMITTED and envs.asked == []
    assert runner.started[0].environment is None and "VIRTUAL_ENV" not in runner.started[0].env
    assert "environment" not in a.ctx.ledger.records()[0]


@pytest.mark.parametrize(
    ("envs_fail", "outcome", "reported"),
    [
        (EnvBuildFailed("cannot build: No solution found (numpy==2.0)"), Outcome.FAILED, True),
        (EnvUnavailable("cannot reach the index"), Outcome.LAPSED, False),
        (None, Outcome.LAPSED, False),  # a node that builds no environments at all
    ],
)
def test_whose_fault_a_failed_environment_is(
    tmp_path: Path, envs_fail: Exception | None, outcome: Outcome, reported: bool
) -> None:
    envs = FakeEnvs(tmp_path, envs_fail) if envs_fail is not None else None
    runner = InstallingRunner()
    got, coord, _ = attempt(tmp_path, runner, {"dependencies": DEPS}, envs)
    assert got is outcome and runner.started == []
    assert bool(fail_reasons(coord)) is reported
    if reported:
        assert "No solution found" in fail_reasons(coord)[0]


# --- lent data and dataset slices -------------------------------------------------------------


@pytest.fixture
def lent(tmp_path: Path) -> dict[str, Path]:
    dirs = {"scans": tmp_path / "owner" / "scans", "other": tmp_path / "owner" / "other"}
    for d in dirs.values():
        d.mkdir(parents=True)
    return dirs


def test_only_the_labels_asked_for_are_lent_each_with_its_mount_point(
    tmp_path: Path, lent: dict[str, Path]
) -> None:
    runner = InstallingRunner()
    outcome, _, a = attempt(tmp_path, runner, {"local_inputs": ["scans"]}, local_data=lent)
    assert outcome is Outcome.COMMITTED
    [plan] = runner.started
    assert plan.views == ((str(lent["scans"]), "/work/inputs/scans"),)
    assert runner.mount_points == [True]
    assert a.ctx.ledger.records()[0]["local_inputs"] == ["scans"]


def test_what_each_phase_prepared_reaches_the_one_start_together(
    tmp_path: Path, lent: dict[str, Path]
) -> None:
    runner, envs = InstallingRunner(), FakeEnvs(tmp_path)
    payload = {"dependencies": DEPS, "local_inputs": ["scans"], "checkpoint": {}}
    outcome, _, _ = attempt(tmp_path, runner, payload, envs, local_data=lent)
    assert outcome is Outcome.COMMITTED
    [plan] = runner.started
    assert plan.env["FLASHML_CHECKPOINT_DIR"] == "/work/out/ckpt"  # restore's
    assert plan.env["VIRTUAL_ENV"] == str(tmp_path / "env")  # the environment's
    assert plan.env["PATH"].split(":")[0] == str(tmp_path / "env" / "bin")
    assert plan.views == ((str(lent["scans"]), "/work/inputs/scans"),)  # data's


def test_a_label_this_node_does_not_lend_fails_naming_it(
    tmp_path: Path, lent: dict[str, Path]
) -> None:
    runner = InstallingRunner()
    outcome, coord, _ = attempt(tmp_path, runner, {"local_inputs": ["xrays"]}, local_data=lent)
    assert outcome is Outcome.FAILED and runner.started == []
    assert "'xrays'" in fail_reasons(coord)[0]


def test_a_directory_the_owner_stopped_lending_after_the_claim_is_never_mounted(
    tmp_path: Path, lent: dict[str, Path]
) -> None:
    """The owner un-lends a directory (it holds secrets after all) and reloads while an attempt
    claimed before is still staging: the attempt keeps its other settings, but the directory is
    not mounted; the lease lapses (the node changed, not the task)."""
    runner = InstallingRunner()
    clock = FakeClock()
    coord = FakeCoordinator(clock)
    ctx = context(tmp_path, clock, coord, runner, local_data=lent)
    # The running configuration, reloaded: "scans" is no longer lent.
    ctx = dataclasses.replace(ctx, lent_now=lambda: {"other": lent["other"]})
    a = Attempt(ctx, lease(local_inputs=["scans"]))
    assert a.run() is Outcome.LAPSED
    assert runner.started == [] and fail_reasons(coord) == []
    assert "'scans' is no longer lent" in a.ctx.ledger.records()[0]["reason"]


def test_slices_are_fetched_laid_out_and_released_and_counted(tmp_path: Path) -> None:
    data = FakeData(budget=100)
    outcome, _, a = attempt(tmp_path, InstallingRunner(), {"datasets": slice_of(30, 20)}, data=data)
    assert outcome is Outcome.COMMITTED
    [(dest, uid)] = data.laid_out
    assert dest.name == "data" and dest.parent.parent == tmp_path / "attempts"
    assert uid == (-1 if os.geteuid() == 0 else os.geteuid())
    assert all(s.released for s in data.handed)
    facts = a.ctx.ledger.records()[0]["data"]
    assert facts | {"seconds": 0} == {
        "entries": 2,
        "cache_hits": 1,
        "bytes_fetched": 30,
        "bytes": 50,
        "seconds": 0,
    }


@pytest.mark.parametrize(
    ("data", "outcome", "reported"),
    [
        (FakeData(budget=40), Outcome.LAPSED, False),  # the budget shrank since it was placed
        (None, Outcome.LAPSED, False),
        (FakeData(100, DataIntegrityError("dataset entry corpus/x: sha256")), Outcome.FAILED, True),
        (FakeData(100, AttemptLapsed("origin unreachable")), Outcome.LAPSED, False),
    ],
)
def test_whose_fault_a_failed_fetch_is(
    tmp_path: Path, data: FakeData | None, outcome: Outcome, reported: bool
) -> None:
    runner = InstallingRunner()
    got, coord, _ = attempt(tmp_path, runner, {"datasets": slice_of(30, 20)}, data=data)
    assert got is outcome and runner.started == []
    assert bool(fail_reasons(coord)) is reported


# --- the trusted runner's own checks ------------------------------------------------------------


def _trusted(tmp_path: Path, sandbox: bool, state_dir: Path | None = None) -> TrustedRunner:
    s = Settings(
        coordinator="http://127.0.0.1:1",
        runner="trusted",
        pools=("team-a",),
        state_dir=state_dir or tmp_path,
    )
    return TrustedRunner(s, RunnerEnv("node-1", GpuPool()), None, None, sandbox=sandbox)


def test_a_module_task_with_dependencies_runs_the_jobs_own_code_so_it_is_pool_only(
    tmp_path: Path,
) -> None:
    runner = _trusted(tmp_path, sandbox=False)
    module = {"argv": None, "module": "flashml_workloads.sgd_trainer", "dependencies": DEPS}
    runner.check(
        _task(**module), runner.settings
    )  # in the pool, fallback allowed: no task_python needed
    with pytest.raises(AttemptFailed, match="must name a pool"):
        runner.check(_task(**module, pool=None), runner.settings)
    with pytest.raises(AttemptFailed, match="does not allow running outside"):
        runner.check(_task(**module, isolation={"tier": "sandboxed"}), runner.settings)
    with pytest.raises(AttemptLapsed, match="no module tasks"):
        runner.check(_task(argv=None, module="flashml_workloads.sgd_trainer"), runner.settings)


def test_what_the_trusted_runner_cannot_give_a_task_is_not_the_tasks_fault(
    tmp_path: Path,
) -> None:
    with pytest.raises(AttemptLapsed, match="only when the agent runs as root"):
        same = _trusted(tmp_path, sandbox=False)
        same.check(_task(local_inputs=["scans"]), same.settings)
    hidden = _trusted(tmp_path, sandbox=True, state_dir=Path("/tmp/flashnode-x"))
    with pytest.raises(AttemptLapsed, match="hidden from tasks"):
        hidden.check(_task(dependencies=DEPS), hidden.settings)
    hidden.check(_task(), hidden.settings)
    kept = _trusted(tmp_path, sandbox=True, state_dir=Path("/var/lib/flashnode"))
    kept.check(_task(dependencies=DEPS), kept.settings)


def test_only_the_trusted_runner_says_it_installs_dependencies(tmp_path: Path) -> None:
    for runner, installs in (("trusted", True), ("docker", False)):
        s = Settings(
            coordinator="http://127.0.0.1:1", runner=runner, pools=("team-a",), state_dir=tmp_path
        )
        offer = capabilities(s).offer(s, module_capable=False)
        assert inventory.registration(s, "n", offer).can_install_dependencies is installs


def test_status_and_history_say_what_the_phases_did() -> None:
    line = status.describe_facts(
        {
            "environment": {"built": True, "build_seconds": 3.21},
            "data": {"bytes_fetched": 3 << 20, "cache_hits": 2},
            "local_inputs": ["scans"],
        }
    )
    assert line == "env built in 3.2 s; data 3.0 MiB fetched, 2 cache hit(s); lent scans"
    assert status.describe_facts({"environment": {"built": False}}) == "env reused"
    assert status.describe_facts({}) == ""


@pytest.mark.usefixtures("as_root")
def test_handing_the_workspace_over_leaves_data_alone(tmp_path: Path) -> None:
    ws = Workspace.create(tmp_path / "attempts", "ls-1")
    ws.data.mkdir(mode=0o755)
    shard = ws.data / "x.bin"
    shard.write_bytes(b"shared with the cache")
    shard.chmod(0o444)
    before = shard.stat()
    ws.hand_over(65534, 65534, inputs_for="group")
    after = shard.stat()
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        before.st_uid,
        before.st_gid,
        before.st_mode,
    )
    assert ws.data.stat().st_uid == os.geteuid()
