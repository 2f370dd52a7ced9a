"""flashruntime's own task contract, end to end: scripts written from flashruntime's
documentation alone (nothing in them knows flashnode) run on the real coordinator and real
agents, in both runners, and resume across nodes; a result the coordinator would refuse fails on
the node with the coordinator's reason before anything but the logs is uploaded."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import pwd
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import AgentProcess, CoordinatorServer, argv_job, shared_dir, wait_for
from localhttp import LocalHTTPServer

from flashnode.coordinator import validators
from flashnode.sandbox import procs
from flashnode.sandbox.procs import helpers

TASK_PYTHON = os.environ.get("FLASHNODE_TEST_TASK_PYTHON", "/opt/flashnode-task-venv/bin/python")
POOL = "team-contract"
TRUSTED = ("--runner", "trusted", "--pool", POOL)
FAST = {
    "FLASHNODE_CLAIM_BACKOFF_MAX_SECONDS": "0.5",
    "FLASHNODE_CHECKPOINT_SCAN_SECONDS": "0.5",
    "FLASHNODE_TASK_PYTHON": TASK_PYTHON,
}


def latest(server: CoordinatorServer, job: str, task: str = "task-000") -> dict[str, Any] | None:
    r = server.http.get(f"/jobs/{job}/tasks/{task}/checkpoints/latest")
    return dict(r.json()) if r.status_code == 200 else None


def only_line(agent: AgentProcess) -> dict[str, Any]:
    [line] = wait_for("the attempt in the ledger", agent.ledger)
    return line


def part_names(manifest: dict[str, Any]) -> dict[str, str]:
    """The parts of a committed checkpoint: file name -> the key's path below the output
    prefix."""
    return {p["key"].rsplit("/", 1)[1]: p["key"] for p in manifest["parts"]}


# --- the variables and the working directory -------------------------------------------------

CONTRACT = r"""
mkdir -p "$FLASHML_CKPT_DIR/step-000001" && echo scratch > "$FLASHML_CKPT_DIR/step-000001/a"
printf '{"pwd": "%s", "out": "%s", "ckpt": "%s", "job": "%s", "attempt": "%s"}' "$(pwd -P)" \
  "$FLASHML_OUTPUT_DIR" "$FLASHML_CKPT_DIR" "$FLASHML_JOB_ID" "$FLASHML_ATTEMPT_ID" > metrics.json
"""


def test_a_trusted_task_starts_in_its_output_directory_with_flashruntimes_variables(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    """And, its payload carrying no `checkpoint`, what it writes into its checkpoint directory is
    scratch: neither relayed nor uploaded."""
    job = coordinator.submit(argv_job(["sh", "-c", CONTRACT], pool=POOL, max_attempts=1))
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    report = json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))
    assert report["out"] == report["pwd"] and report["pwd"].endswith("/out")
    assert report["ckpt"] == report["out"] + "/ckpt"
    assert (report["job"], report["attempt"]) == (job, only_line(agent)["lease_id"])
    assert coordinator.artifacts(job) == [f"jobs/{job}/task-000/metrics.json"]
    assert latest(coordinator, job) is None


# --- 1. flashruntime.torch: crash on node A after the third checkpoint, resume on node B -------

# Written from the torch-helper reference's "usage shape" alone: prepare, checkpoint every N
# steps, log_metrics, metrics.json into the working directory. A fresh run given a step dies
# right after that step's checkpoint (the stand-in for a machine lost mid-training).
TRAIN = """
import json, sys
import torch
import flashruntime.torch as ft

crash_after = int(sys.argv[1]) if len(sys.argv) > 1 else 0
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
gen = torch.Generator().manual_seed(1)
x = torch.randn(64, 4, generator=gen)
y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
model, opt, _ = ft.prepare(model, opt)
start = ft.start_step()
for step in range(start + 1, 61):
    i = (step * 8) % 64
    loss = torch.nn.functional.mse_loss(model(x[i : i + 8]), y[i : i + 8])
    opt.zero_grad()
    loss.backward()
    opt.step()
    ft.log_metrics({"step": step, "loss": loss.item()})
    ft.checkpoint(model, opt, step=step, every=10)
    if start == 0 and step == crash_after:
        sys.exit(3)
