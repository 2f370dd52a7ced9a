from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import AgentProcess, CoordinatorServer


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorServer]:
    """A fresh real coordinator in open mode, with its own data dirs."""
    server = CoordinatorServer(tmp_path / "coordinator")
    server.root.mkdir()
    server.start()
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
def drop_dir() -> Iterator[Path]:
    """A directory outside the test's private tmp_path that a task (running as the task user
    when the tests run as root) can write to, e.g. to report its pids."""
    path = Path(tempfile.mkdtemp(prefix="flashnode-drop-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)
