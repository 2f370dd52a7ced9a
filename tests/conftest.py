from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import AgentProcess, CoordinatorServer, run_flashnode, shared_dir

ROOT = Path(__file__).resolve().parent.parent
TASK_PYTHON = os.environ.get("FLASHNODE_TEST_TASK_PYTHON", "/opt/flashnode-task-venv/bin/python")

# The tiers, from the fixtures a test uses (directly or through another fixture): `-m "not
# integration"` is the unit tier, fakes and a fake clock, in well under a minute.
TIERS = {
    # a real coordinator, a real agent process, the real Docker engine or a Podman service, a
    # real systemd, real uv against a package index, a real HTTPS origin, a real browser, the
    # built packages
    "integration": {
        "coordinator",
        "recording_coordinator",
        "token_coordinator",
        "start_agent",
        "engine",
        "podman",
        "booted",
        "other_release",
        "packages",
        "installed_deb",
        "packaged_python",
        "index",
        "origin",
        "browser",
        "flashnode",
    },
    "root": {"as_root", "task_cgroups", "packages"},
    "docker": {"engine", "booted", "other_release"},
    "systemd": {"booted", "other_release"},
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in TIERS.items():
            if used & fixtures:
                item.add_marker(marker)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each failure also goes to ``failures.log`` in the run's base temp dir (kept after the run,
    with every agent's and coordinator's log beside it): what a run cut short by its limit,
    whose report never printed, had already found."""
    if report.failed and _BASETEMP:
        with (_BASETEMP[0] / "failures.log").open("a") as log:
            log.write(f"=== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n")
            log.write(report.longreprtext + "\n")


_BASETEMP: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def _failures_log(tmp_path_factory: pytest.TempPathFactory) -> None:
    _BASETEMP.append(tmp_path_factory.getbasetemp())


# --- the gates: a test that needs what this host lacks is skipped, saying what it needs ----------


@pytest.fixture(scope="session")
def as_root() -> None:
    """Root: tasks run as the per-slot users, in mount namespaces and cgroups of their own."""
    if os.geteuid() != 0:
        pytest.skip("needs root (tasks as the slot users, mounts, cgroups)")


@pytest.fixture(scope="session")
def task_cgroups(as_root: None) -> None:
    """Per-task cgroups: root and a cgroup v1 or delegated v2 hierarchy on this host."""
    from flashnode.sandbox import cgroups

    hierarchy, why = cgroups.detect()
    if hierarchy is None:
        pytest.skip(f"per-task cgroups are not available here: {why}")


@pytest.fixture(scope="session")
def task_python() -> str:
    """The task interpreter with flashruntime and CPU torch (.ci/run makes it)."""
    if not os.path.exists(TASK_PYTHON):
        pytest.skip(f"no task interpreter with torch and flashruntime at {TASK_PYTHON}")
    return TASK_PYTHON


@pytest.fixture(scope="session")
def packages() -> list[Path]:
    """The .deb and .rpm built by ./packaging/build, once per test session."""
    if os.geteuid() != 0 or shutil.which("dpkg") is None or not Path("/usr/bin/python3").exists():
        pytest.skip("building and installing the packages needs root, dpkg and /usr/bin/python3")
    for old in (ROOT / "dist").glob("flashnode*"):
        old.unlink()
    done = subprocess.run(
        [str(ROOT / "packaging" / "build")], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return sorted((ROOT / "dist").glob("flashnode*"))


class _Ahead:
    """Coordinators started one ahead: the next test's starts while this one runs (importing
    flashruntime's service takes seconds, and most integration tests want a fresh one)."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.next: CoordinatorServer | None = None

    def _launch(self) -> CoordinatorServer:
        server = CoordinatorServer(Path(tempfile.mkdtemp(prefix="coordinator-", dir=self.base)))
        server.launch()
        return server

    def take(self) -> CoordinatorServer:
        server = self.next or self._launch()
        self.next = self._launch()
        server.wait_ready()
        return server

    def close(self) -> None:
        if self.next is not None:
            self.next.close()


@pytest.fixture(scope="session")
def _coordinators(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Ahead]:
    ahead = _Ahead(tmp_path_factory.mktemp("coordinators"))
    yield ahead
    ahead.close()