weights = {k: [v.hex() for v in t.flatten().tolist()] for k, t in model.state_dict().items()}
json.dump({"start_step": start, "loss": loss.item(), "weights": weights}, open("metrics.json", "w"))
"""


@pytest.mark.usefixtures("task_python")
def test_a_torch_helper_script_crashed_on_one_node_resumes_on_another_bit_for_bit(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess], tmp_path: Path
) -> None:
    job = coordinator.submit(
        argv_job(
            [TASK_PYTHON, "-c", TRAIN, "30"],
            pool=POOL,
            checkpoint={"interval_seconds": 60},
            max_attempts=2,
        )
    )
    node_a = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST, name="a")
    assert node_a.wait(120) == 0, node_a.log
    first = only_line(node_a)
    assert first["outcome"] == "failed" and "exit code 3" in first["reason"], first
    assert first["checkpoint_step"] == 30, first
    shipped = latest(coordinator, job)
    assert shipped is not None and shipped["step"] == 30, shipped
    assert shipped["attempt_id"] == first["lease_id"]
    assert shipped["framework"].startswith("pytorch-") and shipped["world_size"] == 1
    names = part_names(shipped)
    assert sorted(names) == ["manifest.json", "model.pt", "optimizer.pt"], names
    assert names["model.pt"].endswith(f"/ckpt/{first['lease_id']}/30/step-000030/model.pt")

    node_b = start_agent(coordinator.url, *TRUSTED, env=FAST, name="b")
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}, 120) == "SUCCEEDED", node_b.log
    node_b.wait_log("resuming from step 30")
    second = only_line(node_b)
    assert second["outcome"] == "committed" and second["resumed_from_step"] == 30, second

    # The same script, uninterrupted, under flashruntime's own defaults.
    out = tmp_path / "reference"
    out.mkdir()
    env = {"PATH": os.environ["PATH"], "FLASHML_OUTPUT_DIR": str(out)}
    subprocess.run([TASK_PYTHON, "-c", TRAIN], cwd=out, env=env, check=True, timeout=120)
    reference = json.loads((out / "metrics.json").read_text())
    got = json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))
    assert got["start_step"] == 30 and reference["start_step"] == 0
    assert got["weights"] == reference["weights"]  # every float, bit for bit
    # log_metrics' file is an output like any other: the resumed attempt's steps.
    logged = coordinator.artifact(f"jobs/{job}/task-000/metrics.jsonl").decode().splitlines()
    assert [json.loads(line)["step"] for line in logged] == list(range(31, 61))
    final = latest(coordinator, job)
    assert final is not None and final["step"] == 60 and final["attempt_id"] == second["lease_id"]
    # Checkpoints are not outputs: nothing of them outside the relay's keys.
    outputs = {
        k.split("/", 3)[3] for k in coordinator.artifacts(job) if k.split("/")[3] != "ckpt"
    } - {"logs/stdout.txt", "logs/stderr.txt"}
    assert outputs == {"metrics.json", "metrics.jsonl", "ranks/rank-0.json"}, outputs


# --- 2. the docker runner: the same contract, a script that writes manifests itself ------------

# No python in the test image: a shell script that checkpoints the way write_manifest does (parts
# first, the manifest last) and resumes the way latest_valid_manifest picks (the newest step-*
# with a manifest, its files at the manifest's storage_prefix). It sums k*k for k = 1..6.
BOX = r"""
bb=/bin/busybox
ckpt=$FLASHML_CKPT_DIR latest= step=0 total=0 start=0 deleted=false
for d in "$ckpt"/step-*; do [ -f "$d/manifest.json" ] && latest=$d; done
if [ -n "$latest" ]; then
  prefix=$($bb sed -n 's/.*"storage_prefix": "\([^"]*\)".*/\1/p' "$latest/manifest.json")
  step=$(cat "$prefix/step.txt") total=$(cat "$prefix/total.txt") start=$step
  mine=$([ "$($bb stat -c %u "$prefix/total.txt")" = "$(id -u)" ] && echo true || echo false)
