"""Running as a service: sd_notify, the systemd unit, the packages, and the owner's commands."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import DRAIN, AgentProcess, CoordinatorServer, NotifySocket, argv_job, wait_for

from flashnode.sandbox.procs import BUILD_USER, HELPER_USER

ROOT = Path(__file__).resolve().parents[2]
FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
TRUSTED = ("--runner", "trusted", "--pool", "team-a")


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    n = NotifySocket(tmp_path / "notify.sock")
    yield n
    n.close()


def test_sd_notify_ready_status_watchdog_and_stopping(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], notify: NotifySocket
) -> None:
    job = coordinator.submit(argv_job(["sh", "-c", "sleep 4; echo '{}' > metrics.json"]))
    agent = start_agent(
        coordinator.url,
        *TRUSTED,
        env={**FAST, "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"},
    )
    wait_for("READY=1", lambda: notify.lines("READY=1"))
    wait_for(
        "a running status", lambda: any("running ls-" in m for _, m in notify.lines("STATUS="))
    )
    assert any(m == "STATUS=idle" for _, m in notify.lines("STATUS=")) or coordinator.tasks(job)
    time.sleep(2.2)  # a window to count watchdog pings in
    pings = [t for t, _ in notify.lines("WATCHDOG=1")]
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    # Half of WATCHDOG_USEC, give or take one turn of the loop (at most 0.5 s).
    assert len(pings) >= 3 and all(0.3 <= g <= 1.05 for g in gaps[1:]), gaps
    agent.signal(DRAIN)
    assert agent.wait(30) == 0, agent.log
    assert notify.lines("STOPPING=1")
    extend = notify.lines("EXTEND_TIMEOUT_USEC=")
    assert extend and int(extend[0][1].split("=")[1]) > 300 * 1_000_000
    assert coordinator.job(job)["state"] == "SUCCEEDED"  # the drained task still committed


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (.ci/run installs systemd)")
    unit = (ROOT / "systemd" / "flashnode.service").read_text()
    # verify wants the ExecStart binary to exist: point it at this checkout's agent.
    exe = shutil.which("flashnode") or str(Path(sys.executable).parent / "flashnode")
    path = tmp_path / "flashnode.service"
    path.write_text(unit.replace("/usr/bin/flashnode", exe))
    done = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "flashnode.service" not in done.stderr, done.stderr  # no warnings about our unit
    for directive in (
        "Type=notify",
        "WatchdogSec=",
        "KillMode=process",
        "RestartPreventExitStatus=77 78",
        "StateDirectory=flashnode",
        "Restart=on-failure",
        "LoadCredential=flashnode:/etc/flashnode/credentials",
        "UMask=0077",
        "PYTHONDONTWRITEBYTECODE=1",
        "LimitNOFILE=65536",
    ):
        assert directive in unit
    assert "\nUser=" not in unit  # root, bounded by CapabilityBoundingSet=
    stop = int(unit.split("TimeoutStopSec=")[1].split()[0])
    assert 15 < stop <= 30  # a stop lets go of tasks in seconds; a shutdown stops them in 15


def exposure(analysis: str) -> float:
    """The figure of `systemd-analyze security`'s "Overall exposure level ... 4.1 OK" line."""
    line = next(x for x in analysis.splitlines() if "Overall exposure level" in x)
    return float(line.split(":")[1].split()[0])


def test_unit_hardening_is_at_least_ok_and_every_capability_is_explained() -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (.ci/run installs systemd)")
    unit = ROOT / "systemd" / "flashnode.service"
    done = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
    )
    if "--offline" in done.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 252)")
    # "OK" is an exposure below 5.0 (MEDIUM is 5.0 to 6.9).
    assert exposure(done.stdout) < 5.0, done.stdout
    text = unit.read_text()
    bounding = next(x for x in text.splitlines() if x.startswith("CapabilityBoundingSet="))
    caps = bounding.split("=", 1)[1].split()
    assert set(caps) == {
        "CAP_SETUID",
        "CAP_SETGID",
        "CAP_KILL",
        "CAP_CHOWN",
        "CAP_FOWNER",
        "CAP_DAC_OVERRIDE",
        "CAP_DAC_READ_SEARCH",
        "CAP_SYS_ADMIN",
        "CAP_SYS_PTRACE",
    }
    comments = "\n".join(x for x in text.splitlines() if x.startswith("#"))
    for cap in caps:
        assert cap in comments, f"{cap} is not explained in the unit"
    for left_out in ("PrivateDevices=", "ProtectControlGroups=", "PrivateUsers=", "ProcSubset="):
        assert left_out in comments and f"\n{left_out}" not in text  # documented, not set


