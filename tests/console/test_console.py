"""The owner's console over HTTP: who gets in (login links, sessions, levels), which requests
are refused (no session, a foreign Host, another origin, no CSRF token), what a change writes,
and what it shows, against a real agent and a real coordinator. The page itself runs in a real
browser in test_console_browser.py."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from consoleharness import CONFIG, ConsoleAgent, start_console_agent
from harness import AgentProcess, CoordinatorServer, argv_job, free_port, wait_for

from flashnode.config.loading import load
from flashnode.console import auth
from flashnode.errors import ConfigError
from flashnode.owner.ledgerview import LedgerView

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "flashnode" / "console" / "static"
API_GETS = ("/api/session", "/api/state", "/api/charts", "/api/history", "/api/coordinator")
API_POSTS = ("/api/pause", "/api/resume", "/api/settings", "/api/pools", "/api/logout")


@pytest.fixture
def console(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> ConsoleAgent:
    return start_console_agent(start_agent, coordinator.url, tmp_path)


# --- settings ------------------------------------------------------------------------------


def test_ui_listen_defaults_to_loopback_and_refuses_the_network_unless_allowed(
    tmp_path: Path,
) -> None:
    base = {"coordinator": "http://127.0.0.1:1", "state_dir": str(tmp_path)}
    assert load(base, {}).ui_listen == "127.0.0.1:7469"
    assert load({**base}, {"FLASHNODE_UI_LISTEN": "off"}).ui_listen is None
    config = tmp_path / "c.toml"
    config.write_text('ui_listen = ""\n')
    assert load(base, {}, config).ui_listen is None
    config.write_text('ui_listen = "0.0.0.0:7469"\n')
    with pytest.raises(ConfigError, match="ui_allow_remote"):
        load(base, {}, config)
    config.write_text('ui_listen = "0.0.0.0:7469"\nui_allow_remote = true\n')
    assert load(base, {}, config).ui_listen == "0.0.0.0:7469"
    config.write_text('ui_listen = "unix:/run/x.sock"\n')
    with pytest.raises(ConfigError, match="not on a unix socket"):
        load(base, {}, config)


# --- login links ---------------------------------------------------------------------------


def test_a_login_token_is_bound_to_its_level_key_and_expiry() -> None:
    keys: dict[auth.Level, bytes] = {"owner": b"o" * 32, "view": b"v" * 32}
    now = 1_000_000.0
    owner = auth.mint("owner", keys["owner"], now)
    assert auth.redeem(keys, owner, now) == "owner"
    assert auth.redeem(keys, owner, now + 601) is None  # expired
    assert auth.redeem(keys, owner.replace("owner.", "view.", 1), now) is None  # level swapped
    assert auth.redeem(keys, auth.mint("owner", keys["view"], now), now) is None  # wrong key
    assert auth.redeem(keys, auth.mint("owner", keys["owner"], now, 86400), now) is None  # too long
    parts = owner.split(".")
    parts[1] = str(int(parts[1]) + 100)  # a later expiry, same mac
    assert auth.redeem(keys, ".".join(parts), now) is None
    for junk in ("", "owner", "a.b.c.d", "owner.x.y.z", "." * 300):
        assert auth.redeem(keys, junk, now) is None


def test_a_login_link_works_once_and_never_when_expired_or_altered(console: ConsoleAgent) -> None:
    link = console.link()
    assert re.fullmatch(rf"http://127\.0\.0\.1:{console.port}/login\?token=owner\.\S+", link)
    path = link.split(console.host, 1)[1]
    with httpx.Client(base_url=console.base) as first:
        r = first.get(path)
        assert r.status_code == 303 and r.headers["location"] == "/"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
        assert first.get("/api/state").status_code == 200
    with httpx.Client(base_url=console.base) as again:
        r = again.get(path)
        assert r.status_code == 403 and "set-cookie" not in r.headers
        assert again.get("/api/state").status_code == 401
        expired = console.minted("owner", now=time.time() - 700)
        assert again.get(expired).status_code == 403
        altered = path[:-4] + ("0000" if not path.endswith("0000") else "1111")
        assert again.get(altered).status_code == 403
        assert again.get("/api/state").status_code == 401


def test_a_task_user_gets_no_login_link(console: ConsoleAgent) -> None:
    """A task user (not root, not in group flashnode) can read neither key file."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as a task user")
    done = console.ui("--print-url", user="flashnode-task-0")
    assert done.returncode != 0
    assert "token=" not in done.stdout + done.stderr
    assert "run it with sudo" in done.stderr or "sudo flashnode ui" in done.stderr
    owner = console.agent.state_dir / auth.KEY_FILES["owner"]
    assert owner.stat().st_mode & 0o777 == 0o600
    assert (console.agent.state_dir / auth.KEY_FILES["view"]).stat().st_mode & 0o777 == 0o640