fi
checkpoint() {
  d=$ckpt/step-$(printf %06d "$step")
  mkdir -p "$d"
  echo "$step" > "$d/step.txt"
  echo "$total" > "$d/total.txt"
  parts=
  for f in step.txt total.txt; do
    set -- $($bb sha256sum "$d/$f")
    parts="$parts${parts:+, }{\"key\": \"$f\", \"sha256\": \"$1\", \"size_bytes\": $(wc -c < "$d/$f")}"
  done
  printf '{"manifest_id": "ck-box", "job_id": "%s", "attempt_id": "%s", "step": %d, "framework": "busybox-sh", "world_size": 1, "storage_prefix": "%s", "parts": [%s], "validation": "hash_verified"}' \
    "$FLASHML_JOB_ID" "$FLASHML_ATTEMPT_ID" "$step" "$d" "$parts" > "$d/manifest.json"
}
while [ "$step" -lt 6 ]; do
  step=$((step + 1)) total=$((total + step * step))
  checkpoint
  [ -z "$latest" ] && [ "$step" -eq 3 ] && exit 3
done
[ -n "$latest" ] && $bb rm -r "$latest" && deleted=true
printf '{"pwd": "%s", "out": "%s", "ckpt": "%s", "job": "%s", "attempt": "%s", "resumed_from": "%s", "prefix": "%s", "start": %d, "total": %d, "mine": %s, "deleted": %s}' \
  "$(pwd)" "$FLASHML_OUTPUT_DIR" "$ckpt" "$FLASHML_JOB_ID" "$FLASHML_ATTEMPT_ID" "$latest" \
  "$prefix" "$start" "$total" "${mine:-false}" "$deleted" > metrics.json
"""


def test_the_docker_runner_gives_the_same_contract_and_resumes_a_manifest_checkpoint(
    box: str, coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    from boxes import box_job, start, unique

    job = coordinator.submit(
        box_job(["sh", "-c", BOX], image=box, checkpoint={"interval_seconds": 30}, max_attempts=2)
    )
    env = {"FLASHNODE_CHECKPOINT_SCAN_SECONDS": "0.5"}
    agent = start(start_agent, coordinator.url, unique("contract"), "--max-tasks", "2", env=env)
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    first, second = agent.ledger()
    assert first["outcome"] == "failed" and first["checkpoint_step"] == 3, first
    assert second["outcome"] == "committed" and second["resumed_from_step"] == 3, second
    report = json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))
    assert report == {
        "pwd": "/work/out",
        "out": "/work/out",
        "ckpt": "/work/out/ckpt",
        "job": job,
        "attempt": second["lease_id"],
        "resumed_from": "/work/out/ckpt/step-000003",
        "prefix": "/work/out/ckpt/step-000003",  # its storage_prefix holds where it was restored
        "start": 3,
        "total": sum(k * k for k in range(1, 7)),  # as an uninterrupted run
        "mine": True,  # the container's user owns what was restored
        "deleted": True,  # and may delete it
    }
    final = latest(coordinator, job)
    assert final is not None and final["step"] == 6 and final["framework"] == "busybox-sh"
    assert sorted(part_names(final)) == ["manifest.json", "step.txt", "total.txt"]


# --- 3. a Hugging Face style checkpoint-N/ with its manifest ----------------------------------

# What the Hugging Face guide's Trainer does with flashruntime's callback, without transformers:
# the Trainer saves checkpoint-<global_step>/ into its output_dir, flashruntime_callback's
# on_save writes the manifest, and a restarted run resumes from fr_hf.latest_checkpoint(...).
HF = """
import json, os, shutil, sys
from pathlib import Path
from flashruntime.checkpoint.local import write_manifest
from flashruntime.integrations import huggingface as fr_hf