def test_sysusers_makes_the_flashnode_group_sixteen_slot_users_and_the_agents_own() -> None:
    lines = [
        x.split()
        for x in (ROOT / "systemd" / "flashnode.sysusers").read_text().splitlines()
        if x and not x.startswith("#")
    ]
    assert ["g", "flashnode", "-"] in lines
    users = [x[1] for x in lines if x[0] == "u"]
    assert users == [f"flashnode-task-{i}" for i in range(16)] + [BUILD_USER, HELPER_USER]
    # The package's fallback (no systemd-sysusers) and the tests' script make the same users.
    for script in ("packaging/postinstall.sh", "scripts/task-users"):
        text = (ROOT / script).read_text()
        assert BUILD_USER in text and HELPER_USER in text, script
    assert not any(x[0] == "m" for x in lines)  # nobody is put in the docker group


OWNED = ("/opt/flashnode", "/etc/flashnode", "/var/lib/flashnode", "/usr/share/doc/flashnode")


def files_under(roots: tuple[str, ...]) -> set[str]:
    found = set()
    for root in map(Path, roots):
        if root.exists():
            found |= {str(p) for p in root.rglob("*")} | {str(root)}
    return found


@pytest.fixture
def installed_deb(packages: list[Path]) -> Iterator[set[str]]:
    """The .deb installed on this host; yields what was under its paths before (a shared host
    may hold leftovers of older packages, which are not this package's to remove)."""
    [deb] = [p for p in packages if p.suffix == ".deb"]
    before = files_under(OWNED)
    # Accounts of the package's names that were here before it (the developer's, made by
    # scripts/task-users): not the package's to remove.
    subprocess.run([str(ROOT / "scripts" / "task-users")], check=True)
    done = subprocess.run(["dpkg", "-i", str(deb)], capture_output=True, text=True)
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        yield before
    finally:
        subprocess.run(["dpkg", "--purge", "flashnode"], capture_output=True)