def test_a_task_holding_the_owners_cookie_still_gets_nothing(console: ConsoleAgent) -> None:
    """A trusted task shares the host's network, and a browser sends a host's cookies to every
    port of it: a task listening on 127.0.0.1 could collect the owner's session cookie. Its
    requests come from a task user's uid, and those are not answered."""
    if (
        os.geteuid() != 0
        or shutil.which("setpriv") is None
        or not Path("/usr/bin/python3").exists()
    ):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to act as a task user")
    client, csrf = console.session()
    cookie = f"{auth.cookie_name(console.port)}={client.cookies[auth.cookie_name(console.port)]}"
    steal = (
        "import urllib.request, urllib.error, sys\n"
        f"req = urllib.request.Request('{console.base}' + sys.argv[1], headers={{"
        f"'Cookie': '{cookie}', 'Origin': '{console.base}', '{auth.CSRF_HEADER}': '{csrf}',"
        "'Content-Type': 'application/json'}, data=sys.argv[2].encode() or None)\n"
        "try:\n    print(urllib.request.urlopen(req).status)\n"
        "except urllib.error.HTTPError as e:\n    print(e.code)\n"
        "except Exception:\n    print('closed')\n"
    )

    def as_task(path: str, body: str = "") -> str:
        done = subprocess.run(
            [
                "setpriv",
                "--reuid=flashnode-task-0",
                "--regid=flashnode-task-0",
                "--clear-groups",
                "/usr/bin/python3",
                "-c",
                steal,
                path,
                body,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            cwd="/",
        )
        return done.stdout.strip() + done.stderr

    assert as_task("/api/state") == "closed"  # closed unanswered, before anything was read
    assert as_task("/api/pause", '{"mode": "now"}') == "closed"
    assert not (console.agent.state_dir / "pause.json").exists()
    with client:
        assert client.get("/api/state").status_code == 200  # the owner's own browser: answered


def test_a_view_login_may_look_but_changes_nothing(console: ConsoleAgent) -> None:
    client, csrf = console.session("view")
    with client:
        assert client.get("/api/session").json()["level"] == "view"
        assert client.get("/api/state").json()["agent"]["node_id"]
        r = console.post(client, csrf, "/api/pause", {"mode": "now"})
        assert r.status_code == 403 and "sudo flashnode ui" in r.json()["error"]
        assert console.post(client, csrf, "/api/logout", {}).status_code == 200
        assert client.get("/api/state").status_code == 401
    assert not (console.agent.state_dir / "pause.json").exists()


def test_a_view_login_gets_nothing_a_task_printed_from_any_endpoint(
    console: ConsoleAgent, coordinator: CoordinatorServer
) -> None:
    """The attack: a member of group flashnode, at the view-only level, asks every endpoint it
    may for what tasks printed. `flashnode logs` refuses that user (logs/ is root's, 0700), so
    the console gives it none either: not a running task's lines, not an ended one's kept
    output, not the last line the status text carries, not the stderr a failure's reason
    quotes. The owner's level still sees all of it (a failure's stderr lines in its kept
    output: the ledger, which group flashnode reads too, keeps its reason without them)."""
    tag = secrets.token_hex(6)
    marker = f"mark-42-{tag}"  # printed; the job's own command holds only its parts
    say = f'x=$((40 + 2)); echo "mark-$x-{tag} out"; echo "mark-$x-{tag} err" >&2'
    failed = coordinator.submit(argv_job(["sh", "-c", f"{say}; exit 3"], max_attempts=1))
    owner, _ = console.session()
    viewer, _ = console.session("view")
    with owner, viewer:
        row = wait_for(
            "the failed attempt's kept output",
            lambda: next(
                (
                    r
                    for r in owner.get("/api/history").json()
                    if r["job_id"] == failed and marker in str(r["output"])
                ),
                None,
            ),
        )
        lease = row["lease_id"]
        assert row["reason"] == f"exit code 3 (the task's last lines: flashnode logs {lease}, while kept)"
        running = coordinator.submit(argv_job(["sh", "-c", f"{say}; sleep 600"]))
        state = wait_for(
            "the running task's lines",
            lambda: (
                (s := owner.get("/api/state").json())["running"]
                and marker in str(s["running"][0]["output"])
                and s
            ),
        )
        owners_view = wait_for(
            "the coordinator's view of the failure",
            lambda: (v := owner.get("/api/coordinator").json()).get("lowered_by") and v,
        )
        assert owners_view["lowered_by"][0]["reason"].startswith("exit code 3 ")
        wait_for(
            "the viewer's view of the coordinator",
            lambda: viewer.get("/api/coordinator").json().get("lowered_by"),
        )
        paths = [
            *API_GETS,
            "/api/charts?span=day",
            "/api/charts?span=week",
            "/api/history?outcome=failed&limit=500",
            "/api/history?limit=500",
            f"/api/jobs?ids={failed},{running}",
            "/api/logs",
            f"/api/logs?lease={state['running'][0]['lease_id']}",
            "/",
            "/console.js",
        ]
        answers = {path: viewer.get(path) for path in paths}
        leaked = [path for path, r in answers.items() if marker in r.text]
        assert not leaked, f"a view-only login read what a task printed from {leaked}"
        seen = wait_for(  # the task as the viewer sees it (one answer of the page's polling)
            "the running task in the viewer's state",
            lambda: (s := viewer.get("/api/state").json())["running"] and s,
        )
        assert marker not in json.dumps(seen)
        assert seen["running"][0]["job_id"] == running  # it does see the task, not its lines
        assert seen["running"][0]["output"] is None and seen["running"][0]["output_hidden"]
        rows = [r for r in answers["/api/history"].json() if r["job_id"] == failed]
        assert rows and rows[0]["output"] is None and rows[0]["output_hidden"] is True
        assert rows[0]["reason"].startswith("exit code 3")  # how it ended, as history says
        # The owner's level: all of it. (Asked until it shows: twice in CI a state here showed
        # the job's task without its lines, or none, as if its attempt had been replaced; not
        # reproduced, under load or not.)
        mine = wait_for(
            "the running task's lines at the owner's level",
            lambda: next(
                (
                    r
                    for r in owner.get("/api/state").json()["running"]
                    if r["job_id"] == running and marker in str(r["output"])
                ),
                None,
            ),
        )
        assert mine["output_hidden"] is False
        assert marker in owner.get("/api/history").text


# --- requests that get nothing -------------------------------------------------------------


def test_without_a_session_no_data_is_given_and_nothing_changes(console: ConsoleAgent) -> None:
    node_id = wait_for(
        "the node to register",
        lambda: json.loads((console.agent.state_dir / "status.json").read_text())["node_id"],
    )
    with httpx.Client(base_url=console.base) as client:
        for path in API_GETS:
            r = client.get(path)
            assert r.status_code == 401, path
            assert list(r.json()) == ["error"] and node_id not in r.text
        for path in API_POSTS:
            r = client.post(path, json={"mode": "now"}, headers={"Origin": console.base})
            assert r.status_code == 401, path
        bogus = {"Cookie": f"{auth.cookie_name(console.port)}=forged"}
        assert client.get("/api/state", headers=bogus).status_code == 401
        page = client.get("/")  # the page itself holds no data: it asks for it
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert not (console.agent.state_dir / "pause.json").exists()


def test_a_foreign_host_is_refused_even_with_a_session(console: ConsoleAgent) -> None:
    """DNS rebinding: a page of evil.example whose name now points at 127.0.0.1 reaches the
    console with its own name in Host."""
    client, csrf = console.session()
    with client:
        for host in (f"evil.example:{console.port}", "127.0.0.1", f"127.0.0.1:{console.port + 1}"):
            headers = {"Host": host}
            assert client.get("/api/state", headers=headers).status_code == 421
            assert client.get("/", headers=headers).status_code == 421
            r = client.post(
                "/api/pause",
                json={"mode": "now"},
                headers={**headers, "Origin": f"http://{host}", auth.CSRF_HEADER: csrf},
            )
            assert r.status_code == 421
        link = console.link().split(console.host, 1)[1]
        assert client.get(link, headers={"Host": "evil.example"}).status_code == 421
        for name in ("localhost", "[::1]"):  # this machine's own names for its loopback
            assert client.get("/api/state", headers={"Host": f"{name}:{console.port}"}).is_success
    assert not (console.agent.state_dir / "pause.json").exists()


def test_a_change_from_another_origin_or_without_its_csrf_token_is_refused(
    console: ConsoleAgent,
) -> None:
    client, csrf = console.session()
    good = {"Origin": console.base, auth.CSRF_HEADER: csrf}
    refused = [
        ({**good, "Origin": "http://evil.example"}, 403),
        ({**good, "Origin": "null"}, 403),
        ({auth.CSRF_HEADER: csrf}, 403),  # no Origin at all
        ({**good, "Sec-Fetch-Site": "cross-site"}, 403),
        ({**good, "Sec-Fetch-Site": "same-site"}, 403),  # another port of this machine
        ({"Origin": console.base}, 403),  # no CSRF token
        ({**good, auth.CSRF_HEADER: ("y" if csrf[0] == "x" else "x") + csrf[1:]}, 403),
    ]
    with client:
        for headers, code in refused:
            r = client.post("/api/pause", json={"mode": "now"}, headers=headers)
            assert r.status_code == code, headers
        r = client.post(
            "/api/pause", content=b'{"mode": "now"}', headers={**good, "Content-Type": "text/plain"}
        )
        assert r.status_code == 415  # a form or a no-preflight fetch cannot send JSON
        r = client.request("OPTIONS", "/api/pause", headers={"Origin": "http://evil.example"})
        assert r.status_code == 405
        for answer in (r, client.get("/api/state"), client.get("/")):
            assert not any(h.lower().startswith("access-control-") for h in answer.headers)
            assert answer.headers["x-frame-options"] == "DENY"
            assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
        assert not (console.agent.state_dir / "pause.json").exists()
        r = console.post(client, csrf, "/api/pause", {"mode": "drain", "for": "2h"})
        assert r.status_code == 200, r.text
    assert (console.agent.state_dir / "pause.json").exists()


def test_a_flood_of_idle_connections_holds_few_threads_and_the_console_still_answers(
    console: ConsoleAgent,
) -> None:
    """Connections that say nothing (a local program's, a task's) would each hold a thread for
    the read timeout: past MAX_CLIENTS they are closed unanswered."""
    from flashnode.console.server import MAX_CLIENTS

    def threads() -> int:
        status = Path(f"/proc/{console.agent.proc.pid}/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("Threads:")).split()[1])

    before = threads()
    idle = [socket.create_connection(("127.0.0.1", console.port)) for _ in range(60)]
    try:
        wait_for("the console to take the connections", lambda: threads() > before)
        deadline = time.monotonic() + 2  # watched a while: threads past the cap would show
        while time.monotonic() < deadline:
            assert threads() <= before + MAX_CLIENTS + 2
    finally:
        for s in idle:
            s.close()
    wait_for(
        "the console to answer again",
        lambda: httpx.get(console.base + "/api/state", timeout=5).status_code == 401,
        timeout=30,
    )


# --- what a change writes --------------------------------------------------------------------


def test_a_refused_setting_is_shown_with_its_reason_and_nothing_is_written(
    console: ConsoleAgent,
) -> None:
    client, csrf = console.session()
    before = console.config.read_bytes()
    with client:
        r = console.post(client, csrf, "/api/settings", {"run_windows": ["Mon-Fry 19:00-07:00"]})
        assert r.status_code == 422
        assert "unknown day 'Fry'" in r.json()["error"] and "not changed" in r.json()["error"]
        r = console.post(client, csrf, "/api/settings", {"task_cpu_percent": 250})
        assert r.status_code == 422 and "at most 100" in r.json()["error"]
        r = console.post(client, csrf, "/api/settings", {"token_file": "/etc/shadow"})
        assert r.status_code == 400
        assert console.config.read_bytes() == before

        r = console.post(
            client, csrf, "/api/settings", {"run_windows": ["Sat-Sun"], "task_cpu_percent": 50}
        )
        assert r.status_code == 200, r.text
        text = console.config.read_text()
        assert "# the owner's config: comments stay" in text
        assert "# the team this machine serves" in text
        assert 'run_windows = ["Sat-Sun"]' in text and "task_cpu_percent = 50" in text
        console.agent.wait_log("configuration reloaded")
        wait_for(
            "the reloaded settings in the console",
            lambda: client.get("/api/state").json()["settings"]["run_windows"] == ["Sat-Sun"],
        )
        r = console.post(client, csrf, "/api/settings", {"run_windows": []})
        assert r.status_code == 200
        assert "run_windows" not in console.config.read_text()  # any time: the key goes

        # A reload the agent refused (a mistake made by hand) is shown until one succeeds.
        console.config.write_text(console.config.read_text() + 'run_windows = ["Mon-Fry"]\n')
        console.agent.signal(signal.SIGHUP)
        why = wait_for(
            "the refused reload in the console",
            lambda: client.get("/api/state").json()["why"]["reload_refused"],
        )
        assert "unknown day 'Fry'" in why["reason"] and why["at"] > 0
        console.config.write_text(CONFIG)
        console.agent.signal(signal.SIGHUP)
        wait_for(
            "the refused reload to be gone",
            lambda: client.get("/api/state").json()["why"]["reload_refused"] is None,
        )


def test_pools_join_and_leave_edit_the_config_file_and_reload(
    console: ConsoleAgent, coordinator: CoordinatorServer
) -> None:
    client, csrf = console.session()
    with client:
        r = console.post(client, csrf, "/api/pools", {"join": "team-b"})
        assert r.status_code == 200, r.text
        assert (
            'pools = ["team-a", "team-b"]  # the team this machine serves'
            in console.config.read_text()
        )
        wait_for(
            "the agent to serve team-b",
            lambda: client.get("/api/state").json()["agent"]["pools"] == ["team-a", "team-b"],
        )
        assert console.post(client, csrf, "/api/pools", {"join": "../../x"}).status_code == 422
        assert console.post(client, csrf, "/api/pools", {"leave": "team-a"}).status_code == 200
        assert 'pools = ["team-b"]' in console.config.read_text()
        # trusted needs a pool: leaving the last one is what `work` would refuse
        r = console.post(client, csrf, "/api/pools", {"leave": "team-b"})
        assert r.status_code == 422 and "pool" in r.json()["error"]
        assert 'pools = ["team-b"]' in console.config.read_text()


def test_a_setting_a_flag_overrides_is_not_written(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    console = start_console_agent(start_agent, coordinator.url, tmp_path, "--pool", "team-a")
    client, csrf = console.session()
    with client:
        r = console.post(client, csrf, "/api/pools", {"join": "team-b"})
        assert r.status_code == 409 and "set by --pool" in r.json()["error"]
    assert console.config.read_text() == CONFIG


# --- what it shows ---------------------------------------------------------------------------


def test_the_state_shows_the_node_the_running_task_and_the_coordinators_view(
    console: ConsoleAgent, coordinator: CoordinatorServer
) -> None:
    job = coordinator.submit(argv_job(["sh", "-c", "echo step one; sleep 30"]))
    client, _ = console.session()
    with client:
        # The node's state is what the loop last published (each turn, at most 0.5 s old); the
        # task's output is read live: wait for the turn that saw the task started.
        state = wait_for(
            "the task in the console",
            lambda: (
                (s := client.get("/api/state").json())["running"]
                and s["running"][0]["phase"] == "execute"
                and s["running"][0]["output"]["stdout"]
                and s
            ),
        )
        node = state["agent"]
        assert node["registered"] and node["runner"] == "trusted" and node["pools"] == ["team-a"]
        slot = state["running"][0]
        assert slot["job_id"] == job and slot["phase"] == "execute"
        assert slot["elapsed_s"] >= 0 and slot["lease_left_s"] > 0
        assert slot["output"]["stdout"] == "step one"
        wait_for(
            "the task's memory",
            lambda: (client.get("/api/state").json()["running"][0].get("usage") or {}).get(
                "memory_bytes"
            ),
        )
        view = wait_for(
            "the coordinator's view",
            lambda: "online" in (v := client.get("/api/coordinator").json()) and v,
        )
        assert view["online"] is True and view["placement_tier"] == "unproven"
        charts = client.get("/api/charts?span=day").json()
        assert charts["span"] == "day" and charts["bin_seconds"] == 3600 and charts["usage"]


def test_the_console_is_off_with_an_empty_ui_listen_and_a_taken_port_leaves_the_agent_working(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    off = start_agent(
        coordinator.url, "--runner", "trusted", "--pool", "team-a", "--max-tasks", "1"
    )
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        taken = start_agent(
            coordinator.url,
            "--runner",
            "trusted",
            "--pool",
            "team-a",
            "--max-tasks",
            "1",
            env={"FLASHNODE_UI_LISTEN": f"127.0.0.1:{port}"},
        )
        taken.wait_log("the console is off: cannot listen on")
        coordinator.submit(argv_job(["sh", "-c", "echo '{}' > metrics.json"], params=[{}, {}]))
        assert off.wait(90) == 0 and taken.wait(90) == 0
        assert len(off.ledger()) == 1 and len(taken.ledger()) == 1
    finally:
        busy.close()
    for agent in (off, taken):
        assert not any((agent.state_dir / n).exists() for n in auth.KEY_FILES.values())


def test_flashnode_ui_says_when_no_console_is_served(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    agent = start_agent(coordinator.url, "--runner", "trusted", "--pool", "team-a")
    wait_for("the agent's status", lambda: (agent.state_dir / "status.json").exists())
    console = ConsoleAgent(agent, free_port(), tmp_path / "none.toml")
    done = console.ui("--print-url")
    assert done.returncode == 1 and "serves no console" in done.stderr
    agent.stop()
    done = console.ui("--print-url")
    assert done.returncode == 3 and "no agent is running" in done.stderr


# --- the parts on their own --------------------------------------------------------------------


def test_ledger_totals_and_tasks_per_hour_read_only_what_was_appended(tmp_path: Path) -> None:
    now = [1_800_000_000.0]
    ledger = tmp_path / "ledger.jsonl"

    def line(outcome: str, ended: float, cpu: float | None, gpu: float | None, wall: float) -> str:
        return json.dumps(
            {
                "outcome": outcome,
                "ended_at": ended,
                "evidence": {"wall_seconds": wall},
                "task_usage": {"cpu_percent_mean": cpu, "gpu_util_percent_mean": gpu},
                "gpus": ["0", "1"] if gpu is not None else [],
            }
        )

    ledger.write_text(
        line("committed", now[0] - 3 * 86400, 100.0, None, 3600)  # a core for an hour, long ago
        + "\n"
        + line("committed", now[0] - 60, 200.0, 50.0, 1800)  # two cores, two GPUs at half
        + "\n"
        + line("failed", now[0] - 30, None, None, 10)
        + "\n"
        + '{"outcome": "committed", "ended_at": '  # torn: its end is not written yet
    )
    view = LedgerView(ledger, clock=lambda: now[0])
    totals = view.totals()
    assert totals["all_time"]["tasks"] == 2
    assert totals["all_time"]["outcomes"] == {"committed": 2, "failed": 1}
    assert totals["all_time"]["cpu_hours"] == pytest.approx(2.0)
    assert totals["all_time"]["gpu_hours"] == pytest.approx(0.5)
    assert totals["today"]["tasks"] in (0, 1)  # 60 s ago may be yesterday at midnight
    with ledger.open("a") as fh:
        fh.write(f'{now[0] - 10}, "evidence": {{"wall_seconds": 5}}}}\n')
    assert view.totals()["all_time"]["tasks"] == 3
    bins = view.per_bin(now[0] - 3600, 300)
    assert len(bins) in (12, 13) and sum(n for _, n in bins) == 2
    assert [r["outcome"] for r in view.latest()] == [
        "committed",
        "failed",
        "committed",
        "committed",
    ]
    assert [r["outcome"] for r in view.latest("failed")] == ["failed"]
    ledger.unlink()
    ledger.write_text(line("lapsed", now[0], None, None, 1) + "\n")  # replaced: read afresh
    assert view.totals()["all_time"]["outcomes"] == {"lapsed": 1}


def test_every_asset_ships_in_the_package_and_the_page_fetches_nothing_else() -> None:
    names = {p.name for p in STATIC.iterdir()}
    assert names == {"index.html", "console.js", "console.css", "favicon.svg"}
    html = (STATIC / "index.html").read_text()
    assert re.findall(r'(?:src|href)="([^"]+)"', html) == [
        "/favicon.svg",
        "/console.css",
        "/console.js",
    ]
    for path in STATIC.iterdir():
        urls = set(re.findall(r"https?://[^\s\"')]+", path.read_text()))
        assert urls <= {"http://www.w3.org/2000/svg"}, (path.name, urls)
    js = (STATIC / "console.js").read_text()
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "eval(" not in js
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"flashnode.console" = ["static/*"]' in pyproject


def test_one_user_holding_connections_open_cannot_lock_the_owner_out(
    console: ConsoleAgent,
) -> None:
    """The attack: every request slot held by connections that each send a byte now and then
    (any local user can; a task too, on the host's network), so that the owner's browser gets
    no answer. One user gets few slots at once, and a request must arrive whole within one
    deadline, however slowly its bytes come."""
    from flashnode.console.server import MAX_CLIENTS, READ_TIMEOUT_S

    if (
        os.geteuid() != 0
        or shutil.which("setpriv") is None
        or not Path("/usr/bin/python3").exists()
    ):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to hold connections as another user")
    hold = (
        "import socket, sys, time\n"
        "held = [socket.create_connection(('127.0.0.1', int(sys.argv[1]))) for _ in range(32)]\n"
        "for s in held: s.sendall(b'GET / HTTP/1.0\\r\\n')\n"
        "print('held', flush=True)\n"
        "while True:\n"
        "    time.sleep(1)\n"
        "    for s in held:\n"
        "        try: s.sendall(b'X')\n"
        "        except OSError: pass\n"
    )
    assert MAX_CLIENTS * 2 <= 32  # more than every slot there is
    nobody = subprocess.Popen(
        [
            *("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"),
            *("/usr/bin/python3", "-c", hold, str(console.port)),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    try:
        assert nobody.stdout is not None and nobody.stdout.readline().strip() == "held"
        for _ in range(3):
            time.sleep(1)  # the holder keeps sending
            r = httpx.get(console.base + "/api/state", timeout=READ_TIMEOUT_S)
            assert r.status_code == 401  # answered (no session): the owner is not locked out
    finally:
        nobody.kill()
        nobody.wait()
        nobody.stdout.close()


def test_the_browser_is_handed_a_private_page_never_the_login_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A browser's command line is readable by every local user: ``flashnode ui`` hands it the
    path of a page only this user can read, which leads on to the link."""
    from flashnode.cli.ui import open_privately

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    link = "http://127.0.0.1:7469/login?token=owner.123.secret-part"
    opened: list[str] = []
    page = open_privately(link, opened.append)
    [url] = opened
    assert "secret-part" not in url and url == page.as_uri()
    assert stat.S_IMODE(page.stat().st_mode) == 0o600
    assert stat.S_IMODE(page.parent.stat().st_mode) == 0o700
    assert page.stat().st_uid == os.geteuid()
    assert 'content="0;url=http://127.0.0.1:7469/login?token=owner.123.secret-part"' in (
        page.read_text()
    )
