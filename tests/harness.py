"""Real parts for the tests: a flashruntime coordinator under uvicorn on 127.0.0.1, and the agent
as a subprocess, with helpers that poll with a deadline instead of sleeping."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

T = TypeVar("T")
API = "/v1alpha1"
TASK_USER = "flashnode-task"  # slot N runs as flashnode-task-N (.ci/run creates them)


# Tasks of a root agent get a private /tmp: what a task and a test must both see lives here.
SHARED_ROOT = Path("/var/lib/flashnode-tests")


def shared_dir(prefix: str) -> Path:
    """A new directory that a task (as a task user, in its own mount namespace) and the test
    both see."""
    if os.geteuid() != 0:
        return Path(tempfile.mkdtemp(prefix=prefix))
    SHARED_ROOT.mkdir(mode=0o755, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=SHARED_ROOT))


def slot_user(slot: int = 0) -> Any:
    """The task user of ``slot`` (a ``procs.TaskUser``), as ``./scripts/task-users`` makes it."""
    import pwd

    from flashnode.sandbox import procs

    user = pwd.getpwnam(f"flashnode-task-{slot}")
    return procs.TaskUser(user.pw_name, user.pw_uid, user.pw_gid)


@contextlib.contextmanager
def tmpfs_disk(prefix: str, options: str) -> Iterator[Path]:
    """A tmpfs (``options``: its size and inodes) standing in for the owner's disk, in a
    ``shared_dir``; unmounted and removed at the end whatever happened. Needs root (skips)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = shared_dir(prefix)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"{options},mode=0755", "tmpfs", str(mount)], check=True
    )
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        mount.rmdir()


class Lowest:
    """The least free space and inodes a file system was seen with."""

    def __init__(self) -> None:
        self.bytes = 1 << 62
        self.inodes = 1 << 62


@contextlib.contextmanager
def lowest_free(path: Path, done: Callable[[], bool]) -> Iterator[Lowest]:
    """Samples ``path``'s file system about every millisecond, on a thread, until ``done()`` or
    the block ends: how low a task or a build took the owner's disk. Sampling without a pause
    would hold the GIL from the test's own servers (a package index, the coordinator's client)."""
    lowest = Lowest()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set() and not done():
            with contextlib.suppress(OSError):
                st = os.statvfs(path)
                lowest.bytes = min(lowest.bytes, st.f_bavail * st.f_frsize)
                lowest.inodes = min(lowest.inodes, st.f_favail)
            stop.wait(0.001)

    watcher = threading.Thread(target=watch, name="lowest-free", daemon=True)
    watcher.start()
    try:
        yield lowest
    finally:
        stop.set()
        watcher.join(5)


