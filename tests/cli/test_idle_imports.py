"""An idle agent does not load what only a feature needs (issue 31's idle memory): a real
``flashnode work`` against a real coordinator, idle (registered, heartbeating, claiming nothing),
reports the modules it holds, the pydantic models it has built and the TLS contexts it holds,
and none of the deferred ones is among them (nor any TLS context: its coordinator is plain http,
issue 44).

The report comes from the test's own ``sitecustomize`` (on PYTHONPATH for the agent's process only,
the product has no such hook): a thread that, once the test says the agent is idle, writes the
process's ``sys.modules``, which of the models below are built and how many ``ssl.SSLContext``
objects it holds."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import AgentProcess, CoordinatorServer, free_port, wait_for

# Each is imported where the feature runs, never on the idle path.
NOT_AT_IDLE = {
    "http.server": "metrics on (owner/metricsserver.py), or the console's first connection",
    "socketserver": "metrics on (owner/metricsserver.py), or the console's first connection",
    "flashnode.console.server": "the console's first connection (console/listener.py)",
    "flashnode.console.app": "the console's first connection (console/listener.py)",
    "flashnode.console.lookups": "the console's first connection (console/listener.py)",
    "tarfile": "an archive input (sandbox/archives.py)",
    "ijson": "a module task's delta check (coordinator/checks.py)",
    "difflib": "a misspelt setting (config/loading.py)",
    "tomllib": "a config file (config/loading.py)",
    "prometheus_client": "metrics on (owner/metrics.py)",
    "docker": "the container runner (runners/container/)",
    "pynvml": "an NVML library (evidence/gpu.py)",
    "tomlkit": "flashnode pools, the console's settings (config/configedit.py)",
    "flashnode.console": "the console on (ui_listen)",
}
CONSOLE = {"flashnode.console"}  # what the console needs before anyone connects
# Models only a task uses: their validators are built at the first task (``defer_build``).
NOT_BUILT_AT_IDLE = (
    "flashnode.coordinator.lease:Lease",
    "flashnode.coordinator.lease:Task",
    "flashnode.coordinator.lease:Input",
    "flashnode.coordinator.lease:Isolation",
    "flashnode.coordinator.lease:CheckpointPolicy",
    "flashnode.coordinator.messages:CheckpointManifest",
    "flashnode.coordinator.messages:CheckpointPart",
    "flashnode.coordinator.messages:CompleteRequest",
    "flashnode.coordinator.messages:ExecutionEvidence",
    "flashnode.attempt.record:AttemptRecord",
)

SITECUSTOMIZE = """
import gc, json, os, sys, threading, time

def _report():
    trigger = os.environ["IDLE_IMPORTS_TRIGGER"]
    while not os.path.exists(trigger):
        time.sleep(0.05)
    out = os.path.join(os.environ["IDLE_IMPORTS_DIR"], f"{os.getpid()}.json")
    built = []
    for name in os.environ["IDLE_MODELS"].split(","):
        module, model = name.split(":")
        if getattr(getattr(sys.modules.get(module), model, None), "__pydantic_complete__", True):
            built.append(name)
    ssl = sys.modules.get("ssl")
    tls = 0 if ssl is None else sum(isinstance(o, ssl.SSLContext) for o in gc.get_objects())
    with open(out + ".tmp", "w") as fh:
        json.dump({"modules": sorted(sys.modules), "built": built, "tls": tls}, fh)
    os.rename(out + ".tmp", out)

if "IDLE_IMPORTS_TRIGGER" in os.environ:
    threading.Thread(target=_report, daemon=True).start()
"""


def _idle_modules(
    tmp_path: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    env: dict[str, str],
) -> tuple[set[str], list[str], int]:
    """The modules an idle agent holds, which of ``NOT_BUILT_AT_IDLE`` it has built (a model
    whose module is not even imported counts as built: the test must see it deferred), and how
    many TLS contexts it holds."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    trigger = tmp_path / "idle-now"
    env = env | {
        "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
        "IDLE_IMPORTS_TRIGGER": str(trigger),
        "IDLE_IMPORTS_DIR": str(hook),
        "IDLE_MODELS": ",".join(NOT_BUILT_AT_IDLE),
        "FLASHNODE_HEARTBEAT_SECONDS": "1",
    }
    agent = start_agent(coordinator.url, "--runner", "trusted", "--pool", "idle", env=env)
    status = agent.state_dir / "status.json"
    beats: set[float] = set()

    def idle() -> bool:
        # Two heartbeats apart: the loop has registered and gone round, claiming between them.
        try:
            snapshot = json.loads(status.read_text())
        except (OSError, ValueError):
            return False
        assert agent.proc.poll() is None, agent.log
        if snapshot.get("registered") and snapshot.get("last_heartbeat_at"):
            beats.add(snapshot["last_heartbeat_at"])
        return len(beats) >= 3

    wait_for("the agent to idle", idle, timeout=60)
    assert "running" not in json.loads(status.read_text()).get("state", "")
    trigger.touch()
    report = hook / f"{agent.proc.pid}.json"
    wait_for("the agent's module report", report.exists, timeout=30)
    found = json.loads(report.read_text())
    return set(found["modules"]), found["built"], found["tls"]


def _loaded(modules: set[str], name: str) -> bool:
    return any(m == name or m.startswith(name + ".") for m in modules)


@pytest.mark.parametrize("console", ["off", "on"])
def test_an_idle_agent_has_not_imported_or_built_what_only_a_feature_needs(
    tmp_path: Path,
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    console: str,
) -> None:
    listen = "off" if console == "off" else f"127.0.0.1:{free_port()}"
    modules, built, tls = _idle_modules(
        tmp_path, coordinator, start_agent, {"FLASHNODE_UI_LISTEN": listen}
    )
    assert "flashnode.node.agent" in modules  # the report is the agent's own
    expected = {k: v for k, v in NOT_AT_IDLE.items() if console == "off" or k not in CONSOLE}
    loaded = {name: why for name, why in expected.items() if _loaded(modules, name)}
    assert not loaded, f"an idle agent imported what only a feature needs: {loaded}"
    assert not built, f"an idle agent built models only a task uses: {built}"
    # Its coordinator is plain http: its client builds none (coordinator/client.py, PlainHttp).
    assert tls == 0, f"an idle agent holds {tls} TLS context(s)"
    if console == "on":
        assert "flashnode.console.listener" in modules  # the console did start
