"""The console's page in a real headless Chromium (Debian's, driven by Playwright): the node and
a running task appear, charts are drawn, the Pause and Resume buttons stop and restart claiming,
and a task's output with HTML and script in it is shown as text. Screenshots are kept under the
test's tmp dir, and in ``$FLASHNODE_TEST_ARTIFACTS`` when it names a directory."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from consoleharness import ConsoleAgent, start_console_agent
from harness import AgentProcess, CoordinatorServer, argv_job, wait_for

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# What a hostile task prints: markup that would run or load something if set as HTML.
HOSTILE = (
    "<script>window.__pwned = 1</script>"
    ' <img src=x onerror="window.__pwned = 2">'
    ' <b id=injected>bold</b> </pre><svg onload="window.__pwned = 3">'
)


def wait_page(page: Any, expression: str, timeout: float = 30) -> None:
    """Poll a JavaScript expression from here (Playwright's own ``wait_for_function`` polls by
    ``eval`` in the page, which the console's Content-Security-Policy rightly refuses)."""
    wait_for(expression, lambda: page.evaluate(expression), timeout)


@pytest.fixture
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (the test extra has it)"
    )
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1200, "height": 1400})
    p = context.new_page()
    p.dialogs = []
    p.on("dialog", lambda d: (p.dialogs.append(d.message), d.dismiss()))
    p.requests = []
    p.on("request", lambda r: p.requests.append(r.url))
    yield p
    context.close()


def shot(page: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    artifacts = os.environ.get("FLASHNODE_TEST_ARTIFACTS")
    if artifacts and Path(artifacts).is_dir():
        shutil.copy(path, Path(artifacts) / path.name)
    return path


@pytest.fixture
def console(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> ConsoleAgent:
    return start_console_agent(start_agent, coordinator.url, tmp_path)


def test_the_page_shows_the_node_a_running_task_its_output_as_text_and_draws_charts(
    console: ConsoleAgent, coordinator: CoordinatorServer, page: Any, tmp_path: Path
) -> None:
    coordinator.submit(argv_job(["sh", "-c", "echo '{}' > metrics.json"]))
    wait_for("a first task done", lambda: console.agent.ledger())
    job = coordinator.submit(
        argv_job(["sh", "-c", f"echo '{HOSTILE}'; echo step 2 of 9 >&2; sleep 60"])
    )
    page.goto(console.base + "/")  # no session yet: the page asks to log in, shows no data
    page.wait_for_selector("#login:not([hidden])")
    assert page.inner_text("#node-id") == ""
    shot(page, tmp_path, "console-login")

    page.goto(console.link())
    assert page.url == console.base + "/"
    page.wait_for_selector(f"#slots tbody tr:has-text('{job}')", timeout=30_000)
    wait_page(
        page,
        "document.querySelector('#slots td.output pre').textContent.includes('step 2 of 9')",
        30,
    )
    node = page.inner_text("#node-facts")
    assert "trusted" in node and "team-a" in node and "registered" in node
    assert page.inner_text("#node-id") in node
    # Each refresh draws the rows anew, and the phase comes from status.json, which the agent
    # writes at its next turn (within half a second): the row first seen may say "claimed".
    wait_page(
        page,
        "[...document.querySelectorAll('#slots tbody tr')].some((tr) =>"
        f" tr.textContent.includes('{job}') && tr.cells[1].textContent.startsWith('execute'))",
    )
    output = page.inner_text("#slots td.output pre")
    assert HOSTILE in output  # shown as it was printed: text
    assert page.evaluate("window.__pwned") is None
    assert page.query_selector("#injected") is None and page.query_selector("main img") is None
    assert page.dialogs == []

    page.wait_for_selector("#usage-chart polyline.mem", state="attached", timeout=30_000)
    points = page.get_attribute("#usage-chart polyline.mem", "points")
    assert len(points.split()) >= 2
    page.wait_for_selector("#tasks-chart rect.bar", state="attached", timeout=30_000)
    assert "1 in all" in page.inner_text("#tasks-caption")
    page.wait_for_selector("#history-table tbody tr[data-outcome='committed']", timeout=30_000)
    totals = page.inner_text("#totals-body")
    assert "all time\t1" in totals or "all time 1" in totals
    wait_page(
        page, "document.querySelector('#coordinator-facts').textContent.includes('unproven')", 40
    )
    shot(page, tmp_path, "console-running")

    page.click("[data-span=day]")
    wait_page(page, "document.querySelector('#tasks-caption').textContent.includes('per hour')")
    shot(page, tmp_path, "console-day")
    assert all(u.startswith(console.base) for u in page.requests), page.requests


def test_the_pause_and_resume_buttons_stop_and_restart_claiming(
    console: ConsoleAgent, coordinator: CoordinatorServer, page: Any, tmp_path: Path
) -> None:
    page.goto(console.link())
    page.wait_for_selector("#btn-pause")
    wait_page(page, "document.querySelector('#node-id').textContent.length > 0")
    page.click("#btn-pause")
    page.wait_for_selector("#why:not([hidden]) li[data-rule=pause]", timeout=10_000)
    assert "paused by the owner" in page.inner_text("#why")
    assert page.inner_text("#state-badge") == "held"
    assert (console.agent.state_dir / "pause.json").exists()
    shot(page, tmp_path, "console-paused")

    job = coordinator.submit(argv_job(["sh", "-c", "echo '{}' > metrics.json"]))
    with pytest.raises(AssertionError):  # paused: the agent claims nothing
        wait_for("a claim while paused", lambda: console.agent.ledger(), timeout=6)
    assert coordinator.tasks(job)[0]["state"] == "PENDING"

    page.click("#btn-resume")
    page.wait_for_selector("#why[hidden]", state="attached", timeout=10_000)
    assert page.inner_text("#message") == "resumed"
    coordinator.wait_state(job, {"SUCCEEDED"})
    assert console.agent.ledger()[0]["outcome"] == "committed"

    page.select_option("#pause-for", "2h")
    page.click("#btn-pause-for")
    page.wait_for_selector("#why:not([hidden]) li[data-rule=pause]", timeout=10_000)
    assert "paused until" in page.inner_text("#message")
    shot(page, tmp_path, "console-paused-for")