def run_flashnode(
    *args: str, env: dict[str, str] | None = None, stdin: str = "", timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """The flashnode program, run as a process with ``env`` over this one's, less the settings
    and systemd's directories this environment may hold (a test's own must be explicit)."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FLASHNODE_", "STATE_DIRECTORY", "CREDENTIALS_DIRECTORY"))
    }
    return subprocess.run(
        [sys.executable, "-m", "flashnode", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
        env={**base, **(env or {})},
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    what: str, check: Callable[[], T | None], timeout: float = 30.0, every: float = 0.1
) -> T:
    """Poll ``check`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


class CoordinatorServer:
    """flashruntime 0.6.1's service app, started with uvicorn as in docs/protocol.md §1.1."""

    def __init__(
        self,
        root: Path,
        env: dict[str, str] | None = None,
        port: int | None = None,
        record: bool = False,
        app: str = "flashruntime.service.app:app",
        app_path: tuple[Path, ...] = (),
    ) -> None:
        self.root = root
        self.record_path = root / "recorded.jsonl" if record else None
        self.app = app
        self.app_path = [str(p) for p in app_path]
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=self.url + API, timeout=10.0)

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the server's process; ``wait_ready`` waits until it answers."""
        data = self.root / "data"
        env = {
            **os.environ,
            "FLASHML_ENABLE_KUBERAY": "0",
            "FLASHML_LEDGER_PATH": str(data / "flashruntime.db"),
            "FLASHML_LOCAL_ARTIFACTS_DIR": str(data / "artifacts"),
            **self.extra_env,
        }
        app = self.app
        if self.record_path is not None:
            app = "recording_app:app"
            env["FLASHNODE_TEST_RECORD"] = str(self.record_path)
        if app != "flashruntime.service.app:app":
            env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *self.app_path])
        log = (self.root / "coordinator.log").open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                app,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
            ],
            env=env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        log.close()

    def wait_ready(self) -> None:
        wait_for("the coordinator to answer", self._healthy, timeout=30)

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(
                f"coordinator exited: {(self.root / 'coordinator.log').read_text()}"
            )
        try:
            return httpx.get(self.url + "/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def close(self) -> None:
        self.stop()
        self.http.close()

    def recorded(self, path_suffix: str) -> list[dict[str, Any]]:
        """Bodies the nodes sent to paths ending in ``path_suffix`` (record=True only)."""
        return [x["body"] for x in self.requests(path_suffix)]

    def requests(self, path_suffix: str) -> list[dict[str, Any]]:
        """Requests to paths ending in ``path_suffix``, in the order they were answered: their
        ``body``, the answer's ``status`` and ``t``, the time they arrived (record=True only)."""
        assert self.record_path is not None
        if not self.record_path.exists():
            return []
        lines = [json.loads(x) for x in self.record_path.read_text().splitlines() if x.strip()]
        return [x for x in lines if x["path"].endswith(path_suffix)]

    # --- the job API (unauthenticated in every mode) ------------------------------------------

    def submit(self, spec: dict[str, Any]) -> str:
        r = self.http.post("/jobs", json=spec)
        assert r.status_code == 201, r.text
        return str(r.json()["job_id"])

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self.http.get(f"/jobs/{job_id}").json())

    def tasks(self, job_id: str) -> list[dict[str, Any]]:
        return list(self.http.get(f"/jobs/{job_id}/tasks").json())

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return list(self.http.get(f"/jobs/{job_id}/events").json())

    def artifacts(self, job_id: str) -> list[str]:
        return [a["key"] for a in self.http.get(f"/jobs/{job_id}/artifacts").json()]

    def artifact(self, key: str) -> bytes:
        r = self.http.get(f"/artifacts/{key}")
        assert r.status_code == 200, r.text
        return r.content

    def put_artifact(self, key: str, data: bytes) -> None:
        r = self.http.put(f"/artifacts/{key}", content=data)
        assert r.status_code == 200, r.text

    def cancel(self, job_id: str) -> None:
        assert self.http.post(f"/jobs/{job_id}/cancel").status_code == 200

    def wait_state(self, job_id: str, states: set[str], timeout: float = 60.0) -> str:
        return wait_for(
            f"job {job_id} to reach {states}",
            lambda: (s := self.job(job_id)["state"]) in states and s,
            timeout=timeout,
        )


def argv_job(
    command: list[str],
    pool: str | None = "team-a",
    params: list[dict[str, Any]] | None = None,
    allow_fallback: bool = True,
    max_attempts: int = 2,
    lease_seconds: int = 60,
    **extra: Any,
) -> dict[str, Any]:
    """A pool-scoped argv job in the shape of docs/protocol.md §1.5 example B."""
    spec: dict[str, Any] = {
        "apiVersion": "flashml.dev/v1alpha1",
        "kind": "Job",
        "metadata": {"name": "test-argv"},
        "spec": {
            "execution": {"backend": "leases"},
            "image": {"repository": "python", "tag": "3.11-slim"},
            "isolation": {"tier": "sandboxed", "allowFallback": allow_fallback},
            "retryPolicy": {"maxTaskAttempts": max_attempts},
            "workload": {
                "type": "command",
                "parameters": {"command": command, "lease_seconds": lease_seconds, **extra},
            },
        },
    }
    if pool:
        spec["spec"]["placement"] = {"pool": pool}
    if params is not None:
        spec["spec"]["workload"]["parameters"]["task_params"] = params
    return spec


DRAIN = signal.SIGRTMIN + 2  # what `flashnode drain` sends (status.json lists it)


class AgentProcess:
    """``python -m flashnode work`` as a subprocess, its log in a file."""

    def __init__(
        self,
        root: Path,
        coordinator_url: str,
        *args: str,
        env: dict[str, str] | None = None,
        state_dir: Path | None = None,
    ) -> None:
        self.root = root
        # Not under pytest's private tmp dir (a task user must reach its workspace), nor under
        # /tmp (each task of a root agent has its own): where an owner's would be.
        self.state_dir = state_dir or shared_dir("flashnode-state-")
        self.log_path = root / "agent.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")}
        full_env["PYTHONUNBUFFERED"] = "1"
        # The console is on by default at a fixed port; tests that want it give an address.
        full_env["FLASHNODE_UI_LISTEN"] = "off"
        if os.geteuid() == 0:
            full_env["FLASHNODE_TASK_USER"] = TASK_USER
        else:  # no user to switch to: trusted tasks run as the agent's own user (owner's manual)
            full_env["FLASHNODE_ALLOW_SAME_USER"] = "true"
        full_env.update(env or {})
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flashnode",
                "work",
                "--coordinator",
                coordinator_url,
                "--state-dir",
                str(self.state_dir),
                *args,
            ],
            env=full_env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        log.close()

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = 30.0) -> None:
        wait_for(f"agent log line {text!r}", lambda: text in self.log or self._dead(), timeout)
        assert text in self.log, self.log

    def _dead(self) -> bool:
        return self.proc.poll() is not None

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"agent still running after {timeout} s:\n{self.log}") from None

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            # Drain, then (once the agent says it drains: two signals at once coalesce) stop
            # its tasks now: a SIGTERM would leave them running for the next start.
            self.proc.send_signal(DRAIN)
            with contextlib.suppress(AssertionError):
                wait_for("the agent to drain", lambda: "draining" in self.log or self._dead(), 10)
            if self.proc.poll() is None:
                self.proc.send_signal(DRAIN)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def wait_ledger(self, count: int = 1, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The ledger once it has ``count`` lines: an attempt's line is written after its
        commit was accepted, so the coordinator may say SUCCEEDED a moment before."""
        return wait_for(
            f"{count} ledger line(s)",
            lambda: len(self.ledger()) >= count and self.ledger(),
            timeout,
        )

    def done(self) -> bool:
        """The agent has exited, or written its first ledger line."""
        return self.proc.poll() is not None or bool(self.ledger())

    def ledger(self) -> list[dict[str, Any]]:
        path = self.state_dir / "ledger.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def processes_with(marker: str) -> list[int]:
    """Live pids whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and pid_alive(int(entry)):
            found.append(int(entry))
    return found


def processes_in(directory: Path) -> list[int]:
    """Live pids whose working directory is ``directory`` or under it (a task's supervisor
    works in its home under the agent's state dir)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = Path(os.readlink(f"/proc/{entry}/cwd"))
        except OSError:
            continue
        if cwd.is_relative_to(directory) and pid_alive(int(entry)):
            found.append(int(entry))
    return found


class NotifySocket:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET, recording what arrives."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            for line in data.decode().splitlines():
                self.messages.append((time.monotonic(), line))

    def lines(self, prefix: str) -> list[tuple[float, str]]:
        return [(t, m) for t, m in self.messages if m.startswith(prefix)]

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


def ended_in_sandbox(argv: list[str], sandbox: Any, cwd: Path, logs: Path, user: Any = None) -> Any:
    """Run ``argv`` by a launch chain in ``sandbox`` (a ``procs.mounts.Sandbox``), as ``user``
    (a ``procs.TaskUser``; None: root), in ``cwd``, its output in ``logs``/out and ``logs``/err;
    the ``TaskProcess`` once its chain has ended."""
    from flashnode.sandbox import procs
    from flashnode.sandbox.procs.chain import SYSTEM_PATH
    from flashnode.sandbox.procs.task import TaskProcess

    proc = TaskProcess(
        argv,
        {procs.OWNER_ENV: procs.new_token(), "PATH": SYSTEM_PATH},
        cwd=cwd,
        stdout=logs / "out",
        stderr=logs / "err",
        log_max_bytes=4096,
        on_exit=lambda: None,
        user=user,
        sandbox=sandbox,
    )
    wait_for("the chain to end", proc.exited.is_set)
    proc.close()
    return proc
