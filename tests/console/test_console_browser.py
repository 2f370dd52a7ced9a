"""The console's page in a real headless Chromium (Debian's, driven by Playwright): it fits a
phone and a desktop with no sideways scroll and no serious accessibility violation (axe-core);
a running task shows its job, pool, steps and newest output (as text, however hostile); the
Pause and Resume buttons stop and restart claiming; an opened history row and a refused setting
survive the page's refreshes; the usage and task history survive an agent restart. Screenshots
are kept under the test's tmp dir, and in ``$FLASHNODE_TEST_ARTIFACTS`` when it names a
directory."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

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
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}
# What a hostile task prints: markup that would run or load something if set as HTML.
HOSTILE = (
    "<script>window.__pwned = 1</script>"
    ' <img src=x onerror="window.__pwned = 2">'
    ' <b id=injected>bold</b> </pre><svg onload="window.__pwned = 3">'
)
# A task as flashruntime's torch helper writes one: a metrics line a step, 40 lines printed.
TRAINING = (
    "for i in $(seq 1 40); do echo \"line $i\"; done; echo 'the newest line';"
    " for s in 1 2 3 4 5 6 7; do echo \"{\\\"step\\\": $s, \\\"loss\\\": 0.5}\""
    " >> /work/out/metrics.jsonl; done; echo '{}' > /work/out/metrics.json; sleep 60"
)
SEVERE = ("serious", "critical")


def wait_page(page: Any, expression: str, timeout: float = 30) -> Any:
    """Poll a JavaScript expression from here (Playwright's own ``wait_for_function`` polls by
    ``eval`` in the page, which the console's Content-Security-Policy rightly refuses)."""
    return wait_for(expression, lambda: page.evaluate(expression), timeout)


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


def new_page(browser: Any, viewport: dict[str, int], dark: bool = False) -> Any:
    context = browser.new_context(
        viewport=viewport, color_scheme="dark" if dark else "light", timezone_id="Europe/Paris"
    )
    p = context.new_page()
    p.dialogs = []
    p.on("dialog", lambda d: (p.dialogs.append(d.message), d.dismiss()))
    p.requests = []
    p.on("request", lambda r: p.requests.append(r.url))
    p.failed = []
    p.on("response", lambda r: r.status >= 400 and p.failed.append(f"{r.status} {r.url}"))
    return p


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    p = new_page(browser, DESKTOP)
    yield p
    p.context.close()


def shot(page: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    artifacts = os.environ.get("FLASHNODE_TEST_ARTIFACTS")
    if artifacts and Path(artifacts).is_dir():
        shutil.copy(path, Path(artifacts) / path.name)
    return path


def severe_violations(page: Any) -> list[str]:
    """axe-core's serious and critical findings on the page as it is now."""
    from axe_playwright_python.sync_playwright import Axe

    results = Axe().run(page)
    return [
        f"{v['id']} ({v['impact']}): {v['help']} at {[n['target'] for n in v['nodes']][:3]}"
        for v in results.response["violations"]
        if v.get("impact") in SEVERE
    ]


def sideways(page: Any) -> list[str]:
    """What sticks out of the viewport sideways (nothing: the page fits it)."""
    if page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"):
        return []
    return list(
        page.evaluate(
            "[...document.querySelectorAll('body *')].filter((e) =>"
            " e.getBoundingClientRect().right > window.innerWidth + 0.5).slice(-5).map((e) =>"
            " e.tagName + '#' + e.id + '.' + e.className + ' ' + e.getBoundingClientRect().right)"
        )
    )


@pytest.fixture
def console(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> ConsoleAgent:
    return start_console_agent(start_agent, coordinator.url, tmp_path)


def test_a_running_task_shows_its_job_pool_steps_and_newest_output_on_a_phone_and_a_desktop(
    console: ConsoleAgent, coordinator: CoordinatorServer, browser: Any, tmp_path: Path
) -> None:
    coordinator.submit(argv_job(["sh", "-c", "exit 3"], max_attempts=1))
    console.agent.wait_ledger(1)
    job = coordinator.submit(argv_job(["sh", "-c", f"echo '{HOSTILE}' >&2; {TRAINING}"]))
    login = new_page(browser, PHONE)
    login.goto(console.link())  # a login link is good once: its cookie serves every page here
    cookies = login.context.cookies()
    login.context.close()
    for viewport, label, dark in ((PHONE, "phone", False), (PHONE, "phone-dark", True),
                                  (DESKTOP, "desktop", False)):
        page = new_page(browser, viewport, dark)
        page.context.add_cookies(cookies)
        page.goto(console.base + "/")
        look_at_running(page, job, console.base)
        shot(page, tmp_path, f"console-running-{label}")
        assert sideways(page) == [], f"{label}: the page scrolls sideways"
        assert severe_violations(page) == [], label
        assert page.dialogs == [] and page.failed == [], page.failed
        assert all(u.startswith(console.base) for u in page.requests), page.requests
        # The charts' text is drawn at the width shown: 12 px on a phone too.
        size = page.evaluate(
            "parseFloat(getComputedStyle(document.querySelector('#usage-chart text')).fontSize)"
            " * document.querySelector('#usage-chart').getBoundingClientRect().width"
            " / document.querySelector('#usage-chart').viewBox.baseVal.width"
        )
        assert size >= 11.5, (label, size)
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert (background == "rgb(244, 245, 247)") != dark, f"{label}: {background}"
        page.context.close()


def look_at_running(page: Any, job: str, base: str) -> None:
    """The running task's card names its job, pool and steps, shows its newest output line and
    its hostile output as text; the history's times are 24-hour with their zone; outcomes are
    coloured."""
    card = f"#slot-list article[data-lease]:has-text('{job}')"
    page.wait_for_selector(card, timeout=30_000)
    wait_for("the task's step 7", lambda: "step 7 logged" in page.inner_text(card), 40)
    wait_for("the job's name", lambda: "test-argv" in page.inner_text(card), 30)
    wait_page(page, "document.querySelector('#history-table tbody tr.row') !== null")
    wait_page(page, "document.querySelector('#usage-chart polyline') !== null")
    text = page.inner_text(card)
    assert "pool team-a" in text and "test-argv" in text, text
    # The newest output line is shown, last, and in view in its box.
    out = page.locator(f"{card} pre.output").first
    assert out.inner_text().rstrip().endswith("the newest line")
    assert newest_in_view(page, f"{card} pre.output")["inView"], "the newest line is hidden"
    assert out.is_visible()
    stderr = page.locator(f"{card} pre.output").nth(1).inner_text()
    assert HOSTILE in stderr  # shown as it was printed: text
    assert page.evaluate("window.__pwned") is None
    assert page.query_selector("#injected") is None and page.query_selector("main img") is None
    ended = page.inner_text("#history-table tbody tr.row td")
    assert "AM" not in ended and "PM" not in ended and ("CET" in ended or "GMT+1" in ended)
    assert page.query_selector("#history-table .outcome.failed") is not None


def test_an_opened_history_row_and_a_refused_setting_survive_the_refreshes(
    console: ConsoleAgent, coordinator: CoordinatorServer, page: Any, tmp_path: Path
) -> None:
    coordinator.submit(argv_job(["sh", "-c", "echo done here; echo '{}' > /work/out/metrics.json"]))
    console.agent.wait_ledger(1)
    page.goto(console.link())
    row = "#history-table tbody tr.row[data-outcome=committed]"
    page.wait_for_selector(row, timeout=30_000)
    page.click(row)
    page.wait_for_selector("#history-table tr.detail", timeout=5_000)
    assert "done here" in page.inner_text("#history-table tr.detail")
    drawn = page.query_selector("#history-table tr.detail")
    # The next refresh (every 10 s) draws the rows anew: the opened one is open again.
    wait_for("the history drawn anew", lambda: not drawn.evaluate("(e) => e.isConnected"), 30)
    assert page.query_selector("#history-table tr.detail") is not None

    page.fill("#run-windows", "Someday 25:00-99:00")
    page.click("#btn-save")
    page.wait_for_selector("#settings-message.error", timeout=10_000)
    shown = page.get_attribute("#app", "data-state-at")
    wait_for(
        "the state drawn anew", lambda: page.get_attribute("#app", "data-state-at") != shown, 30
    )
    assert page.input_value("#run-windows") == "Someday 25:00-99:00"
    shot(page, tmp_path, "console-refused-setting")


def test_the_usage_and_task_history_outlast_an_agent_restart(
    coordinator: CoordinatorServer,
    start_agent: Callable[..., AgentProcess],
    browser: Any,
    tmp_path: Path,
) -> None:
    first = start_console_agent(start_agent, coordinator.url, tmp_path)
    coordinator.submit(argv_job(["sh", "-c", "echo '{}' > /work/out/metrics.json"]))
    first.agent.wait_ledger(1)
    client, _ = first.session()
    with client:
        before = wait_for(
            "a usage sample",
            lambda: [p for p in client.get("/api/charts").json()["usage"] if p[2] is not None],
            60,
        )
    first.agent.signal(signal.SIGTERM)
    assert first.agent.wait() == 0

    again = start_console_agent(
        start_agent, coordinator.url, tmp_path, state_dir=first.agent.state_dir
    )
    page = new_page(browser, DESKTOP)
    page.goto(again.link())
    page.wait_for_selector("#history-table tbody tr.row[data-outcome=committed]", timeout=30_000)
    wait_page(page, "document.querySelector('#tasks-caption').textContent.includes('1 in all')")
    client, _ = again.session()
    with client:
        after = client.get("/api/charts").json()["usage"]
    assert before[0] in after, "the samples taken before the restart are gone"
    shot(page, tmp_path, "console-after-restart")
    page.context.close()


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


# --- what a new owner found walking the page ---------------------------------------------------

NARROW = (360, 390)  # the phones the page is checked at, in CSS pixels


def logged_in(browser: Any, console: ConsoleAgent, viewport: dict[str, int]) -> Any:
    page = new_page(browser, viewport)
    page.goto(console.link())
    wait_page(page, "document.querySelector('#node-id').textContent.length > 0")
    return page


def not_today() -> str:
    """A run window that cannot be open now, in any zone: a short one three days away."""
    return (datetime.now() + timedelta(days=3)).strftime("%a") + " 00:00-00:01"


def test_a_paused_task_card_wraps_its_badge_and_names_its_pauses_on_a_phone(
    console: ConsoleAgent, coordinator: CoordinatorServer, browser: Any, tmp_path: Path
) -> None:
    job = coordinator.submit(argv_job(["sh", "-c", "echo started; sleep 120"]))
    page = logged_in(browser, console, {"width": 390, "height": 844})
    card = f"#slot-list article[data-lease]:has-text('{job}')"
    page.wait_for_selector(card, timeout=30_000)
    # An owner rule suspends the running task: outside its run windows, suspended by "window".
    before = console.config.read_text()
    text = before.replace(
        "run_windows = []", f'run_windows = ["{not_today()}"]\nsuspend_when = ["window"]'
    )
    console.config.write_text(text)
    console.agent.signal(signal.SIGHUP)
    badge = f"{card} .phase"
    wait_for("the pause shown", lambda: "outside run_windows" in page.inner_text(badge), 40)
    for width in NARROW:
        page.set_viewport_size({"width": width, "height": 800})
        wait_page(page, f"window.innerWidth === {width}")
        assert sideways(page) == [], f"{width} px: the page scrolls sideways"
        fits = page.eval_on_selector(
            badge,
            "(e) => [e.scrollWidth, e.clientWidth, e.getBoundingClientRect().right,"
            " window.innerWidth, e.textContent]",
        )
        assert fits[0] <= fits[1] + 1 and fits[2] <= fits[3], f"{width} px: cut off: {fits}"
        shot(page, tmp_path, f"console-paused-task-{width}")
    # Resumed (the rule taken out again), its pauses so far are named as pauses, not as what
    # was prepared for it.
    console.config.write_text(before)
    console.agent.signal(signal.SIGHUP)
    wait_for("the pause counted", lambda: "paused 1x" in page.inner_text(card), 40)
    facts = page.evaluate(
        "(c) => Object.fromEntries([...c.querySelectorAll('dt')].map((t) =>"
        " [t.textContent, t.nextElementSibling.textContent]))",
        page.query_selector(card),
    )
    assert facts.get("paused", "").startswith("paused 1x"), facts
    assert "paused" not in facts.get("prepared", ""), facts
    page.context.close()


def test_the_page_says_when_the_agent_stops_answering_and_clears_when_it_answers_again(
    console: ConsoleAgent, browser: Any, tmp_path: Path
) -> None:
    page = new_page(browser, DESKTOP)
    page.clock.install()  # the page's own clock, moved on below instead of waiting its bound
    page.goto(console.link())
    wait_page(page, "document.querySelector('#node-id').textContent.length > 0")
    assert page.is_hidden("#stale")
    console.agent.signal(signal.SIGSTOP)
    try:
        page.clock.fast_forward(40_000)  # longer than the bound (at least 30 s) with no answer
        wait_for(
            "the no-answer notice",
            lambda: "No answer from the agent since" in page.inner_text("#stale-text"),
            30,
        )
        assert page.is_visible("#stale")
        assert "may no longer hold" in page.inner_text("#stale-text")
        assert page.inner_text("#state-badge") == "no answer"
        shot(page, tmp_path, "console-no-answer")
    finally:
        console.agent.signal(signal.SIGCONT)
    wait_for(
        "the notice gone",
        lambda: page.is_hidden("#stale") and page.inner_text("#state-badge") != "no answer",
        30,
    )
    page.context.close()


def loaded(page: Any) -> bool:
    """The page drew all it asks for at its start: the state, the charts, the coordinator's
    view, the history with its job's name (asked for from the coordinator)."""
    return bool(
        page.evaluate(
            "document.querySelector('#app').dataset.stateAt !== undefined"
            " && document.querySelector('#usage-chart text') !== null"
            " && document.querySelector('#coordinator-facts dt') !== null"
            " && document.querySelector('#history-table tbody tr.row') !== null"
            " && document.querySelector('#history-table tbody').textContent.includes('test-argv')"
        )
    )


def test_ten_page_loads_beside_a_second_tab_fail_no_request(
    console: ConsoleAgent, coordinator: CoordinatorServer, browser: Any
) -> None:
    coordinator.submit(argv_job(["sh", "-c", "echo '{}' > /work/out/metrics.json"]))
    console.agent.wait_ledger(1)
    failed: list[str] = []
    tab = logged_in(browser, console, DESKTOP)  # a second tab, open and refreshing meanwhile
    on_tab = lambda r: failed.append(f"tab: {r.url} {r.failure}")  # noqa: E731
    tab.on("requestfailed", on_tab)
    for n in range(10):
        page = tab.context.new_page()
        on_page = lambda r, n=n: failed.append(f"load {n}: {r.url} {r.failure}")  # noqa: E731
        page.on("requestfailed", on_page)
        page.goto(console.base + "/")
        try:
            wait_for(f"load {n} drawn", lambda: loaded(page), 30)  # noqa: B023
        except AssertionError as exc:
            raise AssertionError(f"{exc}; failed: {failed}") from None
        errors = [page.inner_text("#message"), page.inner_text("#settings-message")]
        page.remove_listener("requestfailed", on_page)  # closing it aborts what is under way
        page.close()
        assert failed == [] and not any(errors), (failed, errors)
    tab.remove_listener("requestfailed", on_tab)
    assert "fetch" not in tab.inner_text("#message"), tab.inner_text("#message")
    tab.context.close()


def test_the_charts_axis_labels_never_overlap_on_a_phone_and_name_their_zone(
    console: ConsoleAgent, browser: Any, tmp_path: Path
) -> None:
    page = logged_in(browser, console, PHONE)
    for span, per in (("hour", "5 minutes"), ("day", "hour"), ("week", "6 hours")):
        page.click(f"[data-span={span}]")
        wait_for(f"the {span} drawn", lambda: per in page.inner_text("#tasks-caption"))  # noqa: B023
        for chart in ("usage-chart", "tasks-chart"):
            boxes = page.evaluate(
                f"[...document.querySelectorAll('#{chart} text')].map((t) => {{"
                " const r = t.getBoundingClientRect();"
                " return [t.textContent, r.left, r.right, r.top, r.bottom]; })"
            )
            assert len(boxes) >= 4, (span, chart, boxes)
            for i, a in enumerate(boxes):
                for b in boxes[i + 1 :]:
                    apart = a[2] <= b[1] or b[2] <= a[1] or a[4] <= b[3] or b[4] <= a[3]
                    assert apart, f"{span}, {chart}: {a[0]!r} and {b[0]!r} overlap: {boxes}"
            caption = page.evaluate(
                f"document.querySelector('#{chart}').closest('figure').textContent"
            )
            assert any(z in caption for z in ("CET", "CEST", "GMT+1", "GMT+2")), caption
        shot(page, tmp_path, f"console-charts-{span}")
    page.context.close()


LONG_LINES = (
    "for i in $(seq 1 12); do printf \"line $i \"; printf '%0290d\\n' 0; done;"
    " printf 'the newest line '; printf '%0280d\\n' 7; sleep 60"
)


def newest_in_view(page: Any, selector: str) -> dict[str, Any]:
    """The first box ``selector`` names: its height, its content's, and whether the last
    character it holds shows inside it."""
    return dict(
        page.eval_on_selector(
            selector,
            "(e) => { const r = document.createRange(); const t = e.lastChild;"
            " const end = t.length - (t.data.endsWith('\\n') ? 1 : 0);"
            " r.setStart(t, end - 1); r.setEnd(t, end);"
            " const last = r.getBoundingClientRect(), all = e.getBoundingClientRect();"
            " return {height: all.height, scroll: e.scrollHeight,"
            " inView: last.top >= all.top - 1 && last.bottom <= all.bottom + 1}; }",
        )
    )


def test_a_long_output_box_is_bounded_with_its_newest_line_in_view(
    console: ConsoleAgent, coordinator: CoordinatorServer, browser: Any, tmp_path: Path
) -> None:
    job = coordinator.submit(argv_job(["sh", "-c", LONG_LINES]))
    page = logged_in(browser, console, PHONE)
    out = f"#slot-list article[data-lease]:has-text('{job}') pre.output"
    page.wait_for_selector(out, timeout=30_000)
    wait_for("the newest line", lambda: "the newest line" in page.inner_text(out), 30)
    shot(page, tmp_path, "console-long-output")
    box = newest_in_view(page, out)
    assert box["height"] <= 844 / 2, box  # bounded: the page does not become its output
    assert box["scroll"] > box["height"], box  # the rest is there, scrolled to
    assert box["inView"], box  # the newest line shows
    assert sideways(page) == []
    page.context.close()


def test_re_attached_tasks_are_not_listed_as_a_reason_the_node_takes_no_work(
    console: ConsoleAgent, browser: Any
) -> None:
    page = new_page(browser, DESKTOP)

    def rejoined(route: Any) -> None:  # the state of an agent that re-attached a task at start
        answer = route.fetch()
        state = answer.json()
        if state.get("why") is not None:
            state["why"]["rejoined"] = 1
        route.fulfill(response=answer, json=state)

    page.route("**/api/state", rejoined)
    page.goto(console.link())
    wait_for("the node facts", lambda: "re-attached" in page.inner_text("#node-facts"), 30)
    assert "re-attached" not in page.inner_text("#why")
    page.context.close()


# --- what the agent says since it keeps a task's output and a stale view from a viewer ----------


def test_a_view_login_is_told_a_tasks_output_is_the_owners_and_the_owner_sees_as_before(
    console: ConsoleAgent, coordinator: CoordinatorServer, browser: Any, tmp_path: Path
) -> None:
    """At the view-only level the agent sends no output (``output: null``,
    ``output_hidden: true``): the running card and the opened history row say it is the owner's,
    not that nothing was printed or kept. The owner's login, sent no output, says as before."""
    coordinator.submit(argv_job(["sh", "-c", "echo kept here; echo '{}' > /work/out/metrics.json"]))
    console.agent.wait_ledger(1)
    job = coordinator.submit(argv_job(["sh", "-c", "echo printed now; sleep 120"]))
    card = f"#slot-list article[data-lease]:has-text('{job}')"
    row = "#history-table tbody tr.row[data-outcome=committed]"

    page = new_page(browser, PHONE)
    page.goto(console.base + console.minted("view"))
    wait_page(page, "document.querySelector('#level').textContent === 'view only'")
    page.wait_for_selector(card, timeout=30_000)
    wait_for("the card's note", lambda: "output: owner only" in page.inner_text(card), 30)
    assert "no output yet" not in page.inner_text(card)
    assert page.query_selector(f"{card} pre.output") is None
    page.wait_for_selector(row, timeout=30_000)
    page.click(row)
    page.wait_for_selector("#history-table tr.detail", timeout=10_000)
    opened = page.inner_text("#history-table tr.detail")
    assert "output: owner only" in opened and "not kept on this node" not in opened, opened
    assert "printed now" not in page.inner_text("body")
    assert "kept here" not in page.inner_text("body")
    shot(page, tmp_path, "console-view-only-output")
    assert sideways(page) == []
    assert severe_violations(page) == []
    page.context.close()

    owner = new_page(browser, DESKTOP)

    def no_output(route: Any) -> None:  # the owner's answers, as when nothing is printed or kept
        answer = route.fetch()
        data = answer.json()
        for r in data if isinstance(data, list) else data.get("running") or []:
            r["output"], r["output_hidden"] = None, False
        route.fulfill(response=answer, json=data)

    owner.route("**/api/state", no_output)
    owner.route("**/api/history?*", no_output)
    owner.goto(console.link())
    owner.wait_for_selector(card, timeout=30_000)
    wait_for("the card's note", lambda: "no output yet" in owner.inner_text(card), 30)
    owner.wait_for_selector(row, timeout=30_000)
    owner.click(row)
    owner.wait_for_selector("#history-table tr.detail", timeout=10_000)
    opened = owner.inner_text("#history-table tr.detail")
    assert "output: not kept on this node" in opened and "owner only" not in opened, opened
    assert "owner only" not in owner.inner_text(card)
    owner.context.close()


PARIS = ZoneInfo("Europe/Paris")  # new_page's zone


def as_of(t: float) -> str:
    """A moment as the page writes it (``when``), without its zone's name."""
    d = datetime.fromtimestamp(t, PARIS)
    if d.date() == datetime.now(PARIS).date():
        return d.strftime("%H:%M:%S")
    return d.strftime("%Y-%m-%d %H:%M")


def the_view(fetched_at: float, **rest: Any) -> dict[str, Any]:
    """A good answer of ``/api/coordinator`` (``App.coordinator_view``), asked at
    ``fetched_at``."""
    view = {
        "online": True,
        "accepted_tasks": 7,
        "failed_attempts": 1,
        "abandoned_leases": 0,
        "reliability": 0.875,
        "placement_tier": "proven",
        "explained": {"reliability": "accepted ÷ accepted + failed + abandoned"},
        "lowered_by": [],
        "fetched_at": fetched_at,
        "age_s": max(time.time() - fetched_at, 0.0),
        "failed": False,
        "asking": False,
        "current": True,
    }
    return {**view, **rest}


def test_the_coordinator_view_says_when_it_was_asked_and_a_failed_ask_is_shown_as_failed(
    console: ConsoleAgent, browser: Any, tmp_path: Path
) -> None:
    """The coordinator's view says when it was asked ("as of HH:MM:SS ZONE"), says it is not
    current when the agent says so, is asked again in about 2 s while the agent is asking the
    coordinator (and while its first answer is pending), once after an answer not current, and
    then not; a failed ask shows its error, with the last good view only as "last known, as of"
    its time. The page's clock is held and moved on by hand: a re-ask is the 2 s one, never the
    30 s refresh."""
    page = new_page(browser, PHONE)
    asked = time.time() - 5
    answers: list[dict[str, Any]] = [{"error": "asking the coordinator", "pending": True}]
    hits: list[float] = []

    def shaped(route: Any) -> None:
        hits.append(time.monotonic())
        route.fulfill(json=answers[-1])

    def shown() -> dict[str, str]:
        return {
            k: page.inner_text(f"#coordinator-{k}") if page.is_visible(f"#coordinator-{k}") else ""
            for k in ("error", "as-of", "facts")
        }

    def next_answer(
        what: str, answer: dict[str, Any], drawn: Callable[[dict[str, str]], bool]
    ) -> None:
        """The agent's next answer: the page asks for it within about 2 s."""
        answers.append(answer)
        before = len(hits)
        page.clock.run_for(2_500)
        wait_for("a re-ask", lambda: page.title() is not None and len(hits) > before, 30)
        wait_for(f"{what} drawn", lambda: drawn(shown()), 30)

    page.route("**/api/coordinator", shaped)
    page.clock.install()
    page.clock.pause_at(time.time() + 1)  # no timer fires but those run_for moves past
    page.goto(console.link())
    wait_for("the pending ask", lambda: "asking the coordinator" in shown()["facts"], 30)

    # Pending (as before): asked again; the answer: as of its time, current, the agent asking.
    next_answer("the view", the_view(asked, asking=True), lambda s: "as of" in s["as-of"])
    now = shown()
    assert now["as-of"].startswith(f"as of {as_of(asked)} "), now
    assert any(z in now["as-of"] for z in ("CET", "CEST", "GMT+1", "GMT+2")), now
    assert "not current" not in now["as-of"] and now["error"] == "", now
    assert "87%" in now["facts"] or "88%" in now["facts"], now
    # A failed ask: its error, the last good view as "last known" only; asked again meanwhile.
    failed_at = time.time() - 1
    failure = {
        "error": "the coordinator did not answer: connection refused",
        "failed": True,
        "failed_at": failed_at,
        "fetched_at": asked,
        "last_known": {k: v for k, v in the_view(asked).items() if k not in ("failed", "current")},
        "asking": True,
    }
    next_answer("the failure", failure, lambda s: "connection refused" in s["error"])
    now = shown()
    assert f"since {as_of(failed_at)} " in now["error"], now
    assert now["as-of"].startswith(f"last known, as of {as_of(asked)} "), now
    assert "proven" in now["facts"], now
    # Failed with nothing known before: the error alone, no view.
    next_answer(
        "the failure with nothing known",
        {**failure, "last_known": None, "fetched_at": None},
        lambda s: s["as-of"] == "" and "proven" not in s["facts"],
    )
    assert "connection refused" in shown()["error"]
    # An answer older than current: said so, and asked again once (the request that found it
    # old set the agent asking, which only the next answer says); then, the agent not asking,
    # the page asks no more.
    old = time.time() - 100
    next_answer(
        "the view not current",
        the_view(old, current=False, age_s=100.0),
        lambda s: "not current" in s["as-of"] and s["error"] == "",
    )
    assert shown()["as-of"].startswith(f"as of {as_of(old)} "), shown()
    assert page.evaluate(
        "document.querySelector('#coordinator-as-of').classList.contains('not-current')"
    )
    before = len(hits)
    with page.expect_response("**/api/coordinator", timeout=30_000):
        page.clock.run_for(2_500)
    drawn = page.get_attribute("#app", "data-state-at")
    page.clock.run_for(6_000)  # the state's refresh is due in this, the coordinator's is not
    wait_for(
        "the state drawn anew", lambda: page.get_attribute("#app", "data-state-at") != drawn, 30
    )
    page.wait_for_timeout(500)
    assert len(hits) == before + 1, "asked again while the agent was not asking"
    page.context.close()

    # The failure on a phone, at the page's own pace: fits and reads.
    page = new_page(browser, PHONE)
    answers.append({**failure, "asking": False})
    page.route("**/api/coordinator", shaped)
    page.goto(console.link())
    wait_for("the failure", lambda: "last known" in shown()["as-of"], 30)
    shot(page, tmp_path, "console-coordinator-failed")
    for width in NARROW:
        page.set_viewport_size({"width": width, "height": 800})
        wait_page(page, f"window.innerWidth === {width}")
        assert sideways(page) == [], f"{width} px: the page scrolls sideways"
    assert severe_violations(page) == []
    page.context.close()
