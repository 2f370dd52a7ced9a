"""Many machines: the Grafana dashboard and the Prometheus alert rules shipped in the package's
doc dir (docs/monitoring/) are well formed, and every series they query is one the agent exports:
against a registry fed every call here, and against a live agent's /metrics (integration)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from harness import AgentProcess, CoordinatorServer, argv_job, free_port, wait_for
from prometheus_client.parser import text_string_to_metric_families

from flashnode.owner.metrics import HELD_RULES, Metrics

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "docs" / "monitoring"
DASHBOARD = MONITORING / "flashnode-dashboard.json"
ALERTS = MONITORING / "flashnode-alerts.yml"

# Not series: PromQL's keywords and aggregation operators (a function is any word before "(").
KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count",
    "count_values", "bottomk", "topk", "quantile",
}  # fmt: skip
PROMETHEUS_OWN = {"up"}  # the series Prometheus writes for every target it scrapes


def metric_names(expr: str) -> set[str]:
    """The series a PromQL expression reads: every name left once strings, ranges, dashboard
    variables, label matchers and label lists are taken out, less keywords and functions."""
    e = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\$\{?\w+\}?", "", e)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", e)
    names = set()
    for m in re.finditer(r"(?<![\w.:])[A-Za-z_:][\w:]*", e):
        if m.group() in KEYWORDS or e[m.end() :].lstrip().startswith("("):
            continue
        names.add(m.group())
    return names


def test_the_scan_finds_series_and_nothing_else() -> None:
    expr = (
        "histogram_quantile(0.9, sum by (le, result) (rate(flashnode_claim_duration_seconds_"
        'bucket{job=~"$job", instance=~"${instance}"}[$__rate_interval]))) > 1e3 '
        "and on (instance) flashnode_paused == 0 unless on (job) up offset 5m or vector(0)"
    )
    assert metric_names(expr) == {
        "flashnode_claim_duration_seconds_bucket",
        "flashnode_paused",
        "up",
    }


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(within: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel but the rows, those inside a collapsed row too."""
    for p in within:
        if p.get("type") == "row":
            yield from panels(p.get("panels", []))
        else:
            yield p


def rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(ALERTS.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def used_by_dashboard() -> dict[str, set[str]]:
    """Each panel's title: the series its targets read."""
    used = {}
    for p in panels(dashboard()["panels"]):
        used[p["title"]] = {n for t in p["targets"] for n in metric_names(t["expr"])}
    return used


def used_by_alerts() -> dict[str, set[str]]:
    return {rule["alert"]: metric_names(rule["expr"]) for rule in rules()}


def everything_used() -> set[str]:
    return set().union(*used_by_dashboard().values(), *used_by_alerts().values())


def exported(text: str) -> set[str]:
    """The series names of an exposition that carry a sample."""
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def missing(text: str) -> set[str]:
    return everything_used() - exported(text) - PROMETHEUS_OWN


# --- the dashboard -----------------------------------------------------------------------------


def test_the_dashboard_is_importable_with_a_datasource_and_a_node_variable() -> None:
    d = dashboard()
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert d["title"] and d["uid"] and "id" not in d  # imported anywhere, never overwriting
    variables = {v["name"]: v for v in d["templating"]["list"]}
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    for name in ("job", "instance"):
        v = variables[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"], name
        assert v["datasource"]["uid"] == "${datasource}"
        assert "label_values(flashnode_info" in v["definition"], name
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))


def test_every_panel_queries_the_chosen_datasource_and_nodes() -> None:
    for p in panels(dashboard()["panels"]):
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            # every selector keeps to the nodes chosen above
            for selector in re.findall(r"\b(?:flashnode_\w+|up)(\{[^}]*\}|)", t["expr"]):
                assert 'instance=~"$instance"' in selector, (p["title"], t["expr"])
                assert 'job=~"$job"' in selector, (p["title"], t["expr"])


def test_every_panel_reads_at_least_one_series_and_only_flashnodes_or_up() -> None:
    for title, names in used_by_dashboard().items():
        assert names, f"panel {title!r} queries no series"
        assert all(n.startswith("flashnode_") or n in PROMETHEUS_OWN for n in names), title


def test_the_dashboard_shows_what_an_owner_of_many_machines_looks_for() -> None:
    used = set().union(*used_by_dashboard().values())
    for series in (
        "up",
        "flashnode_claiming_held",
        "flashnode_running_attempts",
        "flashnode_suspended_attempts",
        "flashnode_attempts_total",
        "flashnode_attempt_duration_seconds_bucket",
        "flashnode_coordinator_errors_total",
        "flashnode_coordinator_failing",
        "flashnode_uploaded_bytes_total",
        "flashnode_downloaded_bytes_total",
        "flashnode_task_cpu_percent_sum",
        "flashnode_task_gpu_percent_sum",
        "flashnode_info",
    ):
        assert series in used, series


