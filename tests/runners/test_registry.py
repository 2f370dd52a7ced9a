"""A runner is one module and one registry entry: the agent asks what it can do
(``Capabilities``), never its name. A runner this file defines, registered here alone, is
accepted by the configuration and the CLI, built by the wiring, checked by the preflight, and its
abilities are what the node offers and what the attempt does."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import click
import pytest
from fakes import FakeClock, FakeCoordinator, FakeRunner, context, lease

from flashnode.attempt.orchestrator import Attempt
from flashnode.attempt.record import Outcome
from flashnode.cli.main import RunnerName
from flashnode.cli.wiring import make_runner
from flashnode.config.settings import Settings
from flashnode.errors import ConfigError
from flashnode.evidence import inventory
from flashnode.evidence.gpupool import GpuPool
from flashnode.runners import preflight, registry
from flashnode.runners.base import RunnerEnv
from flashnode.runners.capabilities import Capabilities
from flashnode.runners.findings import Finding, Ok
from flashnode.runners.registry import RUNNERS, Registered, capabilities, load_settings

URL = "http://127.0.0.1:8100"


class HostRunner(FakeRunner):
    """A new runner: on the host, with job environments, lending nothing."""

    name = "hostly"

    @classmethod
    def preflight(cls, settings: Settings, slots: int = 1) -> list[Finding]:
        return [Ok("hostly", "here")]


HOSTLY = Capabilities(
    sandbox=False,
    on_host=True,
    environments=True,
    lends_data=False,
    task_identity=(4242, 4242),
    network_isolation=False,
    gpu_addressing="host",
    pause=False,
    reattach=False,
    modules=False,
)


@pytest.fixture
def hostly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        RUNNERS, "hostly", Registered(f"{__name__}:HostRunner", lambda settings: HOSTLY)
    )


@pytest.mark.usefixtures("hostly")
def test_a_registered_runner_is_configured_built_and_checked_by_its_entry_alone(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="needs at least one pool"):  # it runs on the host
        load_settings({"coordinator": URL, "runner": "hostly"}, {})
    flags = {"coordinator": URL, "runner": "hostly", "pools": ("team",), "state_dir": tmp_path}
    s = load_settings(flags, {})
    assert capabilities(s) is HOSTLY
    assert RunnerName().convert("hostly", None, None) == "hostly"
    runner = make_runner(s, RunnerEnv(node_id="n", gpus=GpuPool([])))
    assert isinstance(runner, HostRunner)
    assert any(f.what == "hostly" for f in preflight.check(s))
    offered = inventory.registration(s, "n", HOSTLY.offer(s, module_capable=True))
    assert offered.unsandboxed_argv_capable and offered.can_install_dependencies
    assert not (offered.argv_capable or offered.sandbox_capable or offered.module_capable)


def test_a_runner_nobody_registered_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"runner = 'podman' \(from --runner\): no such runner"):
        load_settings({"coordinator": URL, "runner": "podman"}, {}, Path(os.devnull))
    with pytest.raises(click.BadParameter, match="known: docker, trusted"):
        RunnerName().convert("podman", None, None)


@pytest.mark.usefixtures("hostly")
def test_the_attempt_builds_a_job_environment_only_where_the_runner_says_it_installs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[object] = []

    class Envs:
        def acquire(self, *args: object, **kwargs: object) -> object:
            asked.append(args)
            raise RuntimeError("built here")

    deps = {"dependencies": ["numpy==2.0"]}
    for environments, built in ((True, True), (False, False)):
        asked.clear()
        caps = dataclasses.replace(HOSTLY, environments=environments)
        monkeypatch.setitem(
            RUNNERS, "hostly", Registered(f"{__name__}:HostRunner", lambda s, c=caps: c)
        )
        clock = FakeClock()
        ctx = context(
            tmp_path / str(environments),
            clock,
            FakeCoordinator(clock),
            HostRunner(),
            runner_name="hostly",
        )
        ctx = dataclasses.replace(ctx, envs=Envs())
        outcome = Attempt(ctx, lease(**deps)).run()
        assert bool(asked) is built
        assert (outcome is Outcome.COMMITTED) is not built


def test_the_registered_runners_state_what_the_readme_promises(tmp_path: Path) -> None:
    def caps(runner: str, **more: object) -> Capabilities:
        s = Settings(coordinator=URL, runner=runner, pools=("team",), state_dir=tmp_path, **more)
        return registry.capabilities(s)

    docker, trusted = caps("docker"), caps("trusted")
    assert docker.sandbox and docker.network_isolation and not docker.on_host
    assert not docker.environments and docker.gpu_addressing == "renumbered"
    assert caps("docker", container_user="1234:99").task_identity == (1234, 99)
    assert trusted.on_host and trusted.environments and not trusted.sandbox
    assert trusted.gpu_addressing == "host"
    if os.geteuid() == 0:  # each slot's task user; lent data needs the root agent's mounts
        assert trusted.task_identity is None and trusted.lends_data
    else:
        assert trusted.task_identity == (os.geteuid(), os.getegid())
        assert not trusted.lends_data


def test_the_doctor_tells_the_owner_what_the_runner_can_do(tmp_path: Path) -> None:
    s = Settings(coordinator=URL, runner="docker", container_user="1234:99", state_dir=tmp_path)
    told = registry.capabilities(s).describe()
    assert told.startswith("sandboxed, no network, GPUs numbered from 0, pauses, re-attaches")
    assert told.endswith("tasks as uid 1234") and "job environments" not in told
    assert HOSTLY.describe() == (
        "on the host (pool work only), the host's network, GPUs as the host numbers them,"
        " job environments, tasks as uid 4242"
    )
