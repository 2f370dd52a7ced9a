"""The test suite's two tiers under coverage, as CI runs them (``CI=true ./scripts/test``), and
the floors their coverage is held to:

    .venv/bin/python scripts/coverage_tiers.py run [fast] [integration]   # both if none named
    .venv/bin/python scripts/coverage_tiers.py ratchet                    # raise the floors

``run`` runs each tier named, the fast tier (``-m "not integration"``) first, each in a pytest
session of its own under coverage.py, whatever the one before it did: every test runs and every
failure is reported. Then it prints each tier's line coverage of the package and of
flashnode/node/ and flashnode/attempt/, holds those two folders to their floors in
.ci/coverage-floor.json, and ends on one line with the tests of both tiers counted. It exits
non-zero when a tier failed (or ran no test) or a folder is under its floor.

What is measured is the test process alone: the agents, coordinators, supervisors, helpers and
tasks that the tests start as processes are not (in-process coverage is what this is for: the
fast tier runs nearly everything in-process; the integration tier's number is what its tests
reach in-process, beside the processes they start).

``ratchet`` raises each floor to what the last ``run`` of its tier measured, less the tier's
slack (lines that only some runs reach: threads, timing), and never lowers one; a floor that is
null (not measured yet) is reported but not enforced until then. Ratchet from a run on a
machine like CI's (root, a Docker engine, no GPU), then commit the file.
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

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "coverage"  # each tier's coverage data and JUnit report (ignored by git)
FLOORS = ROOT / ".ci" / "coverage-floor.json"
TIERS = {"fast": ["-m", "not integration"], "integration": ["-m", "integration"]}
FOLDERS = ("flashnode/node/", "flashnode/attempt/")  # held to a floor in each tier
SLACK = {"fast": 0.5, "integration": 1.5}  # points under the measured that ``ratchet`` sets
SESSION_S = 4200  # both tiers together, as pyproject's session_timeout is for one whole run
LEAST_SESSION_S = 600  # a later tier's own limit when the earlier ones took nearly all of it


def run_tier(tier: str, deadline: float) -> int:
    """One tier's pytest session under coverage: its exit status."""
    data, report = OUT / tier, OUT / f"{tier}.xml"
    data.unlink(missing_ok=True)
    report.unlink(missing_ok=True)
    left = max(int(deadline - time.monotonic()), LEAST_SESSION_S)
    argv = [sys.executable, "-m", "coverage", "run", "-m", "pytest", "-q", *TIERS[tier]]
    argv += [f"--session-timeout={left}", f"--junit-xml={report}"]
    print(f"=== the {tier} tier ({' '.join(TIERS[tier])}), under coverage", flush=True)
    env = {**os.environ, "COVERAGE_FILE": str(data)}
    return subprocess.run(argv, cwd=ROOT, env=env, check=False).returncode


def counts(tier: str) -> dict[str, int] | None:
    """The tier's tests passed, failed (errors included) and skipped, from its JUnit report."""
    try:
        suite = ET.parse(OUT / f"{tier}.xml").getroot()
    except (OSError, ET.ParseError):
        return None
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")  # type: ignore[assignment]
    if suite is None:
        return None
    n = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    failed = n["failures"] + n["errors"]
    return {"passed": n["tests"] - failed - n["skipped"], "failed": failed, "skipped": n["skipped"]}


def measure(*tiers: str) -> dict[str, float] | None:
    """Percent of lines run, of the package and of each of FOLDERS, in the tiers' data together;
    None when a tier has no data."""
    import coverage

    paths = [OUT / tier for tier in tiers]
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


def load_floors() -> dict[str, dict[str, float | None]]:
    floors: dict[str, dict[str, float | None]] = json.loads(FLOORS.read_text())
    return floors


def summary(tiers: list[str], statuses: dict[str, int]) -> list[str]:
    """Print each tier's coverage against its floors; the problems found."""
    floors = load_floors()
    problems = [
        f"the {t} tier failed (pytest exit status {rc})" for t, rc in statuses.items() if rc
    ]
    width = max(len(f) for f in FOLDERS) + 20
    print("\n=== coverage of the test process (processes the tests start are not measured)")
    print(f"  {'tier':<13}{'package':>8}   " + "".join(f"{f:<{width}}" for f in FOLDERS))
    rows = [(t, measure(t)) for t in tiers]
    if len(tiers) > 1:
        rows.append(("both tiers", measure(*tiers)))
    raisable = False
    for tier, got in rows:
        if got is None:
            print(f"  {tier:<13}  no coverage data")
            problems.append(f"the {tier} tier left no coverage data")
            continue
        cells = []
        for folder in FOLDERS:
            floor = floors.get(tier, {}).get(folder) if tier in TIERS else None
            note = " (no floor yet)" if tier in TIERS and floor is None else ""
            if floor is not None:
                note = f" (floor {floor:.1f})"
                if got[folder] < floor:
                    problems.append(
                        f"{folder} is {got[folder]:.1f}% covered by the {tier} tier, under its"
                        f" floor {floor:.1f} in {FLOORS.relative_to(ROOT)}"
                    )
                raisable |= got[folder] - SLACK[tier] >= floor + 1.0
            cells.append(f"{f'{got[folder]:.1f}%{note}':<{width}}")
        print(f"  {tier:<13}{got['total']:>7.1f}%   " + "".join(cells))
    if raisable:
        print(
            "  (a floor is a point or more under what this run measured: raise them with"
            " `.venv/bin/python scripts/coverage_tiers.py ratchet` and commit the file)"
        )
    return problems


def run(tiers: list[str]) -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + SESSION_S
    statuses = {tier: run_tier(tier, deadline) for tier in tiers}
    problems = summary(tiers, statuses)
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for tier in tiers:
        n = counts(tier)
        if n is None:
            problems.append(f"the {tier} tier left no test report")
            continue
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
            print(f"{tier}: no measurement in {OUT.relative_to(ROOT)}/ (`run {tier}` first)")
            continue
        tier_floors = floors.setdefault(tier, {})
        for folder in FOLDERS:
            old = tier_floors.get(folder)
            new = math.floor((got[folder] - SLACK[tier]) * 10) / 10
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
