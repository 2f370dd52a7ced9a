"""The test suite's two tiers under coverage, as CI runs them (``CI=true ./scripts/test``), and
the floors their coverage is held to:

    .venv/bin/python scripts/coverage_tiers.py run [fast] [integration]   # both if none named
    .venv/bin/python scripts/coverage_tiers.py ratchet                    # raise the floors

``run`` runs each tier named, the fast tier (``-m "not integration"``) first, each in a pytest
session of its own under coverage.py, whatever the one before it did: every test runs and every
failure is reported. Then it prints each tier's line coverage of the package and of
flashnode/node/ and flashnode/attempt/, holds those two folders to their floors in
.ci/coverage-floor.json, names the tests that failed in either tier, and ends on one line with
the tests of both tiers counted. It exits non-zero when a tier failed (or ran no test) or a
folder is under its floor.

What is measured is the test process alone: the agents, coordinators, supervisors, helpers and
tasks that the tests start as processes are not (in-process coverage is what this is for: the
fast tier runs nearly everything in-process; the integration tier's number is what its tests
reach in-process, beside the processes they start).

``ratchet`` raises each floor to what the last ``run`` of its tier measured, less the tier's
slack (lines that only some runs reach: threads, timing), and never lowers one; a floor that is
null (not measured yet) is reported but not held until then. Ratchet from a run on a machine
like CI's (root, a Docker engine, no GPU), then commit the file. ``run`` prints what ``ratchet``
would set, so that a CI log's numbers can be copied into the file too.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
# Each tier's coverage data and JUnit report: not under build/, which packaging/build (run by
# the integration tier) removes; the folder ignores itself (a .gitignore of "*" inside).
OUT = ROOT / ".coverage-tiers"
FLOORS = ROOT / ".ci" / "coverage-floor.json"
TIERS = {"fast": ["-m", "not integration"], "integration": ["-m", "integration"]}
FOLDERS = ("flashnode/node/", "flashnode/attempt/")  # held to a floor in each tier
SLACK = {"fast": 0.5, "integration": 1.5}  # points under the measured that ``ratchet`` sets
LEAST_SESSION_S = 300  # a later tier's own limit when the earlier ones took nearly all of it


def session_s() -> int:
    """pytest-timeout's limit for a whole run (pyproject's session_timeout): the tiers share it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return int(config["tool"]["pytest"]["ini_options"]["session_timeout"])


def run_tier(tier: str, deadline: float) -> int:
    """One tier's pytest session under coverage: its exit status."""
    data, report = OUT / f"{tier}.coverage", OUT / f"{tier}.xml"
    data.unlink(missing_ok=True)
    report.unlink(missing_ok=True)
    left = max(int(deadline - time.monotonic()), LEAST_SESSION_S)
    argv = [sys.executable, "-m", "coverage", "run", "-m", "pytest", "-q", *TIERS[tier]]
    argv += [f"--session-timeout={left}", f"--junit-xml={report}"]
    print(f"=== the {tier} tier ({' '.join(TIERS[tier])}), under coverage", flush=True)
    env = {**os.environ, "COVERAGE_FILE": str(data)}
    return subprocess.run(argv, cwd=ROOT, env=env, check=False).returncode


def outcomes(tier: str) -> tuple[dict[str, int], list[str]] | None:
    """The tier's tests passed, failed (errors included) and skipped, and the failed ones' names,
    from its JUnit report; None without one."""
    try:
        root = ET.parse(OUT / f"{tier}.xml").getroot()
    except (OSError, ET.ParseError):
        return None
    n = {"passed": 0, "failed": 0, "skipped": 0}
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            n["failed"] += 1
            failed.append(f"{case.get('classname')}::{case.get('name')}")
        elif case.find("skipped") is not None:
            n["skipped"] += 1
        else:
            n["passed"] += 1
    return n, failed


def measure(*tiers: str) -> dict[str, float] | None:
    """Percent of lines run, of the package and of each of FOLDERS, in the tiers' data together;
    None when a tier has no data."""
    import coverage

    paths = [OUT / f"{tier}.coverage" for tier in tiers]
    if not all(p.exists() for p in paths):
        return None
    cov = coverage.Coverage(data_file=None, config_file=str(ROOT / "pyproject.toml"))
    data = cov.get_data()
    for path in paths:
        one = coverage.CoverageData(basename=str(path))
        one.read()
        data.update(one)
    found: dict[str, float] = {}
    for name, include in (("total", None), *((f, [f"{ROOT}/{f}*"]) for f in FOLDERS)):
        try:
            found[name] = cov.report(include=include, file=io.StringIO())
        except coverage.exceptions.NoDataError:
            found[name] = 0.0
    return found


