"""Check real GPU evidence and the owner's courtesy on a machine with an NVIDIA GPU (a few
minutes at most).

Starts a local coordinator, submits one pool task that keeps GPU 0 busy with a known duty cycle
(busy 50 % of every 200 ms for 20 s, through torch), runs `flashnode work --runner trusted
--slots auto` with the real NVML, and prints measured against expected utilisation. Then the
courtesy: a second task keeps GPU 0 busy, a CUDA process of the owner's starts beside it, and
the script prints how long after NVML first listed the owner's process the task was paused
(from status.json), and how long after the owner's process ended it ran again:

    .venv/bin/python scripts/gpu_check.py   # needs torch with CUDA importable by /usr/bin/python3
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness import TASK_USER, AgentProcess, CoordinatorServer, argv_job, wait_for

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
        job, agent = gpu_task(root, server, LOAD, {"FLASHNODE_SLOTS": "auto"})
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
        ok = state == "SUCCEEDED" and host is not None
        return 0 if courtesy(root, server) and ok else 1
    finally:
        server.close()


def gpu_task(
    root: Path, server: CoordinatorServer, script: str, env: dict[str, str]
) -> tuple[str, AgentProcess]:
    """One task of ``script`` on one GPU, and an agent (trusted runner) that runs it."""
    spec = argv_job(["python3", "-c", script, "/work/out/metrics.json"], pool="gpu-check")
    spec["spec"]["resources"] = {"gpuPerTask": 1}
    job = server.submit(spec)
    argv = ("--runner", "trusted", "--pool", "gpu-check", "--max-tasks", "1")
    return job, AgentProcess(root, server.url, *argv, env=env)


BUSY = """
import json, sys, time, torch
x = torch.randn(2048, 2048, device='cuda')
end = time.time() + 60
while time.time() < end:
    x = x @ x; x = x / x.norm(); torch.cuda.synchronize()
json.dump({'ok': 1}, open(sys.argv[1], 'w'))
"""
OWNER = (
    "import time, torch; x = torch.ones(1, device='cuda'); torch.cuda.synchronize(); time.sleep(8)"
)


def courtesy(root: Path, server: CoordinatorServer) -> bool:
    """The yield on real hardware: seconds from the owner's process on GPU 0 to its task paused."""
    import pynvml

    from flashnode.owner import status

    env = {"FLASHNODE_SLOTS": "auto", "FLASHNODE_GPU_YIELD_RESUME_SECONDS": "2"}
    job, agent = gpu_task(root, server, BUSY, env)

    def suspended() -> bool:
        running = (status.read(agent.state_dir) or {}).get("running") or []
        return bool(running) and running[0].get("suspended_since") is not None

    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    try:
        wait_for("the task on GPU 0", lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(gpu))
        owner = subprocess.Popen([sys.executable, "-c", OWNER])
        wait_for(
            "the owner's process on GPU 0",
            lambda: owner.pid in {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(gpu)},
            every=0.01,
        )
        listed = time.monotonic()
        wait_for("the task paused", suspended, every=0.01)
        paused = time.monotonic()
        owner.wait()
        ended = time.monotonic()
        wait_for("the task running again", lambda: not suspended(), every=0.05)
        resumed = time.monotonic()
    finally:
        pynvml.nvmlShutdown()
    code = agent.wait(300)
    state = server.wait_state(job, {"SUCCEEDED", "FAILED"})
    print(f"courtesy: job {state}, agent exit {code}")
    print(f"courtesy: task paused {paused - listed:.2f} s after NVML listed the owner's process")
    print(f"courtesy: task ran again {resumed - ended:.2f} s after it ended (resume delay 2 s)")
    return state == "SUCCEEDED" and paused - listed <= 1.5


if __name__ == "__main__":
    sys.exit(main())
