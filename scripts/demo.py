"""The README's first command: a local coordinator, a pool job, and flashnode working it off."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness import AgentProcess, CoordinatorServer, argv_job


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="flashnode-demo-"))
    server = CoordinatorServer(root)
    agent: AgentProcess | None = None
    try:
        server.start()
        print(f"coordinator: {server.url} (data in {root}, removed at the end)")
        # argv tokens are str.format templates (literal braces doubled); /work/... arguments
        # are mapped to the attempt's directory by the trusted runner.
        script = "import json, sys; json.dump({{'result': {n} * {n}}}, open(sys.argv[1], 'w'))"
        job = server.submit(
            argv_job(
                ["python3", "-c", script, "/work/out/metrics.json"],
                pool="demo",
                params=[{"n": 1}, {"n": 2}, {"n": 3}],
                validators={"keys": ["result"]},
            )
        )
        print(f"submitted job {job}: 3 argv tasks for pool 'demo'")
        agent = AgentProcess(
            root, server.url, "--runner", "trusted", "--pool", "demo", "--max-tasks", "3"
        )
        code = agent.wait(120)
        print(agent.log, end="")
        print(f"flashnode work exited {code}")
        state = server.wait_state(job, {"SUCCEEDED", "FAILED", "PARTIAL"})
        print(f"job {job}: {state}")
        for task in server.tasks(job):
            metrics = json.loads(server.artifact(f"jobs/{job}/{task['task_id']}/metrics.json"))
            print(f"  {task['task_id']}: {task['state']}  metrics.json = {json.dumps(metrics)}")
        return 0 if code == 0 and state == "SUCCEEDED" else 1
    finally:
        # Nothing outlives the demo: the agent (stopped if still running) and its state dir,
        # the coordinator and its data.
        if agent is not None:
            agent.stop()
        server.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
