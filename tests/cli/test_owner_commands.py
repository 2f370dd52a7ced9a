"""The owner's path: one test per thing an owner meets, from installing to running the service.

Tested elsewhere: "not on PATH after dpkg -i" and "packaging" in owner/test_service.py
(test_deb_installs_runs_from_the_path_and_purges_to_nothing, test_package_versions_sort_before_
their_release, test_rpm_builds_with_the_right_files, test_unit_hardening_is_at_least_ok_...) and,
under a real systemd, owner/test_systemd.py; "the service's state" ($STATE_DIRECTORY) in
config/test_settings.py::test_the_state_dir_is_systemds_when_it_gives_one and
owner/test_systemd.py;
"--slots -1, FLASHNODE_SLOTS=-2" and the size/suggestion/token-file parts of "errors" in
config/test_settings.py.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from conftest import TokenCoordinator
from consoleharness import start_console_agent
from harness import TASK_USER, AgentProcess, CoordinatorServer, argv_job, wait_for
from localhttp import LocalHTTPServer

from flashnode.cli.main import main
from flashnode.config.loading import load

ROOT = Path(__file__).resolve().parents[2]
FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}
IS_ROOT = os.geteuid() == 0


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    return path


# --- row: `sudo flashnode login` → the service exits 77 (no join code) ------------------------


def test_login_stores_token_and_join_code_and_work_uses_both(
    flashnode: Callable[..., Any],
    token_coordinator: TokenCoordinator,
    start_agent: Callable[..., AgentProcess],
    tmp_path: Path,
) -> None:
    server = token_coordinator.server
    creds = private_dir(tmp_path / "creds")
    env = {"FLASHNODE_STATE_DIR": str(tmp_path / "login-state")}
    done = flashnode(
        "login",
        "--coordinator",
        server.url,
        "--credentials-dir",
        str(creds),
        env=env,
        stdin=f"{token_coordinator.token}\n{token_coordinator.join_code}\n",
    )
    assert done.returncode == 0, done.stderr
    assert "registered as node node-x" in done.stdout
    port = server.url.rsplit(":", 1)[1]
    stored = sorted(p.name for p in creds.iterdir())
    assert stored == [f"127.0.0.1_{port}.join-code", f"127.0.0.1_{port}.token"]
    for name in stored:
        assert str(creds / name) in done.stdout  # says where
        assert (creds / name).stat().st_mode & 0o777 == 0o600
    # `work` with no token or join code given finds both.
    job = server.submit(argv_job(["sh", "-c", "echo '{}' > metrics.json"]))
    agent = start_agent(
        server.url,
        "--runner",
        "trusted",
        "--pool",
        "team-a",
        env={**FAST, "FLASHNODE_CREDENTIALS_DIR": str(creds)},
    )
    assert server.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log


# --- row: `flashnode status` after the agent exited ------------------------------------------


def test_status_is_exit_3_once_the_agent_has_stopped(
    flashnode: Callable[..., Any],
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    tmp_path: Path,
) -> None:
    agent = start_agent(coordinator.url, "--runner", "trusted", "--pool", "team-a", env=FAST)
    state = ["--state-dir", str(agent.state_dir)]
    wait_for("status of the running agent", lambda: flashnode("status", *state).returncode == 0)
    agent.signal(signal.SIGTERM)
    assert agent.wait(30) == 0
    assert json.loads((agent.state_dir / "status.json").read_text())["pid"] is None
    done = flashnode("status", *state)
    assert done.returncode == 3 and "no agent is running" in done.stdout
    # A dead pid, and a live process that is not an agent (a pid reused since), alike.
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        for pid in (sleeper.pid, 0, 2**22 + 1):
            (agent.state_dir / "status.json").write_text(json.dumps({"pid": pid}))
            assert flashnode("status", *state).returncode == 3, pid
    finally:
        sleeper.kill()
        sleeper.wait()


# --- row: `pools join` with a trailing comment, or a string -----------------------------------


def config(tmp_path: Path, url: str, text: str, mode: int = 0o640) -> Path:
    path = tmp_path / "flashnode.toml"
    path.write_text(f'# my node\ncoordinator = "{url}"\n{text}')
    path.chmod(mode)
    return path


def test_pools_join_and_leave_keep_the_file_as_written(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    url = "http://127.0.0.1:9"
    env = {"FLASHNODE_STATE_DIR": str(tmp_path / "state")}
    path = config(tmp_path, url, 'pools = ["my-team"]                    # my pools\nslots = 1\n')
    done = flashnode("pools", "join", "team-y", "--config", str(path), env=env)
    assert done.returncode == 0, done.stderr
    text = path.read_text()
    assert text == (
        f'# my node\ncoordinator = "{url}"\n'
        'pools = ["my-team", "team-y"]                    # my pools\nslots = 1\n'
    )
    assert path.stat().st_mode & 0o777 == 0o640
    listed = flashnode("pools", "list", "--config", str(path))
    assert listed.stdout.split() == ["my-team", "team-y"]
    assert load({}, {}, path).pools == ("my-team", "team-y")  # what `work` reads
    assert flashnode("pools", "leave", "my-team", "--config", str(path), env=env).returncode == 0
    assert load({}, {}, path).pools == ("team-y",)
    assert "# my pools" in path.read_text()

    as_string = config(tmp_path, url, 'pools = "a, b"  # comma-separated\n')
    assert flashnode("pools", "join", "c", "--config", str(as_string), env=env).returncode == 0
    assert 'pools = "a, b, c"  # comma-separated' in as_string.read_text()
    assert load({}, {}, as_string).pools == ("a", "b", "c")

    absent = config(tmp_path, url, '# pools = ["x"]\n')
    assert flashnode("pools", "join", "z", "--config", str(absent), env=env).returncode == 0
    assert load({}, {}, absent).pools == ("z",) and '# pools = ["x"]' in absent.read_text()


def test_pools_refuses_what_it_cannot_edit_and_what_work_would_refuse(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    url = "http://127.0.0.1:9"
    env = {"FLASHNODE_STATE_DIR": str(tmp_path / "state")}
    for text, reason in [
        ("pools = 5\n", "pools is not a list of pool ids"),
        # Leaving the last pool of a trusted node: `work` would exit 78 on the result.
        ('runner = "trusted"\npools = ["only"]\n', "flashnode work would refuse the result"),
    ]:
        path = config(tmp_path, url, text)
        before = path.read_bytes()
        done = flashnode("pools", "leave", "only", "--config", str(path), env=env)
        assert done.returncode == 1 and reason in done.stderr, done.stderr
        assert path.read_bytes() == before
        assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    bad = flashnode("pools", "join", "bad pool", "--config", str(path), env=env)
    assert bad.returncode == 1 and "not a valid pool id" in bad.stderr


# --- row: doctor --------------------------------------------------------------------------------


def doctor_lines(out: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line[:6] in ("ok    ", "warn  ", "FAIL  "):
            found.setdefault(line[:4].strip(), []).append(line[6:].split(":")[0])
    return found


def test_doctor_fails_where_work_would_be_refused_the_join_code(
    flashnode: Callable[..., Any],
    token_coordinator: TokenCoordinator,
    tmp_path: Path,
    drop_dir: Path,
) -> None:
    """A token but no join code: `work` exits 77, so doctor must FAIL (main said ok, rc 0)."""
    state = drop_dir / "state"  # where a task user can reach it
    env = {
        "FLASHNODE_COORDINATOR": token_coordinator.server.url,
        "FLASHNODE_TOKEN_FILE": str(token_coordinator.token_file),
        "FLASHNODE_RUNNER": "trusted",
        "FLASHNODE_POOLS": "team-a",
        "FLASHNODE_STATE_DIR": str(state),
        "FLASHNODE_CREDENTIALS_DIR": str(tmp_path / "none"),
    }
    if IS_ROOT:
        env["FLASHNODE_TASK_USER"] = TASK_USER
    done = flashnode("doctor", env=env)
    assert done.returncode == 1, done.stdout
    assert "FAIL  registration: refused" in done.stdout and "join code" in done.stdout
    assert "flashnode login" in done.stdout
    assert not state.exists()  # doctor makes nothing
    ok = flashnode("doctor", env={**env, "FLASHNODE_JOIN_CODE": token_coordinator.join_code})
    assert ok.returncode == 0, ok.stdout
    assert "ok    registration: dry run accepted, as node node-x" in ok.stdout


def agreement_cases() -> list[tuple[str, dict[str, str], int, str]]:
    cases = [
        ("docker, no allowed image", {"FLASHNODE_RUNNER": "docker"}, 78, "allowed images"),
    ]
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "info"], capture_output=True).returncode == 0
    ):
        cases.append(
            (
                "docker, engine not there",
                {
                    "FLASHNODE_RUNNER": "docker",
                    "FLASHNODE_ALLOWED_IMAGES": "busybox:1.36",
                    "FLASHNODE_DOCKER_HOST": "unix:///nonexistent/docker.sock",
                },
                69,
                "docker engine",
            )
        )
        cases.append(
            (
                "docker, no allowed image present and pulls off",
                {
                    "FLASHNODE_RUNNER": "docker",
                    "FLASHNODE_ALLOWED_IMAGES": f"flashnode-test-absent-{secrets.token_hex(4)}:1",
                },
                78,
                "allowed images",
            )
        )
    if IS_ROOT:
        trusted = {"FLASHNODE_RUNNER": "trusted", "FLASHNODE_POOLS": "team-a"}
        cases += [
            ("root without task_user", trusted, 78, "task user"),
            (
                "task_user that does not exist",
                {**trusted, "FLASHNODE_TASK_USER": "flashnode-no-such-user"},
                78,
                "task user",
            ),
            (
                "task_user root",
                {**trusted, "FLASHNODE_TASK_USER": "root"},
                78,
                "task user",
            ),
        ]
    return cases


@pytest.mark.parametrize(
    ("env", "code", "what"),
    [pytest.param(env, code, what, id=name) for name, env, code, what in agreement_cases()],
)
def test_doctor_and_work_agree(
    flashnode: Callable[..., Any],
    coordinator: CoordinatorServer,
    tmp_path: Path,
    env: dict[str, str],
    code: int,
    what: str,
) -> None:
    env = {
        "FLASHNODE_COORDINATOR": coordinator.url,
        "FLASHNODE_STATE_DIR": str(tmp_path / "state"),
        **env,
    }
    doctor = flashnode("doctor", env=env)
    lines = doctor_lines(doctor.stdout)
    assert doctor.returncode == 1 and what in lines.get("FAIL", []), doctor.stdout
    assert not set(lines.get("FAIL", [])) & set(lines.get("ok", [])), doctor.stdout
    failed = next(x for x in doctor.stdout.splitlines() if x.startswith(f"FAIL  {what}:"))
    why = failed.split(": ", 1)[1]
    work = flashnode("work", env=env)
    assert work.returncode == code, work.stderr
    assert why in work.stderr and work.stderr.count("\n") == 1, work.stderr
    assert not (tmp_path / "state").exists()  # neither made anything


def test_doctor_shows_every_problem_of_the_docker_runner_at_once_each_with_its_fix(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    env = {
        "FLASHNODE_COORDINATOR": "http://127.0.0.1:9",
        "FLASHNODE_STATE_DIR": str(tmp_path / "state"),
        "FLASHNODE_RUNNER": "docker",
        "FLASHNODE_ALLOWED_IMAGES": "busybox,alpine:latest,busybox:1.36",
    }
    # Every image that is not pinned, in the one line of the refused setting.
    doctor = flashnode("doctor", env=env)
    assert doctor.returncode == 1, doctor.stdout
    said = next(x for x in doctor.stdout.splitlines() if x.startswith("FAIL  configuration"))
    assert "'busybox' has no tag, 'alpine:latest' is not pinned" in said, said
    # No image allowed and no engine: both, each with its fix (was: the first, then the next).
    env.update(FLASHNODE_ALLOWED_IMAGES="", FLASHNODE_DOCKER_HOST="unix:///nonexistent/d.sock")
    doctor = flashnode("doctor", env=env)
    assert doctor.returncode == 1, doctor.stdout
    out = doctor.stdout.splitlines()
    failed = {line.split(":")[0]: out[i + 1] for i, line in enumerate(out) if "FAIL  " in line}
    assert {"FAIL  allowed images", "FAIL  docker engine"} <= set(failed), doctor.stdout
    assert failed["FAIL  allowed images"].startswith("      fix: list the images"), doctor.stdout
    assert failed["FAIL  docker engine"].startswith("      fix: start Docker"), doctor.stdout
    # work stops at the first, as before: doctor lists it first.
    work = flashnode("work", env=env)
    assert work.returncode == 78 and "allowed_images is empty" in work.stderr, work.stderr


# --- row: login -----------------------------------------------------------------------------


def test_login_refuses_what_is_not_a_url_and_stores_nothing(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    creds = tmp_path / "creds"
    for url in ("notaurl", "127.0.0.1:19101", "ftp://127.0.0.1"):
        done = flashnode(
            "login", "--coordinator", url, "--credentials-dir", str(creds), stdin="t\nj\n"
        )
        assert done.returncode == 78 and "not" in done.stderr and "URL" in done.stderr, url
    assert not creds.exists()


def test_login_never_replaces_good_credentials_with_refused_ones(
    flashnode: Callable[..., Any], token_coordinator: TokenCoordinator, tmp_path: Path
) -> None:
    server = token_coordinator.server
    creds = private_dir(tmp_path / "creds")
    args = ("login", "--coordinator", server.url, "--credentials-dir", str(creds))
    env = {"FLASHNODE_STATE_DIR": str(tmp_path / "state")}
    good = f"{token_coordinator.token}\n{token_coordinator.join_code}\n"
    done = flashnode(*args, env=env, stdin=good)
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr  # a piped secret: no GetPassWarning
    before = {p.name: p.read_text() for p in creds.iterdir()}
    for bad, code in [
        (f"tok-wrong\n{token_coordinator.join_code}\n", 77),
        (f"{token_coordinator.token}\nwrong-code\n", 77),
        (f"{token_coordinator.token}\n", 77),
        ("\n\n", 78),
    ]:
        refused = flashnode(*args, env=env, stdin=bad)
        assert refused.returncode == code, refused.stderr
        assert "nothing stored" in refused.stderr
        assert {p.name: p.read_text() for p in creds.iterdir()} == before
    # A coordinator that does not answer: 69, nothing stored either.
    gone = flashnode(
        "login",
        "--coordinator",
        "http://127.0.0.1:9",
        "--credentials-dir",
        str(creds),
        env=env,
        stdin=good,
    )
    assert gone.returncode == 69 and "did not answer" in gone.stderr
    assert {p.name: p.read_text() for p in creds.iterdir()} == before


def test_login_beside_a_running_agent_says_it_keeps_its_credentials_until_restarted(
    flashnode: Callable[..., Any],
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    tmp_path: Path,
) -> None:
    creds = private_dir(tmp_path / "creds")
    agent = start_agent(
        coordinator.url,
        "--runner",
        "trusted",
        "--pool",
        "team-a",
        env={"FLASHNODE_CREDENTIALS_DIR": str(creds)},
    )
    wait_for("the agent's status", lambda: (agent.state_dir / "status.json").exists())
    args = ("login", "--coordinator", coordinator.url, "--credentials-dir", str(creds))
    env = {"FLASHNODE_STATE_DIR": str(agent.state_dir)}
    done = flashnode(*args, env=env, stdin="tok\ncode\n")
    assert done.returncode == 0, done.stderr
    assert agent.proc is not None
    said = f"the running agent (pid {agent.proc.pid}) keeps the credentials it started with"
    assert said in done.stdout and "restart" in done.stdout, done.stdout
    # One thing, and true: the agent is not told to reload (it would refuse new credentials).
    assert "told the running agent" not in done.stdout, done.stdout
    alone = flashnode(*args, env={"FLASHNODE_STATE_DIR": str(tmp_path / "idle")}, stdin="t\nc\n")
    assert alone.returncode == 0, alone.stderr
    assert "the agent reads them when it starts" in alone.stdout, alone.stdout


def test_login_refuses_a_directory_others_can_use_and_secrets_as_flags(
    flashnode: Callable[..., Any], coordinator: CoordinatorServer, tmp_path: Path
) -> None:
    creds = tmp_path / "creds"
    creds.mkdir(mode=0o700)
    creds.chmod(0o777)
    env = {"FLASHNODE_STATE_DIR": str(tmp_path / "state")}
    done = flashnode(
        "login",
        "--coordinator",
        coordinator.url,
        "--credentials-dir",
        str(creds),
        env=env,
        stdin="anything\n",
    )
    assert done.returncode == 78 and "chmod 700" in done.stderr, done.stderr
    assert list(creds.iterdir()) == []
    flag = flashnode("login", "--coordinator", coordinator.url, "--token", "s3cret")
    assert flag.returncode == 2  # no such option: secrets are never flags


def test_a_bad_command_line_is_one_line_naming_what_and_the_fix_with_exit_2(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    state = ("--state-dir", str(tmp_path))
    for args, named in [
        (("pause", "--for", "2x", *state), "--for"),
        (("logs", "bad!id", *state), "LEASE"),
        (("login", "--token", "s3cret"), "--token"),
        (("pause", "--no", *state), "--now"),
        (("nosuch",), "nosuch"),
    ]:
        done = flashnode(*args)
        assert done.returncode == 2, (args, done.stderr)
        [line] = done.stderr.splitlines()
        assert line.startswith("flashnode: ") and named in line, line
        assert f"see flashnode {args[0] if args[0] != 'nosuch' else ''}".strip() in line, line
        assert line.endswith("--help") and "Error" not in line and "Usage" not in line, line
    # Click's other errors too: one line of ours, their own exit code.
    gone = flashnode("logs", "ls-none", *state)
    assert gone.returncode == 1 and gone.stderr.startswith("flashnode: no output of attempt")
    assert "Error" not in gone.stderr


def test_logout_of_nothing_fails_and_logout_forgets_both(
    flashnode: Callable[..., Any], coordinator: CoordinatorServer, tmp_path: Path
) -> None:
    creds = private_dir(tmp_path / "creds")
    args = ("--coordinator", coordinator.url, "--credentials-dir", str(creds))
    nothing = flashnode("logout", *args)
    assert nothing.returncode == 1 and "no credentials stored" in nothing.stderr
    env = {"FLASHNODE_STATE_DIR": str(tmp_path / "state")}
    # An open coordinator accepts any join code: a token-less login is fine there.
    assert flashnode("login", *args, env=env, stdin="tok\ncode\n").returncode == 0
    assert len(list(creds.iterdir())) == 2
    done = flashnode("logout", *args)
    assert done.returncode == 0 and list(creds.iterdir()) == []


# --- row: errors: a URL that is not a coordinator ---------------------------------------------


@pytest.fixture
def html_server() -> Iterator[str]:
    """Answers everything with an HTML page, as a web server that is not a coordinator does."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _page(self) -> None:
            body = (
                b"<!DOCTYPE html>\n<html>\n<head><title>404</title></head>\n<body>\n"
                + (b"<p>not here</p>\n" * 10)
                + b"</body>\n</html>\n"
            )
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _page

        def log_message(self, *args: object) -> None:
            pass

    server = LocalHTTPServer(("127.0.0.1", 0), Handler).start()
    yield server.url
    server.close()


