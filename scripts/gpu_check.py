"""Check real GPU evidence on a machine with an NVIDIA GPU (a few minutes at most).

Starts a local coordinator, submits one pool task that keeps GPU 0 busy with a known duty cycle
(busy 50 % of every 200 ms for 20 s, through torch), runs `flashnode work --runner trusted
--slots auto` with the real NVML, and prints measured against expected utilisation:

    .venv/bin/python scripts/gpu_check.py   # needs torch with CUDA importable by /usr/bin/python3
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness import TASK_USER, AgentProcess, CoordinatorServer, argv_job

DUTY = 0.5
LOAD = f"""
import json, sys, time, torch
x = torch.randn(4096, 4096, device='cuda')
end = time.time() + 20
while time.time() < end:
    t = time.time()
    while time.time() - t < 0.2 * {DUTY}:
        x = x @ x; x = x / x.norm()
    torch.cuda.synchronize()
    time.sleep(0.2 * (1 - {DUTY}))
json.dump({{'ok': 1}}, open(sys.argv[1], 'w'))
"""


def main() -> int:
    if os.geteuid() == 0:  # as root, tasks run as the task user: it needs torch in python3
        subprocess.run(["useradd", "--system", "--no-create-home", TASK_USER], check=False)
    root = Path(tempfile.mkdtemp(prefix="flashnode-gpu-check-"))
    server = CoordinatorServer(root)
    server.start()
    try:
        spec = argv_job(["python3", "-c", LOAD, "/work/out/metrics.json"], pool="gpu-check")
        spec["spec"]["resources"] = {"gpuPerTask": 1}
        job = server.submit(spec)
        agent = AgentProcess(
            root,
            server.url,
            "--runner",
            "trusted",
            "--pool",
            "gpu-check",
            "--max-tasks",
            "1",
            env={"FLASHNODE_SLOTS": "auto"},
        )
        code = agent.wait(300)
        print(agent.log, end="")
        state = server.wait_state(job, {"SUCCEEDED", "FAILED"})
        record = agent.ledger()[-1]
        print(json.dumps(record, indent=2))
        host = record["evidence"]["gpu_util_percent_mean"]
        task = (record.get("task_usage") or {}).get("gpu_util_percent_mean")
        print(f"job {state}, agent exit {code}")
        print(f"expected GPU utilisation about {DUTY * 100:.0f} %")
        print(f"measured host-wide {host} %, task-scoped {task} %")
        return 0 if state == "SUCCEEDED" and host is not None else 1
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
