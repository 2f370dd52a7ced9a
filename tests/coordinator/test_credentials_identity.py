"""Stored credentials are found by the coordinator's identity, not its spelling: logged
in as `http://127.0.0.1:PORT`, an agent configured with `http://localhost:PORT` uses them; where
none apply, doctor says which are stored and why they do not."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import TokenCoordinator
from harness import AgentProcess, argv_job

from flashnode.config.credentials import credentials_names, stored_credential
from flashnode.config.loading import load

FAST = {"FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"}


def test_localhost_and_127_0_0_1_and_a_default_port_are_one_coordinator(tmp_path: Path) -> None:
    assert credentials_names("http://localhost:27820")[0] == "localhost_27820"
    assert set(credentials_names("http://localhost:27820")) == set(
        credentials_names("http://127.0.0.1:27820/")
    )
    assert credentials_names("https://Coord.Example.org.") == ["coord.example.org_443"]
    assert credentials_names("https://coord.example.org:443") == ["coord.example.org_443"]
    # A name that merely resolves to the same address is not the same coordinator.
    assert credentials_names("http://coord.example.org:27820") == ["coord.example.org_27820"]
    creds = tmp_path / "creds"
    creds.mkdir(mode=0o700)
    (creds / "127.0.0.1_27820.token").write_text("t\n")
    found = stored_credential("http://localhost:27820", "token", creds, {})
    assert found == creds / "127.0.0.1_27820.token"
    # Its own name comes first where both are stored.
    (creds / "localhost_27820.token").write_text("t2\n")
    assert stored_credential("http://localhost:27820", "token", creds, {}) == (
        creds / "localhost_27820.token"
    )


def test_logged_in_as_127_0_0_1_an_agent_configured_as_localhost_uses_the_credentials(
    flashnode: Callable[..., Any],
    token_coordinator: TokenCoordinator,
    start_agent: Callable[..., AgentProcess],
    tmp_path: Path,
) -> None:
    server = token_coordinator.server
    assert server.url.startswith("http://127.0.0.1:")
    localhost = server.url.replace("127.0.0.1", "localhost")
    creds = tmp_path / "creds"
    creds.mkdir(mode=0o700)
    done = flashnode(
        "login",
        "--coordinator",
        server.url,
        "--credentials-dir",
        str(creds),
        env={"FLASHNODE_STATE_DIR": str(tmp_path / "login-state")},
        stdin=f"{token_coordinator.token}\n{token_coordinator.join_code}\n",
    )
    assert done.returncode == 0, done.stderr
    env = {"FLASHNODE_CREDENTIALS_DIR": str(creds)}
    settings = load({"coordinator": localhost}, env)
    assert settings.token is not None and settings.join_code is not None
    doctor = flashnode(
        "doctor",
        "--coordinator",
        localhost,
        "--state-dir",
        str(tmp_path / "doctor-state"),
        env={**env, "FLASHNODE_RUNNER": "trusted", "FLASHNODE_POOLS": "team-a"},
    )
    assert "ok    credentials: token, join code" in doctor.stdout, doctor.stdout
    assert "ok    registration: dry run accepted" in doctor.stdout, doctor.stdout
    job = server.submit(argv_job(["sh", "-c", "echo '{}' > metrics.json"]))
    agent = start_agent(localhost, "--runner", "trusted", "--pool", "team-a", env={**FAST, **env})
    assert server.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    # Logging out as localhost forgets what was stored as 127.0.0.1.
    out = flashnode("logout", "--coordinator", localhost, "--credentials-dir", str(creds))
    assert out.returncode == 0 and sorted(os.listdir(creds)) == [], out.stdout + out.stderr


def test_doctor_says_which_stored_credentials_exist_and_why_they_do_not_apply(
    flashnode: Callable[..., Any],
    tmp_path: Path,
) -> None:
    creds = tmp_path / "creds"
    creds.mkdir(mode=0o700)
    for name in ("coord.example.org_443.token", "coord.example.org_443.join-code"):
        (creds / name).write_text("x\n")
        (creds / name).chmod(0o600)
    done = flashnode(
        "doctor",
        "--coordinator",
        "https://other.example.org",
        "--state-dir",
        str(tmp_path / "state"),
        env={"FLASHNODE_CREDENTIALS_DIR": str(creds)},
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("warn  credentials"))
    assert "none for https://other.example.org:443" in line
    assert "looked for other.example.org_443.token" in line
    assert (
        "coord.example.org_443.token (for coord.example.org port 443: another coordinator)" in line
    )
    assert "an open coordinator" not in done.stdout