def test_a_url_that_is_not_a_coordinator_is_one_line_without_html(
    flashnode: Callable[..., Any],
    html_server: str,
    start_agent: Callable[..., AgentProcess],
    tmp_path: Path,
) -> None:
    env = {
        "FLASHNODE_RUNNER": "trusted",
        "FLASHNODE_POOLS": "team-a",
        "FLASHNODE_STATE_DIR": str(tmp_path / "state"),
    }
    if IS_ROOT:
        env["FLASHNODE_TASK_USER"] = TASK_USER
    doctor = flashnode("doctor", "--coordinator", html_server, env=env)
    assert doctor.returncode == 1
    assert "<" not in doctor.stdout, doctor.stdout
    assert "does not answer as a flashruntime coordinator" in doctor.stdout
    agent = start_agent(html_server, "--runner", "trusted", "--pool", "team-a")
    agent.wait_log("registration")
    assert "<" not in agent.log and "an HTML page" in agent.log, agent.log
    login = flashnode(
        "login",
        "--coordinator",
        html_server,
        "--credentials-dir",
        str(tmp_path / "c"),
        env=env,
        stdin="t\nj\n",
    )
    assert login.returncode == 78 and "<" not in login.stderr, login.stderr


@pytest.fixture
def file_server(tmp_path: Path) -> Iterator[str]:
    """A plain static web server (`python3 -m http.server`): 404 to GETs it has no file for,
    501 to every POST."""
    served = tmp_path / "site"
    served.mkdir()
    (served / "index.html").write_text("<html><body>hello</body></html>\n")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    server = LocalHTTPServer(("127.0.0.1", 0), handler).start()
    yield server.url
    server.close()