@pytest.fixture
def coordinator(_coordinators: _Ahead) -> Iterator[CoordinatorServer]:
    """A fresh real coordinator in open mode, with its own data dirs."""
    server = _coordinators.take()
    yield server
    server.close()


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Start agents against a coordinator URL; all are stopped at the end of the test."""
    agents: list[AgentProcess] = []

    def start(
        url: str,
        *args: str,
        env: dict[str, str] | None = None,
        name: str = "agent",
        state_dir: Path | None = None,
    ) -> AgentProcess:
        root = tmp_path / f"{name}-{len(agents)}"
        root.mkdir()
        agent = AgentProcess(root, url, *args, env=env, state_dir=state_dir)
        agents.append(agent)
        return agent

    yield start
    for agent in agents:
        agent.stop()


@pytest.fixture
def flashnode() -> Callable[..., subprocess.CompletedProcess[str]]:
    """The flashnode program, run as a process (``harness.run_flashnode``; a test that uses it is
    an integration test)."""
    return run_flashnode


@pytest.fixture
def drop_dir() -> Iterator[Path]:
    """A directory outside the test's private tmp_path that a task (running as the task user
    when the tests run as root) can write to, e.g. to report its pids."""
    path = shared_dir("flashnode-drop-")
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def recording_coordinator(tmp_path: Path) -> Iterator[CoordinatorServer]:
    """A real coordinator whose app is wrapped to record register and complete bodies."""
    server = CoordinatorServer(tmp_path / "coordinator", record=True)
    server.root.mkdir()
    server.start()
    yield server
    server.close()


class FakeNvml:
    """The stand-in libnvidia-ml (tests/fake_nvml.c), compiled for this test session."""

    def __init__(self, library: Path, config: Path) -> None:
        self.library, self.config = library, config

    def script(self, text: str) -> dict[str, str]:
        """Write the script (replacing it whole: a running agent's library reads the new one at
        its next call) and return the environment that makes an agent load the library."""
        tmp = self.config.with_name(self.config.name + ".new")
        tmp.write_text(text)
        tmp.chmod(0o644)
        os.replace(tmp, self.config)
        return {"FLASHNODE_NVML_LIBRARY": str(self.library), "FAKE_NVML_CONFIG": str(self.config)}


@pytest.fixture(scope="session")
def engine() -> Any:
    """The Docker engine; the test is skipped without one (.ci/run starts one)."""
    pytest.importorskip("docker")
    from boxes import engine_client

    return engine_client()


@pytest.fixture(scope="session")
def box(engine: Any) -> str:
    """The busybox test image (tests/boxes.py builds it), for the docker runner."""
    from boxes import IMAGE, import_image

    return import_image(engine, IMAGE)


@pytest.fixture(scope="session")
def image(box: str) -> str:
    """The busybox test image under the name the docker runner's own tests use."""
    return box


@pytest.fixture(scope="session")
def fake_nvml_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the stand-in NVML library")
    out = Path(tempfile.mkdtemp(prefix="flashnode-nvml-")) / "libnvidia-ml.so.1"
    out.parent.chmod(0o755)
    source = Path(__file__).parent / "fake_nvml.c"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(out), str(source)], check=True)
    return out


@pytest.fixture
def fake_nvml(fake_nvml_library: Path, drop_dir: Path) -> FakeNvml:
    return FakeNvml(fake_nvml_library, drop_dir / "nvml.conf")


@dataclass
class TokenCoordinator:
    """A real coordinator in enforcing mode: node `node-x` with a token, and a join code."""

    server: CoordinatorServer
    token: str
    join_code: str
    token_file: Path

    def agent_args(self) -> tuple[str, ...]:
        return ("--node-id", "node-x", "--token-file", str(self.token_file))

    def agent_env(self) -> dict[str, str]:
        return {"FLASHNODE_JOIN_CODE": self.join_code}


@pytest.fixture
def token_coordinator(tmp_path: Path, drop_dir: Path) -> Iterator[TokenCoordinator]:
    token, join_code = "tok-" + secrets.token_hex(12), "join-" + secrets.token_hex(12)
    server = CoordinatorServer(
        tmp_path / "tokcoord",
        env={"FLASHML_NODE_TOKENS": f"node-x:{token}", "FLASHML_JOIN_CODE": join_code},
    )
    server.root.mkdir()
    server.start()
    # In a directory a task can enter: only the file's mode keeps it private.
    token_file = drop_dir / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    yield TokenCoordinator(server, token, join_code, token_file)
    server.close()
