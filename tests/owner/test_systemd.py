"""The owner's path from the package, under a real systemd.

A minimal Debian bookworm root with systemd (tests/systemd_image.py) boots in a container with
systemd as PID 1 (docs/design.md §8), on the host's network so that it reaches the real coordinator
this test starts on 127.0.0.1. Inside, as an owner would: `dpkg -i` the .deb ./packaging/build
made, `flashnode login` with the token and join code on standard input, a config for the trusted
runner, `systemctl enable --now flashnode`; a pool job commits as a task user, `flashnode status`
as root shows the agent, `pools join` reaches it, `systemctl restart` mid-task returns in seconds
and the task commits (re-attached), a removal drains a running task, `systemctl poweroff`
mid-task is quick and keeps the newest checkpoint,
`systemd-analyze security` rates the unit at least OK, and `dpkg -P` leaves nothing behind.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import systemd_image
from conftest import TokenCoordinator
from harness import argv_job, wait_for

# Where a system's own bookkeeping changes when a package comes and goes; anything else new
# after the purge is something the package left behind.
CHURN = (
    "/var/lib/dpkg/",
    "/var/log/",
    "/var/cache/",
    "/var/lib/systemd/",
    "/etc/.pwd.lock",
    "/etc/ld.so.cache",
)


class Booted:
    """A container running systemd as PID 1."""

    def __init__(self, name: str) -> None:
        self.name = name

    def sh(
        self, script: str, stdin: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker", "exec", "-i", self.name, "sh", "-c", script],
            input=stdin if stdin is not None else "",
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ok(self, script: str, stdin: str | None = None, timeout: float = 120) -> str:
        done = self.sh(script, stdin, timeout)
        assert done.returncode == 0, f"{script}: rc {done.returncode}\n{done.stdout}{done.stderr}"
        return done.stdout

    def runs(self, job: str) -> bool:
        """Whether the agent runs a task of ``job`` now (this job's attempt, not the last one's,
        in a status read before it was rewritten)."""
        r = self.sh("flashnode status --json")
        return r.returncode == 0 and any(
            a.get("job_id") == job for a in json.loads(r.stdout).get("running") or []
        )

    def journal(self) -> str:
        return self.sh("journalctl -u flashnode --no-pager | tail -40").stdout

    def files(self) -> set[str]:
        listing = self.ok(
            "find / -xdev \\( -path /proc -o -path /sys -o -path /run -o -path /tmp \\) -prune"
            " -o -print"
        )
        return set(listing.splitlines())


@pytest.fixture(scope="session")
def image() -> str:
    why = systemd_image.cannot_build()
    if why:
        pytest.skip(f"no systemd test image: {why}")
    try:
        return systemd_image.ensure_image()
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot build the systemd test image here: {exc}")


@pytest.fixture
def booted(image: str) -> Iterator[Booted]:
    name = f"flashnode-test-systemd-{secrets.token_hex(4)}"
    # systemd makes / a shared mount only when the kernel starts it, not in a container; a
    # host's propagation is what LoadCredential= needs to hand the unit its credentials.
    started = subprocess.run(
        [
            "docker",
            "run",
            "-d",
            "--name",
            name,
            "--cap-add",
            "SYS_ADMIN",
            "--security-opt",
            "seccomp=unconfined",
            "--security-opt",
            "apparmor=unconfined",
            "-v",
            "/sys/fs/cgroup:/sys/fs/cgroup:rw",
            "--tmpfs",
            "/run",
            "--tmpfs",
            "/run/lock",
            "-e",
            "container=docker",
            "--network",
            "host",
            image,
            "/bin/sh",
            "-c",
            "mount --make-rshared / && exec /lib/systemd/systemd",
        ],
        capture_output=True,
        text=True,
    )
    if started.returncode != 0:
        pytest.skip(f"the engine cannot run the systemd container: {started.stderr.strip()}")
    box = Booted(name)
    try:
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            state = box.sh("systemctl is-system-running").stdout.strip()
            if state in ("running", "degraded"):
                break
            time.sleep(0.5)
        else:
            logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
            pytest.skip(
                f"systemd did not boot in a container here (state {state!r}):"
                f" {(logs.stdout + logs.stderr)[-500:]}"
            )
        yield box
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


# Run inside the container with its python3: log in with the link, read the state, change a
# setting as the page does (Origin and CSRF token).
CONSOLE_CLIENT = """
import http.cookiejar, json, urllib.request
jar = http.cookiejar.CookieJar()
web = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
base = "http://127.0.0.1:7469"
web.open("LINK").read()
csrf = json.load(web.open(base + "/api/session"))["csrf"]
state = json.load(web.open(base + "/api/state"))
change = urllib.request.Request(
    base + "/api/settings", data=json.dumps({"run_windows": ["Mon-Sun"]}).encode(),
    headers={"Content-Type": "application/json", "Origin": base, "X-Flashnode-CSRF": csrf},
)
print(json.dumps({"node_id": state["agent"]["node_id"], "changed": web.open(change).status}))
"""


def test_the_owners_path_from_the_package_under_systemd(
    booted: Booted, packages: list[Path], token_coordinator: TokenCoordinator
) -> None:
    server = token_coordinator.server
    [deb] = [p for p in packages if p.suffix == ".deb"]
    before = booted.files()
    subprocess.run(["docker", "cp", str(deb), f"{booted.name}:/tmp/flashnode.deb"], check=True)
    installed = booted.ok("dpkg -i /tmp/flashnode.deb")
    # What it made, in one line (not a line per user).
    made = [x for x in installed.splitlines() if x.startswith("flashnode: made")]
    assert made == [
        "flashnode: made the group flashnode, 16 task users (flashnode-task-0 to -15, one per"
        " slot), the agent's own users (flashnode-build, flashnode-helper), the mount point /work"
    ], installed
    assert "Creating" not in installed
    # The README installed with it says first which of its parts apply on this node; the books
    # it leads to lie beside it.
    readme = booted.ok("head -1 /usr/share/doc/flashnode/README.md")
    assert readme.startswith("> Installed with the flashnode package: on this node"), readme
    assert "Log in" in readme and "./scripts/demo" not in readme, readme
    booted.ok(
        "test -s /usr/share/doc/flashnode/docs/owner-manual.md"
        " && test -s /usr/share/doc/flashnode/docs/job-author-guide.md"
        " && test -s /usr/share/doc/flashnode/docs/reference.md"
    )

    # login: both secrets on standard input; a refused pair stores nothing.
    refused = booted.sh(
        f"flashnode login --coordinator {server.url}",
        stdin=f"wrong\n{token_coordinator.join_code}\n",
    )
    assert refused.returncode == 77, refused.stderr
    assert booted.ok("ls -A /etc/flashnode/credentials") == ""
    out = booted.ok(
        f"flashnode login --coordinator {server.url}",
        stdin=f"{token_coordinator.token}\n{token_coordinator.join_code}\n",
    )
    port = server.url.rsplit(":", 1)[1]
    assert f"/etc/flashnode/credentials/127.0.0.1_{port}.token" in out
    assert f"/etc/flashnode/credentials/127.0.0.1_{port}.join-code" in out

    # Slot i runs as "<task_user>-<i>": the one slot here runs as flashnode-task-0.
    booted.ok(
        "cat > /etc/flashnode/flashnode.toml",
        stdin=(
            "# this machine's agent\n"
            f'coordinator = "{server.url}"\n'
            'runner = "trusted"\n'
            'pools = ["team-a"]  # my team\n'
            "\n[trusted]\n"
            'task_user = "flashnode-task"\n'
        ),
    )
    doctor = booted.sh("flashnode doctor")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "ok    registration: dry run accepted, as node node-x" in doctor.stdout

    booted.ok("systemctl enable --now flashnode")  # Type=notify: returns once READY=1
    handed = booted.ok("ls /run/credentials/flashnode.service").split()
    assert handed == [f"flashnode_127.0.0.1_{port}.join-code", f"flashnode_127.0.0.1_{port}.token"]

    job = server.submit(argv_job(["sh", "-c", "id -un > user.txt; echo '{}' > metrics.json"]))
    state = server.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=60)
    assert state == "SUCCEEDED", booted.journal()
    assert server.artifact(f"jobs/{job}/task-000/user.txt").decode().strip() == "flashnode-task-0"

    snapshot = json.loads(booted.ok("flashnode status --json"))
    assert snapshot["node_id"] == "node-x" and snapshot["pools"] == ["team-a"]
    assert snapshot["registered"] is True and snapshot["counters"] == {"committed": 1}

    joined = booted.ok("flashnode pools join team-b")
    assert "told the running agent" in joined
    assert 'pools = ["team-a", "team-b"]  # my team' in booted.ok(
        "cat /etc/flashnode/flashnode.toml"
    )
    other = server.submit(argv_job(["sh", "-c", "echo '{}' > metrics.json"], pool="team-b"))
    assert server.wait_state(other, {"SUCCEEDED", "FAILED"}, timeout=60) == "SUCCEEDED"

    # The console, on its default address inside the unit's sandbox: a login link from
    # `flashnode ui`, the node's state, and a change written to the config file.
    link = booted.ok("flashnode ui --print-url").strip()
    assert link.startswith("http://127.0.0.1:7469/login?token=owner."), link
    seen = json.loads(booted.ok("python3 -", stdin=CONSOLE_CLIENT.replace("LINK", link)))
    assert seen["node_id"] == "node-x" and seen["changed"] == 200, seen
    assert 'run_windows = ["Mon-Sun"]' in booted.ok("cat /etc/flashnode/flashnode.toml")
    assert "# this machine's agent" in booted.ok("cat /etc/flashnode/flashnode.toml")

    # What the example config says to do after an edit: the unit's own reload.
    def reloads() -> int:
        log = booted.sh("journalctl -u flashnode --no-pager").stdout
        return log.count("configuration reloaded")

    reloaded = reloads()
    booted.ok("systemctl reload flashnode")
    wait_for("the reload in the journal", lambda: reloads() > reloaded)
    # Tasks log no complaint from the privilege drop.
    assert "setpriv" not in booted.sh("journalctl -u flashnode --no-pager").stdout

    # A restart while a task runs returns in seconds: the task runs on under its supervisor,
    # the new agent re-attaches it, and it commits in its first attempt.
    slow = server.submit(argv_job(["sh", "-c", "sleep 8; echo '{}' > metrics.json"]))

    wait_for("the slow task to run", lambda: booted.runs(slow), timeout=60)
    restarted_at = time.monotonic()
    booted.ok("systemctl restart flashnode", timeout=60)
    assert time.monotonic() - restarted_at <= 10, booted.journal()
    assert server.wait_state(slow, {"SUCCEEDED", "FAILED"}, timeout=60) == "SUCCEEDED"
    assert server.tasks(slow)[0]["attempts"] == 1, booted.journal()
    assert "re-attached 1 task(s) after a restart" in booted.journal()
    booted.ok("systemctl stop flashnode", timeout=60)
    assert booted.sh("flashnode status").returncode == 3

    analysis = booted.ok("systemd-analyze security flashnode --no-pager")
    line = next(x for x in analysis.splitlines() if "Overall exposure level" in x)
    assert float(line.split(":")[1].split()[0]) < 5.0, line  # "OK" or better

    # The package's scripts say what they wait for. An upgrade restarts a running agent in the
    # background; a removal stops it, waiting for a running task, and says for how long at most;
    # a reinstall says the service is left disabled and how to enable it.
    booted.ok("systemctl start flashnode")
    upgraded = booted.ok("dpkg -i /tmp/flashnode.deb")
    assert "restarting the agent on the new version (seconds): running tasks run on" in upgraded
    wait_for("the restarted agent", lambda: booted.sh("flashnode status").returncode == 0, 60)
    held = server.submit(argv_job(["sh", "-c", "sleep 3; echo '{}' > metrics.json"]))
    wait_for("the task to run", lambda: booted.runs(held), timeout=60)
    removed = booted.ok("dpkg -r flashnode", timeout=120)
    assert (
        "flashnode: stopping the agent: 1 running task(s) may finish first, for up to" in removed
    ), removed
    assert server.job(held)["state"] == "SUCCEEDED"
    again = booted.ok("dpkg -i /tmp/flashnode.deb")
    assert "the service is disabled" in again and "systemctl enable --now flashnode" in again
    assert booted.sh("systemctl is-enabled flashnode").stdout.strip() == "disabled"
    # The upgrades and the removal above kept the users and the group; a purge removes them.
    ours = "getent passwd | grep -c '^flashnode-'; getent group | grep -c '^flashnode' || true"
    assert booted.ok(ours).split() == ["18", "19"], booted.ok(ours)
    assert "flashnode: made" not in again  # nothing was missing

    # Removed right after a stop, with a task running on for the next start (reattach_seconds):
    # it ends with the package, and nothing of it is left running.
    booted.ok("systemctl start flashnode")
    lingering = server.submit(argv_job(["sh", "-c", "sleep 600"]))
    wait_for("the lingering task to run", lambda: booted.runs(lingering), timeout=60)
    booted.ok("systemctl stop flashnode")
    assert booted.sh("pgrep -u flashnode-task-0 sleep").returncode == 0  # it runs on
    purged = booted.ok("dpkg -P flashnode")
    assert booted.sh("pgrep -x sleep").returncode == 1, purged
    assert "flashnode: removing its state" in purged, purged
    assert "flashnode: removed the group flashnode and 18 of the users it made" in purged, purged
    assert booted.sh(ours).stdout.split() == ["0", "0"], purged
    left = sorted(
        p for p in booted.files() - before if not p.startswith(CHURN) and not p.endswith("-")
    )
    assert left == [], left
    assert booted.ok("ls /etc/systemd/system/multi-user.target.wants").count("flashnode") == 0


# A task that checkpoints (flashruntime's older file layout): a step a second up to 4, then
# nothing for long; each step's file is named in the journal (the step the coordinator must get).
STEPPING = """
import json, os, time
ckpt = os.environ["FLASHML_CHECKPOINT_DIR"]
for step in range(1, 5):
    tmp = os.path.join(ckpt, ".tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step}, f)
    os.rename(tmp, os.path.join(ckpt, "step-%d.json" % step))
    time.sleep(1)
time.sleep(600)
"""


def test_a_poweroff_mid_task_is_quick_and_the_coordinator_keeps_the_newest_checkpoint(
    booted: Booted, packages: list[Path], token_coordinator: TokenCoordinator
) -> None:
    server = token_coordinator.server
    [deb] = [p for p in packages if p.suffix == ".deb"]
    subprocess.run(["docker", "cp", str(deb), f"{booted.name}:/tmp/flashnode.deb"], check=True)
    booted.ok("dpkg -i /tmp/flashnode.deb")
    booted.ok(
        f"flashnode login --coordinator {server.url}",
        stdin=f"{token_coordinator.token}\n{token_coordinator.join_code}\n",
    )
    booted.ok(
        "cat > /etc/flashnode/flashnode.toml",
        stdin=(
            f'coordinator = "{server.url}"\nrunner = "trusted"\npools = ["team-a"]\n'
            # Only the shutdown's last sweep ships what the task wrote last.
            "checkpoint_scan_seconds = 300\n"
            '[trusted]\ntask_user = "flashnode-task"\n'
        ),
    )
    booted.ok("systemctl enable --now flashnode")
    job = server.submit(argv_job(["python3", "-c", STEPPING], checkpoint={"interval_seconds": 30}))

    def wrote_last_step() -> bool:
        found = booted.sh("ls /var/lib/flashnode/attempts/*/out/ckpt/").stdout.split()
        return "step-4.json" in found

    wait_for("the task's fourth step", wrote_last_step, timeout=60)
    off_at = time.monotonic()
    booted.sh("systemctl poweroff", timeout=30)
    subprocess.run(["docker", "wait", booted.name], capture_output=True, timeout=60)
    assert time.monotonic() - off_at <= 20
    r = server.http.get(f"/jobs/{job}/tasks/task-000/checkpoints/latest")
    assert r.status_code == 200 and r.json()["step"] == 4, r.text


def test_doctor_and_the_service_agree_on_what_the_unit_lets_the_agent_use(
    booted: Booted, packages: list[Path], token_coordinator: TokenCoordinator
) -> None:
    """A state dir under /srv, a token file under /root, a lent directory under /home: doctor
    fails each, naming the unit setting to change, and the service refuses as doctor said;
    with doctor's fixes as a drop-in, doctor passes and the service runs."""
    server = token_coordinator.server
    [deb] = [p for p in packages if p.suffix == ".deb"]
    subprocess.run(["docker", "cp", str(deb), f"{booted.name}:/tmp/flashnode.deb"], check=True)
    booted.ok("dpkg -i /tmp/flashnode.deb")
    booted.ok(
        f"flashnode login --coordinator {server.url}",
        stdin=f"{token_coordinator.token}\n{token_coordinator.join_code}\n",
    )
    booted.ok(
        "mkdir -p /home/owner/scans && echo hi > /home/owner/scans/a && chmod -R o+rX /home/owner"
        " && umask 077 && cat > /root/token",
        stdin=token_coordinator.token,
    )
    booted.ok(
        "cat > /etc/flashnode/flashnode.toml",
        stdin=(
            f'coordinator = "{server.url}"\nrunner = "trusted"\npools = ["team-a"]\n'
            'task_user = "flashnode-task"\nstate_dir = "/srv/flashnode"\n'
            'token_file = "/root/token"\n[local_data]\nscans = "/home/owner/scans"\n'
        ),
    )
    doctor = booted.sh("flashnode doctor")
    out = doctor.stdout
    assert doctor.returncode == 1, out
    assert (
        "FAIL  state_dir: the state dir /srv/flashnode (state_dir) is read-only for the service:"
        " ProtectSystem=strict in flashnode.service" in out
    ), out
    assert (
        "fix: sudo install -d -m 0700 /srv/flashnode; then sudo systemctl edit flashnode, then"
        " under [Service]: ReadWritePaths=/srv/flashnode" in out
    )
    assert "FAIL  token_file: the token file /root/token (token_file) does not exist for the" in out
    assert "ProtectHome=tmpfs and BindReadOnlyPaths=/root/token" in out
    assert "FAIL  local_data: the lent directory scans /home/owner/scans (local_data)" in out
    assert "BindReadOnlyPaths=/home/owner/scans" in out
    assert "chmod u+rwx" not in out

    # The service refuses as doctor said, naming the unit's setting (not "does not exist").
    assert booted.sh("systemctl start flashnode").returncode != 0
    refusal = (
        "the state dir /srv/flashnode (state_dir) is read-only for the service:"
        " ProtectSystem=strict in flashnode.service (and 2 more: sudo flashnode doctor lists them)"
    )
    wait_for("the refusal in the journal", lambda: refusal in booted.journal())
    # Where `flashnode status` finds it (the state dir it was given cannot be made: the unit's).
    status = booted.sh("flashnode status")
    assert status.returncode == 3, status.stdout + status.stderr
    assert "exit 78" in status.stdout and refusal in status.stdout, status.stdout
    assert "fix: sudo install -d -m 0700 /srv/flashnode" in status.stdout

    # Doctor's fixes, as the owner would apply them.
    booted.ok(
        "install -d -m 0700 /srv/flashnode && mkdir -p /etc/systemd/system/flashnode.service.d"
    )
    booted.ok(
        "cat > /etc/systemd/system/flashnode.service.d/override.conf && systemctl daemon-reload",
        stdin=(
            "[Service]\nReadWritePaths=/srv/flashnode\nProtectHome=tmpfs\n"
            "BindReadOnlyPaths=/root/token /home/owner/scans\n"
        ),
    )
    doctor = booted.sh("flashnode doctor")
    assert doctor.returncode == 0, doctor.stdout
    assert "override.conf" in doctor.stdout and "ok    local data scans" in doctor.stdout
    booted.ok("systemctl start flashnode")
    job = server.submit(argv_job(["sh", "-c", "echo '{}' > metrics.json"]))
    assert server.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=60) == "SUCCEEDED", (
        booted.journal()
    )
    snapshot = json.loads(booted.ok("flashnode status --json"))
    assert snapshot["registered"] is True
    assert booted.ok("ls /srv/flashnode").split().count("status.json") == 1


