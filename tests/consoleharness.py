"""A real agent serving its console, and ways in: a login link from the real ``flashnode ui``,
an httpx client holding a session, the page's CSRF token."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from harness import AgentProcess, free_port, wait_for

from flashnode.console import auth

CONFIG = """# the owner's config: comments stay
pools = ["team-a"]  # the team this machine serves
run_windows = []  # any time
"""


class Session(httpx.Client):
    """A client already used to log in, still usable as a context manager."""

    def __enter__(self) -> Session:
        return self


@dataclass
class ConsoleAgent:
    agent: AgentProcess
    port: int
    config: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def ui(self, *args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
        """``flashnode ui`` on this agent's state dir (as ``user`` with setpriv when given)."""
        command = [
            sys.executable,
            "-m",
            "flashnode",
            "ui",
            "--state-dir",
            str(self.agent.state_dir),
        ]
        if user is not None:
            command = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *command]
        return subprocess.run(
            [*command, *args], capture_output=True, text=True, timeout=60, cwd="/"
        )

    def link(self) -> str:
        done = self.ui("--print-url")
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def minted(self, level: auth.Level, now: float | None = None, seconds: float = 600) -> str:
        """A login path made from the agent's key file directly (as ``flashnode ui`` does)."""
        data = json.loads((self.agent.state_dir / auth.KEY_FILES[level]).read_text())
        token = auth.mint(level, bytes.fromhex(data["key"]), now or time.time(), seconds)
        return f"/login?token={token}"

    def session(self, level: auth.Level = "owner") -> tuple[httpx.Client, str]:
        """A client logged in at ``level``, and its CSRF token."""
        client = Session(base_url=self.base, timeout=30)
        path = self.link().split(self.host, 1)[1] if level == "owner" else self.minted(level)
        r = client.get(path)
        assert r.status_code == 303, r.text
        csrf = client.get("/api/session").json()["csrf"]
        return client, csrf

    def post(self, client: httpx.Client, csrf: str, path: str, body: object) -> httpx.Response:
        """A change as the console's own page sends it."""
        return client.post(path, json=body, headers={"Origin": self.base, auth.CSRF_HEADER: csrf})

    def wait_console(self) -> None:
        self.agent.wait_log("console served at", 60)
        wait_for(
            "the agent's first status", lambda: (self.agent.state_dir / "status.json").exists()
        )


def start_console_agent(  # type: ignore[no-untyped-def]
    start_agent, url: str, tmp_path: Path, *args: str, state_dir: Path | None = None
) -> ConsoleAgent:
    """``state_dir``: an earlier agent's, to start again on (its config file is kept)."""
    port = free_port()
    config = tmp_path / "flashnode.toml"
    if not config.exists():
        config.write_text(CONFIG)
    agent = start_agent(
        url,
        "--runner",
        "trusted",
        "--config",
        str(config),
        *args,
        env={"FLASHNODE_UI_LISTEN": f"127.0.0.1:{port}"},
        state_dir=state_dir,
    )
    console = ConsoleAgent(agent, port, config)
    console.wait_console()
    return console