def test_deb_installs_runs_from_the_path_and_purges_to_nothing(
    installed_deb: set[str], tmp_path: Path
) -> None:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(tmp_path)}
    version = subprocess.run(["flashnode", "--version"], capture_output=True, text=True, env=env)
    assert version.returncode == 0 and "flashnode, version" in version.stdout
    assert Path("/usr/bin/flashnode").resolve() == Path("/opt/flashnode/bin/flashnode")
    config = Path("/etc/flashnode/flashnode.toml")
    assert config.exists() and "coordinator" in config.read_text()
    creds = Path("/etc/flashnode/credentials")
    assert creds.is_dir() and creds.stat().st_mode & 0o777 == 0o700
    assert Path("/usr/share/doc/flashnode/copyright").read_text().startswith("Format: ")
    shipped = subprocess.run(
        ["dpkg", "-L", "flashnode"], capture_output=True, text=True
    ).stdout.split()
    assert not [f for f in shipped if Path(f).name in ("pip", "pip3", "activate")]
    assert not [f for f in shipped if "/site-packages/pip/" in f]
    # Every command as root, and `doctor` against nothing: it writes no bytecode anywhere.
    doctor = subprocess.run(
        ["flashnode", "doctor"],
        capture_output=True,
        text=True,
        env={
            **env,
            "FLASHNODE_COORDINATOR": "http://127.0.0.1:9",
            "FLASHNODE_STATE_DIR": str(tmp_path / "state"),
            "FLASHNODE_RUNNER": "trusted",
            "FLASHNODE_POOLS": "p",
            "FLASHNODE_TASK_USER": "flashnode-task-0",
        },
    )
    assert doctor.returncode == 1, doctor.stdout  # nothing answers on port 9: a FAIL
    assert "FAIL  coordinator" in doctor.stdout and "fix:" in doctor.stdout
    assert not (tmp_path / "state").exists()  # doctor makes nothing
    for args in (["status"], ["history"], ["pools", "list"], ["login", "--help"]):
        subprocess.run(["flashnode", *args], capture_output=True, env=env)
    assert Path("/usr/lib/systemd/system/flashnode.service").exists()
    assert subprocess.run(["getent", "group", "flashnode"], capture_output=True).returncode == 0
    for i in (0, 15):
        assert subprocess.run(["id", f"flashnode-task-{i}"], capture_output=True).returncode == 0
    done = subprocess.run(["dpkg", "--purge", "flashnode"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # The accounts that were here before the package are still here: a purge removes only the
    # ones it made.
    for name in ("flashnode-task-0", "flashnode-task-15", "flashnode-build", "flashnode-helper"):
        assert subprocess.run(["id", name], capture_output=True).returncode == 0, done.stdout
    assert subprocess.run(["getent", "group", "flashnode"], capture_output=True).returncode == 0
    assert "flashnode: removed" not in done.stdout, done.stdout
    left = files_under(OWNED) - installed_deb
    assert not left, sorted(left)[:20]  # no bytecode written at run time, no state, no config
    assert not Path("/usr/bin/flashnode").exists()


def test_package_versions_sort_before_their_release(packages: list[Path]) -> None:
    [deb] = [p for p in packages if p.suffix == ".deb"]
    version = subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True
    ).stdout.strip()
    assert version.startswith("0.5.0~dev0"), version
    release = "0.5.0-1"
    assert subprocess.run(["dpkg", "--compare-versions", version, "lt", release]).returncode == 0
    assert subprocess.run(["dpkg", "--compare-versions", version, "gt", "0.4.1-1"]).returncode == 0


def test_rpm_builds_with_the_right_files(packages: list[Path]) -> None:
    [rpm] = [p for p in packages if p.suffix == ".rpm"]
    if shutil.which("rpm") is None:
        pytest.skip("the rpm tool is not installed (.ci/run installs it)")

    def query(*args: str) -> str:
        return subprocess.run(
            ["rpm", "-qp", *args, str(rpm)], capture_output=True, text=True
        ).stdout

    files = query("-l").split()
    for expected in (
        "/opt/flashnode/bin/flashnode",
        "/usr/bin/flashnode",
        "/usr/lib/systemd/system/flashnode.service",
        "/usr/lib/sysusers.d/flashnode.conf",
        "/etc/flashnode/flashnode.toml",
        "/etc/flashnode/credentials",
        "/usr/share/doc/flashnode/copyright",
        "/usr/share/doc/flashnode/README.md",
        "/usr/share/doc/flashnode/docs/owner-manual.md",
        "/usr/share/doc/flashnode/docs/job-author-guide.md",
        "/usr/share/doc/flashnode/docs/reference.md",
        "/usr/share/doc/flashnode/docs/monitoring/flashnode-dashboard.json",
        "/usr/share/doc/flashnode/docs/monitoring/flashnode-alerts.yml",
    ):
        assert expected in files
    assert not [f for f in files if f.endswith(("/bin/pip", "/bin/activate"))]
    # The package owns the compiled bytecode of everything it ships.
    sources = {f for f in files if f.endswith(".py") and "/site-packages/flashnode/" in f}
    compiled = [f for f in files if f.endswith(".pyc") and "/site-packages/flashnode/" in f]
    assert sources and len(compiled) >= len(sources)
    assert query("-c").split() == ["/etc/flashnode/flashnode.toml"]
    assert query("--queryformat", "%{VERSION}-%{RELEASE}") == "0.5.0~dev0-1"
    # Any python3 from 3.10 to 3.13 (packaging/build ships what each needs), not the build's.
    requires = query("--requires").splitlines()
    assert "python3 >= 3.10" in requires and "python3 < 3.14" in requires, requires
    assert not [r for r in requires if r.startswith("python(abi)")]
    scripts = query("--scripts")
    assert "systemd-sysusers" in scripts
    starts = [
        line
        for line in scripts.splitlines()
        if "systemctl" in line
        and not line.strip().startswith(("echo", "#"))
        and any(verb in line.split() for verb in ("start", "enable", "restart"))
    ]
    assert starts == []  # an unconfigured agent is never started (try-restart only restarts)


def test_status_names_the_running_task_and_pools_join_reaches_the_agent(
    flashnode: Callable[..., Any],
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    tmp_path: Path,
    drop_dir: Path,
) -> None:
    config = tmp_path / "flashnode.toml"
    config.write_text(
        f'coordinator = "{coordinator.url}"\nrunner = "trusted"\npools = ["team-a"]\n'
    )
    # The task runs until the test has looked at it (a fixed sleep could end first on a busy host).
    go = drop_dir / "go"
    wait = f"while [ ! -e {go} ]; do sleep 0.05; done; echo '{{}}' > metrics.json"
    job = coordinator.submit(argv_job(["sh", "-c", wait]))
    other = coordinator.submit(argv_job(["sh", "-c", "echo '{}' > metrics.json"], pool="team-z"))
    agent = start_agent(coordinator.url, "--config", str(config), env=FAST)
    wait_for("the task to be leased", lambda: coordinator.tasks(job)[0]["state"] == "LEASED")

    def running() -> dict[str, object] | None:
        r = flashnode("status", "--json", "--state-dir", str(agent.state_dir))
        snap = json.loads(r.stdout) if r.returncode == 0 else None
        return snap if snap and snap.get("running") else None

    snapshot = wait_for("status naming the task", running)
    [attempt] = snapshot["running"]  # type: ignore[index]
    assert (
        attempt["job_id"] == job and attempt["task_id"] == "task-000" and attempt["elapsed_s"] >= 0
    )
    assert snapshot["runner"] == "trusted" and snapshot["pools"] == ["team-a"]
    assert snapshot["last_heartbeat_age_s"] is not None and snapshot["last_heartbeat_age_s"] < 10
    human = flashnode("status", "--state-dir", str(agent.state_dir))
    assert job in human.stdout
    go.touch()

    joined = flashnode(
        "pools",
        "join",
        "team-z",
        "--config",
        str(config),
        env={"FLASHNODE_STATE_DIR": str(agent.state_dir)},
    )
    assert joined.returncode == 0, joined.stderr
    assert "told the running agent" in joined.stdout
    assert coordinator.wait_state(other, {"SUCCEEDED", "FAILED"}, timeout=30) == "SUCCEEDED"
    assert flashnode("pools", "list", "--config", str(config)).stdout.split() == [
        "team-a",
        "team-z",
    ]
    history = flashnode("history", "--state-dir", str(agent.state_dir))
    assert "committed" in history.stdout


def test_a_terminal_gets_a_live_status_line_that_log_lines_clear(
    coordinator: CoordinatorServer, tmp_path: Path
) -> None:
    import pty

    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("FLASHNODE_", "JOURNAL_STREAM"))
    }
    if os.geteuid() == 0:
        base["FLASHNODE_TASK_USER"] = "flashnode-task"
    state = Path(tempfile.mkdtemp(prefix="flashnode-state-"))
    pid, fd = pty.fork()
    if pid == 0:  # the child: the agent on a terminal
        os.execve(
            sys.executable,
            [
                sys.executable,
                "-m",
                "flashnode",
                "work",
                "--coordinator",
                coordinator.url,
                *TRUSTED,
                "--state-dir",
                str(state),
            ],
            base,
        )
    output = b""
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and b"\r\x1b[Kidle" not in output:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    output += os.read(fd, 4096)
                except OSError:
                    break
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)
        shutil.rmtree(state, ignore_errors=True)
    text = output.decode(errors="replace")
    assert "\r\x1b[Kidle" in text, text  # the live line, redrawn in place
    assert "\r\x1b[K" + time.strftime("%Y") in text  # a log line clears it before printing