def ratcheted(tier: str, measured: float) -> float:
    """The floor that ``measured`` allows: less the tier's slack, down to a tenth."""
    return math.floor((measured - SLACK[tier]) * 10) / 10


def load_floors() -> dict[str, dict[str, float | None]]:
    floors: dict[str, dict[str, float | None]] = json.loads(FLOORS.read_text())
    return floors


def summary(tiers: list[str]) -> list[str]:
    """Print each tier's coverage against its floors; the problems found."""
    floors = load_floors()
    problems = []
    width = max(len(f) for f in FOLDERS) + 4
    print("\n=== coverage of the test process (processes the tests start are not measured)")
    print(f"  {'tier':<13}{'package':>8}   " + "".join(f"{f:<{width}}" for f in FOLDERS).rstrip())
    rows = [(t, measure(t)) for t in tiers]
    if len(tiers) > 1:
        rows.append(("both tiers", measure(*tiers)))
    to_raise = []
    for tier, got in rows:
        if got is None:
            print(f"  {tier:<13}  no coverage data")
            problems.append(f"the {tier} tier left no coverage data")
            continue
        cells = []
        for folder in FOLDERS:
            note = ""
            if tier in TIERS:
                floor = floors.get(tier, {}).get(folder)
                note = " (no floor yet)" if floor is None else f" (floor {floor:.1f})"
                if floor is not None and got[folder] < floor:
                    problems.append(
                        f"{folder} is {got[folder]:.1f}% covered by the {tier} tier, under its"
                        f" floor {floor:.1f} in {os.path.relpath(FLOORS, ROOT)}"
                    )
                if floor is None or ratcheted(tier, got[folder]) >= floor + 1.0:
                    to_raise.append(f"{tier} {folder} {ratcheted(tier, got[folder]):.1f}")
            cells.append(f"{f'{got[folder]:.1f}%{note}':<{width}}")
        print(f"  {tier:<13}{got['total']:>7.1f}%   " + "".join(cells).rstrip())
    if to_raise:
        print(
            f"  floors to raise (`.venv/bin/python scripts/coverage_tiers.py ratchet`, or by hand"
            f" in {os.path.relpath(FLOORS, ROOT)}): {', '.join(to_raise)}"
        )
    return problems


def run(tiers: list[str]) -> int:
    OUT.mkdir(exist_ok=True)
    (OUT / ".gitignore").write_text("# scripts/coverage_tiers.py's output\n*\n")
    deadline = time.monotonic() + session_s()
    statuses = {tier: run_tier(tier, deadline) for tier in tiers}
    problems = summary(tiers)
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for tier in tiers:
        found = outcomes(tier)
        if statuses[tier]:
            problems.append(f"the {tier} tier failed (pytest's exit status {statuses[tier]})")
        if found is None:
            problems.append(f"the {tier} tier left no test report")
            continue
        n, failed = found
        problems += [f"{tier} tier: {name}" for name in failed]
        if n["passed"] + n["failed"] == 0:
            problems.append(f"the {tier} tier ran no test")
        total = {k: total[k] + n[k] for k in total}
    for problem in problems:
        print(f"FAILED: {problem}")
    print(f"tests: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 1 if problems else 0


def ratchet() -> int:
    floors = load_floors()
    for tier in TIERS:
        got = measure(tier)
        if got is None:
            print(f"{tier}: no measurement in {os.path.relpath(OUT, ROOT)}/ (`run {tier}` first)")
            continue
        tier_floors = floors.setdefault(tier, {})
        for folder in FOLDERS:
            old, new = tier_floors.get(folder), ratcheted(tier, got[folder])
            if old is None or new > old:
                tier_floors[folder] = new
                print(f"{tier} {folder}: {got[folder]:.1f}% measured, floor {old} -> {new:.1f}")
            else:
                print(f"{tier} {folder}: {got[folder]:.1f}% measured, floor stays {old:.1f}")
    FLOORS.write_text(json.dumps(floors, indent=2) + "\n")
    return 0


def main(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "run" and set(rest) <= set(TIERS):
        return run([t for t in TIERS if t in rest] if rest else list(TIERS))
    if command == "ratchet" and not rest:
        return ratchet()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