def test_login_to_a_web_server_or_the_console_says_it_is_no_coordinator_and_names_it(
    flashnode: Callable[..., Any],
    coordinator: CoordinatorServer,
    file_server: str,
    start_agent: Callable[..., AgentProcess],
    tmp_path: Path,
) -> None:
    console = start_console_agent(start_agent, coordinator.url, tmp_path)
    creds = private_dir(tmp_path / "creds")
    env = {"FLASHNODE_STATE_DIR": str(tmp_path / "login-state")}
    for url, answered in (
        (console.base, "Server: flashnode (a flashnode agent's console)"),
        (file_server, "Server: SimpleHTTP"),
    ):
        done = flashnode(
            "login", "--coordinator", url, "--credentials-dir", str(creds), env=env, stdin="t\nj\n"
        )
        assert done.returncode == 78, done.stderr
        assert "is not a flashruntime coordinator" in done.stderr, done.stderr
        assert answered in done.stderr and "nothing stored" in done.stderr, done.stderr
        assert "refused" not in done.stderr and "did not answer" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "<" not in done.stderr
    assert list(creds.iterdir()) == []


# --- row: docker runner that can run nothing ---------------------------------------------------


def test_a_docker_runner_that_can_run_nothing_refuses_to_start(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    base = {"FLASHNODE_STATE_DIR": str(tmp_path / "s"), "FLASHNODE_RUNNER": "docker"}
    url = ("--coordinator", "http://127.0.0.1:9")
    for images, text in [
        ("", "allowed_images is empty"),
        ("python:latest", "'python:latest' is not pinned"),
        ("python", "'python' has no tag"),
    ]:
        done = flashnode("work", *url, env={**base, "FLASHNODE_ALLOWED_IMAGES": images})
        assert done.returncode == 78 and text in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1
    if (
        shutil.which("docker") is None
        or subprocess.run(["docker", "info"], capture_output=True).returncode != 0
    ):
        pytest.skip("no Docker engine for the absent-image case")
    absent = f"flashnode-test-absent-{secrets.token_hex(4)}:1"
    done = flashnode("work", *url, env={**base, "FLASHNODE_ALLOWED_IMAGES": absent})
    assert done.returncode == 78 and f"docker pull {absent}" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1


# --- row: help ------------------------------------------------------------------------------


def test_every_command_and_option_has_help(flashnode: Callable[..., Any]) -> None:
    missing = []

    def walk(command: click.Command, path: str) -> None:
        if not (command.help or command.short_help):
            missing.append(path)
        for param in command.params:
            if isinstance(param, click.Option) and not param.help and param.name != "version":
                missing.append(f"{path} {param.opts[0]}")
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}")

    walk(main, "flashnode")
    assert missing == []
    work = flashnode("work", "--help").stdout
    assert "--task-user" in work
    assert "--coordinator" in flashnode("doctor", "--help").stdout