@pytest.fixture(scope="session")
def other_release() -> str:
    why = systemd_image.cannot_build()
    if why:
        pytest.skip(f"no image of another release: {why}")
    try:
        return systemd_image.ensure_image(
            suite=systemd_image.OTHER_SUITE, include=systemd_image.OTHER_INCLUDE
        )
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot build an image of {systemd_image.OTHER_SUITE} here: {exc}")


def test_the_package_built_here_installs_and_runs_on_another_release(
    other_release: str, packages: list[Path]
) -> None:
    """Built on Debian 12 (Python 3.11), installed on Debian 13 (Python 3.13): it runs there
    (pydantic's compiled core for that Python is in the package), and a purge leaves nothing."""
    [deb] = [p for p in packages if p.suffix == ".deb"]
    script = (
        "set -e; python3 -c 'import sys; print(sys.version_info[:2])';"
        " find / -xdev -path /proc -prune -o -print | sort > /tmp/before;"
        " dpkg -i /dist/" + deb.name + " >/dev/null;"
        " flashnode --version;"
        " flashnode doctor --coordinator http://127.0.0.1:9 --state-dir /srv/s || true;"
        " dpkg -P flashnode >/dev/null;"
        " find / -xdev -path /proc -prune -o -print | sort > /tmp/after;"
        " comm -13 /tmp/before /tmp/after | grep -v -e '^/var/lib/dpkg' -e '^/var/log'"
        " -e '^/var/cache' -e '^/etc/.pwd.lock' -e '^/tmp/' -e '-$' -e '^/etc/ld.so.cache'"
        " -e '^/var/lib/systemd' || true"
    )
    done = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "-v",
            f"{deb.parent}:/dist:ro",
            other_release,
            "sh",
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "(3, 13)", lines
    assert lines[1].startswith("flashnode, version"), done.stdout + done.stderr
    assert "ok    configuration:" in done.stdout and "Traceback" not in done.stdout + done.stderr
    assert [x for x in lines if x.startswith("/")] == [], done.stdout  # nothing left behind