# --- the alert rules ---------------------------------------------------------------------------

DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def test_every_alert_rule_is_well_formed() -> None:
    data = yaml.safe_load(ALERTS.read_text())
    assert [set(g) for g in data["groups"]] == [{"name", "rules"}] * len(data["groups"])
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names)), names
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"Flashnode[A-Z]\w+", rule["alert"])
        assert isinstance(rule["expr"], str) and rule["expr"].count("(") == rule["expr"].count(")")
        assert DURATION.match(rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        notes = rule["annotations"]
        assert notes["summary"] and "{{ $labels.instance }}" in notes["summary"], rule["alert"]
        # each says what to run on the node
        assert (
            "`flashnode status`" in notes["description"]
            or "`flashnode doctor`" in notes["description"]
        ), rule["alert"]
        assert metric_names(rule["expr"]), rule["alert"]


def test_the_alerts_cover_the_ways_a_node_stops_working() -> None:
    exprs = {rule["alert"]: rule["expr"] for rule in rules()}
    assert "up" in used_by_alerts()["FlashnodeDown"]
    assert 'flashnode_claiming_held{rule="quarantine"}' in exprs["FlashnodeQuarantined"]
    assert 'flashnode_claiming_held{rule="disk"}' in exprs["FlashnodeDiskHold"]
    assert 'flashnode_claiming_held{rule="credentials"}' in exprs["FlashnodeCredentialsRefused"]
    assert "flashnode_coordinator_failing" in exprs["FlashnodeCoordinatorUnreachable"]
    assert "flashnode_status_published_timestamp_seconds" in exprs["FlashnodeStatusStale"]
    assert "flashnode_last_attempt_finished_timestamp_seconds" in exprs["FlashnodeNoWork"]
    held = set(re.findall(r'flashnode_claiming_held\{rule="(\w+)"\}', ALERTS.read_text()))
    assert held <= set(HELD_RULES)


# --- what they read is exported ----------------------------------------------------------------


def test_every_series_they_read_is_one_the_agents_registry_exports() -> None:
    m = Metrics()
    m.attempt_finished("committed", 12.5, cpu_percent=30.0, gpu_percent=40.0)
    m.claim_finished(0.02, "work")
    m.coordinator_error("node heartbeat")
    m.coordinator_working("node heartbeat")
    m.status_published()
    assert not missing(m.exposition().decode())


def test_the_package_ships_them_beside_the_books() -> None:
    nfpm = (ROOT / "packaging" / "nfpm.yaml").read_text()
    manifest = (ROOT / "MANIFEST.in").read_text()
    for path in (DASHBOARD, ALERTS):
        rel = path.relative_to(ROOT)
        assert f"src: {rel}\n    dst: /usr/share/doc/flashnode/{rel}\n" in nfpm, rel
    assert "recursive-include docs/monitoring *.json *.yml" in manifest


# --- against a live agent ----------------------------------------------------------------------


def test_every_series_they_read_is_on_a_live_agents_metrics_once_it_worked(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = coordinator.submit(
        argv_job(
            [
                "python3",
                "-c",
                "import sys; open(sys.argv[1], 'w').write('{}')",
                "/work/out/metrics.json",
            ]
        )
    )
    address = f"127.0.0.1:{free_port()}"
    agent = start_agent(
        coordinator.url,
        "--runner",
        "trusted",
        "--pool",
        "team-a",
        env={"FLASHNODE_METRICS_LISTEN": address, "FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5"},
    )
    agent.wait_log(f"metrics served at {address}")
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, timeout=120) == "SUCCEEDED"
    assert agent.wait_ledger()[-1]["outcome"] == "committed"

    def scraped() -> str | None:
        text = httpx.get(f"http://{address}/metrics", timeout=5).text
        return text if 'flashnode_attempts_total{outcome="committed"} 1.0' in text else None

    text = wait_for("the attempt counted", scraped, timeout=10)
    assert not missing(text), sorted(missing(text))
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    # the timestamps are set, and the loop keeps publishing
    for name in (
        "flashnode_start_time_seconds",
        "flashnode_status_published_timestamp_seconds",
        "flashnode_last_attempt_finished_timestamp_seconds",
    ):
        assert values[name] > 1.6e9, name
    assert (
        values["flashnode_last_attempt_finished_timestamp_seconds"]
        >= values["flashnode_start_time_seconds"]
    )
    assert not [
        s
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "flashnode_coordinator_failing" and s.value != 0
    ]