@pytest.mark.usefixtures("as_root")
def test_the_task_user_flag_reaches_the_settings(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    done = flashnode(
        "work",
        "--coordinator",
        "http://127.0.0.1:9",
        "--runner",
        "trusted",
        "--pool",
        "p",
        "--state-dir",
        str(tmp_path / "s"),
        "--task-user",
        "flashnode-no-such-user",
    )
    assert done.returncode == 78
    assert "'flashnode-no-such-user-0' (for slot 0) does not exist" in done.stderr


# --- row: demo --------------------------------------------------------------------------------


def test_the_demo_cleans_up_after_itself() -> None:
    # Its own temporary directory (searchable, so that a task user reaches the state dir
    # below it): whatever the demo leaves there is a leak. Other tests share /tmp.
    scratch = Path(tempfile.mkdtemp(prefix="flashnode-demo-test-"))
    scratch.chmod(0o755)
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "demo.py")],
            capture_output=True,
            text=True,
            timeout=300,
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")},
                "TMPDIR": str(scratch),
            },
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCEEDED" in done.stdout
        assert list(scratch.iterdir()) == []
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# --- what a new owner met following the owner's manual (the walkthrough) -----------------------


@pytest.mark.usefixtures("as_root")
def test_a_member_of_group_flashnode_sees_the_status_without_flags(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """status.json and the ledger are 0640 root:flashnode in a 0711 state dir: a group member
    reads `status` and `history` (what the console's view-only level shows her)."""
    job = coordinator.submit(argv_job(["sh", "-c", "echo '{}' > metrics.json"]))
    agent = start_agent(coordinator.url, "--runner", "trusted", "--pool", "team-a", env=FAST)
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED"
    agent.wait_ledger()
    gid = int(
        subprocess.run(
            ["getent", "group", "flashnode"], capture_output=True, text=True
        ).stdout.split(":")[2]
    )
    site = next(p for p in sys.path if p.endswith("site-packages"))
    env = {"PYTHONPATH": f"{ROOT}:{site}", "HOME": "/nonexistent", "PATH": "/usr/bin:/bin"}
    member = ["setpriv", "--reuid=65534", f"--regid={gid}", f"--groups={gid}", "--"]
    python = "/usr/bin/python3"
    probe = subprocess.run([*member, python, "-c", "import flashnode, pydantic_core"], env=env)
    if probe.returncode != 0:
        pytest.skip(f"{python} cannot import this checkout as an unprivileged user")
    state = ["--state-dir", str(agent.state_dir)]
    shown = subprocess.run(
        [*member, python, "-m", "flashnode", "status", *state],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "node " in shown.stdout and "no agent is running" not in shown.stdout
    history = subprocess.run(
        [*member, python, "-m", "flashnode", "history", *state],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert history.returncode == 0, history.stderr
    header, row = history.stdout.splitlines()
    assert "outcome" in header and "committed" in row.split()


def test_a_misspelt_environment_setting_is_refused_with_a_suggestion(
    flashnode: Callable[..., Any], tmp_path: Path
) -> None:
    done = flashnode(
        "work",
        "--coordinator",
        "http://127.0.0.1:9",
        "--state-dir",
        str(tmp_path / "s"),
        env={"FLASHNODE_TASK_USR": "x"},
    )
    assert done.returncode == 78
    assert "FLASHNODE_TASK_USR" in done.stderr and "FLASHNODE_TASK_USER" in done.stderr


def test_doctor_shows_slots_and_limits_and_warns_of_limits_the_machine_lacks(
    flashnode: Callable[..., Any], coordinator: CoordinatorServer, tmp_path: Path
) -> None:
    config = tmp_path / "flashnode.toml"
    config.write_text(
        f'coordinator = "{coordinator.url}"\nrunner = "trusted"\npools = ["p"]\n'
        'task_memory_bytes = "100T"\ntask_cpus = 4096\nallow_same_user = true\n'
        + (f'task_user = "{TASK_USER}"\n' if IS_ROOT else "")
    )
    done = flashnode("doctor", "--config", str(config), "--state-dir", str(tmp_path / "state"))
    assert "1 slot(s); per task 100 TiB memory, 4096 CPU(s), 4096 pids" in done.stdout, done.stdout
    assert "warn  task memory: task_memory_bytes (100 TiB) is more than this machine" in done.stdout
    assert "warn  task cpus: task_cpus (4096) is more than this machine's" in done.stdout
    # A runner's option at the top level (as before 0.5): read, and the doctor says where it goes.
    assert (
        f"warn  configuration: allow_same_user at the top level of {config} is read for this"
        " release only (fix: move it into the [trusted] table" in done.stdout
    )