output_dir = Path(os.environ["FLASHML_CKPT_DIR"])
resume = fr_hf.latest_checkpoint(output_dir)  # trainer.train(resume_from_checkpoint=resume)
step, total, deleted = 0, 0.0, False
if resume:
    state = json.loads((Path(resume) / "trainer_state.json").read_text())
    step, total = state["global_step"], state["total"]
    shutil.rmtree(resume)  # what save_total_limit's rotation does once newer ones exist
    deleted = not os.path.exists(resume)
start = step
while step < 5:
    step += 1
    total += step * 0.5
    d = output_dir / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "total": total}))
    (d / "model.safetensors").write_bytes(bytes([step]) * 4096)
    write_manifest(
        d,
        job_id=os.environ.get("FLASHML_JOB_ID", "local"),
        attempt_id=os.environ.get("FLASHML_ATTEMPT_ID", "local"),
        step=step,
        framework="transformers",
    )
    if resume is None and step == 3:
        sys.exit(3)
json.dump(
    {"resumed_from": resume, "ckpt": str(output_dir), "start": start, "total": total,
     "deleted": deleted},
    open("metrics.json", "w"),
)
"""


@pytest.mark.usefixtures("task_python")
def test_a_hugging_face_checkpoint_directory_is_relayed_and_restored_for_latest_checkpoint(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    job = coordinator.submit(
        argv_job(
            [TASK_PYTHON, "-c", HF], pool=POOL, checkpoint={"interval_seconds": 60}, max_attempts=2
        )
    )
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "2", env=FAST)
    assert agent.wait(90) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "SUCCEEDED", agent.log
    first, second = agent.ledger()
    assert first["outcome"] == "failed" and first["checkpoint_step"] == 3, first
    assert second["outcome"] == "committed" and second["resumed_from_step"] == 3, second
    report = json.loads(coordinator.artifact(f"jobs/{job}/task-000/metrics.json"))
    assert report["resumed_from"] == os.path.join(report["ckpt"], "checkpoint-3")
    assert report["start"] == 3 and report["total"] == 7.5 and report["deleted"] is True
    final = latest(coordinator, job)
    assert final is not None and final["step"] == 5 and final["framework"] == "transformers"
    names = part_names(final)
    assert sorted(names) == ["manifest.json", "model.safetensors", "trainer_state.json"]
    assert names["manifest.json"].endswith(
        f"/ckpt/{second['lease_id']}/5/checkpoint-5/manifest.json"
    )


# --- 5. declared validators: refused on the node, with the coordinator's reason ----------------

REFUSED = "echo '{\"loss\": 0.5}' > metrics.json; echo notes > notes.txt; echo trained"


def test_a_result_missing_a_declared_key_fails_with_the_coordinators_reason_uploading_only_logs(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    from flashruntime.validators import validator_problem

    declared = {"keys": ["loss", "accuracy"]}
    job = coordinator.submit(
        argv_job(["sh", "-c", REFUSED], pool=POOL, validators=declared, max_attempts=1)
    )
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED"
    reason = validator_problem(declared, {"loss": 0.5})
    assert reason == (
        "metrics.json is missing required key(s) ['accuracy'] (declared by the job's 'keys'"
        " validator)"
    )
    [failed] = [e for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert failed["message"] == reason
    assert only_line(agent)["reason"] == reason
    assert coordinator.artifacts(job) == [f"jobs/{job}/task-000/logs/stdout.txt"]


def test_a_result_against_a_declared_json_schema_fails_with_the_coordinators_reason(
    coordinator: CoordinatorServer, start_agent: Callable[..., AgentProcess]
) -> None:
    from flashruntime.validators import validator_problem

    declared = {"json_schema": {"properties": {"loss": {"type": "number"}}, "required": ["loss"]}}
    job = coordinator.submit(
        argv_job(
            ["sh", "-c", 'echo \'{"loss": "low"}\' > metrics.json'],
            pool=POOL,
            validators=declared,
            max_attempts=1,
        )
    )
    agent = start_agent(coordinator.url, *TRUSTED, "--max-tasks", "1", env=FAST)
    assert agent.wait(60) == 0, agent.log
    assert coordinator.wait_state(job, {"SUCCEEDED", "FAILED"}) == "FAILED"
    reason = validator_problem(declared, {"loss": "low"})
    assert reason is not None and "at loss: 'low' is not of type 'number'" in reason
    [failed] = [e for e in coordinator.events(job) if e["type"] == "TASK_ATTEMPT_FAILED"]
    assert failed["message"] == reason
    assert coordinator.artifacts(job) == []  # the task printed nothing: not even logs


def test_a_schema_that_backtracks_without_end_neither_holds_the_agent_nor_reaches_the_coordinator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job's `pattern` that backtracks catastrophically on its own metrics: checked in the
    agent's process it would hold the interpreter's lock (every lease keeper, the main loop)
    for as long as it runs; the helper process is stopped after its time and the attempt fails
    with a reason, instead of the coordinator being held by the same check."""
    monkeypatch.setattr(helpers, "SCHEMA_CHECK_S", 3.0)
    schema = {"properties": {"tag": {"type": "string", "pattern": "^(a+)+$"}}}
    ticks = [0]
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.05)

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.monotonic()
    try:
        reason = helpers.json_schema_problem(schema, {"tag": "a" * 64 + "!"})
    finally:
        done.set()
        ticker.join()
    took = time.monotonic() - started
    assert reason == (
        "metrics.json could not be checked against the declared json_schema within 3 s"
    )
    assert took < 10 and ticks[0] >= took / 0.05 * 0.5, (took, ticks)


# --- 6. a declared schema is the job's: what the node's check of it can reach -----------------


@pytest.fixture(scope="session")
def packaged_python() -> Iterator[str]:
    """An interpreter laid out as the package's: a venv of ``/usr/bin/python3`` (a standard
    library every user can read), given this interpreter's jsonschema by a ``.pth`` file. The
    helper takes its user before it imports what jsonschema imports on first use (urllib, for a
    remote ``$ref``), and the tests' own interpreter may keep its standard library where only
    root can read (pyenv under /root)."""
    import jsonschema

    base = Path("/usr/bin/python3")
    if not base.exists():
        pytest.skip("needs /usr/bin/python3")
    top = shared_dir("flashnode-schema-py-")
    top.chmod(0o755)
    try:
        venv = top / "venv"
        subprocess.run([str(base), "-m", "venv", "--without-pip", str(venv)], check=True)
        [site] = venv.glob("lib/python*/site-packages")
        (site / "tests-jsonschema.pth").write_text(f"{Path(jsonschema.__file__).parent.parent}\n")
        python = str(venv / "bin" / "python")
        try:
            helper = procs.helper_user()
        except LookupError as exc:
            pytest.skip(f"{exc} (scripts/task-users makes it)")
        assert helper is not None
        as_helper = ["setpriv", f"--reuid={helper.uid}", f"--regid={helper.gid}", "--clear-groups"]
        imports = "import jsonschema, referencing, urllib.request"
        probe = subprocess.run([*as_helper, "--", python, "-I", "-c", imports], cwd="/")
        if probe.returncode != 0:
            pytest.skip(f"{helper.name} cannot import jsonschema with {base}")
        yield python
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def helper_python(packaged_python: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The helper's interpreter (``sys.executable``, the agent's), as the package lays it out."""
    monkeypatch.setattr(sys, "executable", packaged_python)
    return packaged_python


@pytest.fixture
def private_service() -> Iterator[tuple[str, list[str]]]:
    """A service on the owner's loopback (a router page, a metadata service): JSON with a key."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            body = json.dumps({"SecretAccessKey": "owner-secret"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = LocalHTTPServer(("127.0.0.1", 0), Handler).start()
    try:
        yield server.url, seen
    finally:
        server.close()


@pytest.mark.usefixtures("as_root")
def test_a_jobs_json_schema_never_makes_the_node_fetch_from_the_owners_network(
    private_service: tuple[str, list[str]], helper_python: str
) -> None:
    """A job's schema names a ``$ref`` on the owner's network (a router page, the cloud's
    metadata service at 169.254.169.254): jsonschema would retrieve it, and the reason would
    quote what came back. The node fetches nothing (a $ref outside the schema is left to the
    coordinator) and tells the job nothing of the owner's."""
    url, seen = private_service
    schema = {"properties": {"a": {"$ref": f"{url}/latest/meta-data/creds.json#/Nope"}}}
    try:
        reason = helpers.json_schema_problem(schema, {"a": 1})
    except validators.Unchecked as exc:
        reason = str(exc)
    assert seen == [], f"the node fetched {seen} for the job"
    assert reason is not None and "owner-secret" not in reason, reason
    with pytest.raises(validators.Unchecked, match="outside itself"):
        helpers.json_schema_problem(schema, {"a": 1})


@pytest.mark.usefixtures("as_root")
def test_the_schema_check_runs_with_no_network(
    private_service: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the helper process ran, it could reach no address: not the owner's loopback,
    not the LAN (a network namespace of its own)."""
    url, seen = private_service
    port = int(url.rsplit(":", 1)[1])
    probe = (
        "import json, socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=5).close()\n"
        "    got = 'reached the owner'\n"
        "except OSError:\n"
        "    got = None\n"
        "print(json.dumps({'problem': got}))\n"
    )
    monkeypatch.setattr(validators, "SCHEMA_HELPER", probe)
    assert helpers.json_schema_problem({"type": "object"}, {}) is None
    assert seen == []


def _uids(pid: int) -> set[int]:
    """The real, effective, saved and file system uids of a live process (empty when gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return {int(u) for u in line.split()[1:]}
    return set()


@pytest.mark.usefixtures("as_root")
def test_the_schema_check_runs_as_a_user_of_its_own(
    helper_python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The helper runs as ``flashnode-helper``, which no build, task or host daemon runs as (not
    ``nobody``): nothing a job's build left behind can signal, freeze or trace it."""
    helper, build = pwd.getpwnam("flashnode-helper"), pwd.getpwnam("flashnode-build")
    assert len({helper.pw_uid, build.pw_uid, 65534}) == 3
    monkeypatch.setattr(helpers, "SCHEMA_CHECK_S", 5.0)
    slow = {"properties": {"tag": {"type": "string", "pattern": "^(a+)+$"}}}
    seen: set[int] = set()

    def check() -> None:
        helpers.json_schema_problem(slow, {"tag": "a" * 64 + "!"})

    def helper_seen() -> bool:
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if entry.name.isdigit() and b"SchemaError" in (entry / "cmdline").read_bytes():
                    seen.update(_uids(int(entry.name)) - {0})
        return bool(seen)

    thread = threading.Thread(target=check)
    thread.start()
    try:
        wait_for("the helper to take its user", helper_seen, timeout=5)
    finally:
        thread.join(30)
    assert seen == {helper.pw_uid}, seen


@pytest.mark.usefixtures("as_root")
@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        (
            {"title": "job-text", "properties": {"a": {"$ref": "#/definitions/nope"}}},
            "the declared json_schema cannot be applied (a $ref within it leads nowhere)",
        ),
        (
            {"title": "job-text", "properties": {"a": {"type": 5}}},
            "the declared json_schema is not a valid JSON Schema (at properties/a/type: the"
            " meta-schema's 'anyOf' check fails)",
        ),
    ],
)
def test_a_schema_that_cannot_be_applied_fails_saying_which_check_without_quoting_it(
    helper_python: str, schema: dict[str, Any], reason: str
) -> None:
    """jsonschema's own messages quote whole documents (``PointerToNowhere: '/x' does not
    exist within {...}``); the node's reasons say which check failed, in its own words."""
    assert helpers.json_schema_problem(schema, {"a": "owner-data"}) == reason
