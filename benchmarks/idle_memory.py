"""Where an idle agent's memory goes (issue 31's idle memory target): one idle agent of ours
(console off, then on) and one of 0.4.1 against the real coordinator, each dumping the modules it
has imported once idle; then, in fresh interpreters of the same venv, the resident memory of
importing those modules, with and without each group an idle ``flashnode work --runner trusted``
need not import. A group's saving counts only the modules nothing else at idle imports.

    .venv/bin/python benchmarks/idle_memory.py [--settle 12] [--rounds 3]

Uses benchmarks/.venv-ours and benchmarks/.venv-041 (``benchmarks/venvs`` makes them); writes
benchmarks/idle_memory.json and prints a table. The three agents run in turn, ``--rounds`` times:
each agent's figures are its median round's (by RSS), with every round's RSS beside them (the
machine's noise); the breakdown is of that round. Each import figure is the least of three runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from harness import CoordinatorServer, wait_for  # noqa: E402

OURS_PY = str(HERE / ".venv-ours" / "bin" / "python")
OLD_PY = str(HERE / ".venv-041" / "bin" / "python")

# Run as ``python -P -c BOOT OUT SETTLE MAIN ARGS...``: the agent's own main, and a thread that
# writes the imported modules once the agent has idled SETTLE seconds.
BOOT = """
import importlib, json, os, sys, threading, time
out, settle, entry, args = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4:]
def dump():
    time.sleep(settle)
    with open(out + ".tmp", "w") as fh:
        json.dump(list(sys.modules), fh)
    os.rename(out + ".tmp", out)
threading.Thread(target=dump, daemon=True).start()
sys.argv = ["flashnode", *args]
module, name = entry.split(":")
getattr(importlib.import_module(module), name)()
"""

# Imports the names on stdin, then prints its resident memory (MB) and every module it holds.
IMPORT = """
import importlib, json, sys
for name in json.loads(sys.stdin.read()):
    try:
        importlib.import_module(name)
    except Exception:
        pass
rss = [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")][0]
print(json.dumps({"rss_mb": rss / 1024, "modules": list(sys.modules)}))
"""

# What an idle trusted agent imports that it need not (the module that imports it, and when it
# is needed): roots whose import closure, less what the rest still imports, is the saving.
OURS_GROUPS = {
    "httpx and click (0.4.1: urllib, argparse)": [
        *("httpx", "httpcore", "h11", "anyio", "sniffio", "idna", "certifi", "click")
    ],
    "ctypes (keyrings.py, gpu.py: a root agent's session keyring, the NVML probe)": ["ctypes"],
    "psutil (both agents)": ["psutil"],
    "pydantic (both agents)": ["pydantic", "pydantic_core"],
}
OWN = ("flashnode", "flashruntime")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def import_rss(py: str, names: list[str]) -> dict[str, Any]:
    runs = [
        json.loads(
            subprocess.run(
                [py, "-P", "-c", IMPORT],
                input=json.dumps(names),
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for _ in range(3)
    ]
    return min(runs, key=lambda r: float(r["rss_mb"]))


def idle_agent(server: CoordinatorServer, kind: str, listen: str, settle: float) -> dict[str, Any]:
    parent = Path("/var/lib/flashnode-fleet" if os.geteuid() == 0 else tempfile.gettempdir())
    parent.mkdir(mode=0o755, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix=f"idle-memory-{kind}-", dir=parent))
    state.chmod(0o755)
    dump = state / "modules.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHNODE_")}
    if kind == "ours":
        py, entry = OURS_PY, "flashnode.cli.main:main"
        args = ["work", "--coordinator", server.url, "--runner", "trusted", "--pool", "idle"]
        args += ["--state-dir", str(state)]
        env["FLASHNODE_UI_LISTEN"] = listen
        if os.geteuid() == 0:
            env["FLASHNODE_TASK_USER"] = "flashnode-task"  # what benchmarks/venvs makes
        else:
            env["FLASHNODE_ALLOW_SAME_USER"] = "true"
    else:
        py, entry = OLD_PY, "flashnode.agent.cli:main"
        args = ["work", "--coordinator", server.url, "--runner", "trusted", "--log-json"]
        env |= {"FLASHNODE_STATE_DIR": str(state), "HOME": str(state)}
    log = open(state / "agent.log", "wb")
    proc = subprocess.Popen(
        [py, "-P", "-c", BOOT, str(dump), str(settle), entry, *args],
        env=env,
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for(f"{kind} to idle", lambda: dump.exists() or proc.poll() is not None, timeout=120)
        if proc.poll() is not None:
            raise RuntimeError((state / "agent.log").read_text(errors="replace")[-3000:])
        info = psutil.Process(proc.pid).memory_full_info()
        modules = [m for m in json.loads(dump.read_text()) if m != "__main__"]
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        shutil.rmtree(state, ignore_errors=True)
    return {
        "rss_mb": info.rss / 2**20,
        "pss_mb": info.pss / 2**20,
        "uss_mb": info.uss / 2**20,
        "modules": modules,
    }


def split(py: str, agent: dict[str, Any]) -> dict[str, float]:
    """The agent's resident memory as the interpreter, the libraries, its own code, and what it
    holds beyond its imports."""
    modules = agent["modules"]
    bare = import_rss(py, [])["rss_mb"]
    everything = import_rss(py, modules)["rss_mb"]
    libraries = import_rss(py, [m for m in modules if not m.startswith(OWN)])["rss_mb"]
    return {
        "interpreter_mb": bare,
        "libraries_mb": libraries - bare,
        "own_code_mb": everything - libraries,
        "beyond_imports_mb": agent["rss_mb"] - everything,
    }


def savings(py: str, modules: list[str]) -> dict[str, dict[str, Any]]:
    """Per group: MB and modules an idle agent would not load if nothing imported the group's
    roots (the agent's own modules left out, so that none of them imports the roots again)."""
    libraries = [m for m in modules if not m.startswith(OWN)]
    bare = set(import_rss(py, [])["modules"])
    full = import_rss(py, libraries)["rss_mb"]
    out = {}
    for label, roots in OURS_GROUPS.items():
        closure = set(import_rss(py, roots)["modules"]) - bare
        tops = {m.split(".")[0] for m in closure} - set(sys.stdlib_module_names) | set(roots)
        closure |= {m for m in libraries if m.split(".")[0] in tops or m.startswith(tuple(roots))}
        still = set(import_rss(py, [m for m in libraries if m not in closure])["modules"])
        only = closure - still
        without = import_rss(py, [m for m in libraries if m not in only])["rss_mb"]
        out[label] = {"mb": full - without, "modules": len(only & set(libraries))}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--settle", type=float, default=12.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=HERE / "idle_memory.json")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="flashnode-idle-memory-"))
    server = CoordinatorServer(root)
    server.start()
    try:
        kinds = {"ours, console off": "off", "ours, console on": "on", "0.4.1": ""}
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in kinds}
        for _ in range(args.rounds):
            for name, console in kinds.items():
                kind = "old" if name == "0.4.1" else "ours"
                listen = f"127.0.0.1:{free_port()}" if console == "on" else console
                rounds[name].append(idle_agent(server, kind, listen, args.settle))
        agents = {
            name: sorted(runs, key=lambda a: float(a["rss_mb"]))[(len(runs) - 1) // 2]
            for name, runs in rounds.items()
        }
    finally:
        server.close()
        shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {"agents": {}, "savings": {}}
    for name, agent in agents.items():
        py = OLD_PY if name == "0.4.1" else OURS_PY
        result["agents"][name] = (
            {k: agent[k] for k in ("rss_mb", "pss_mb", "uss_mb")}
            | {"rounds_rss_mb": [a["rss_mb"] for a in rounds[name]]}
            | {"modules": len(agent["modules"])}
            | split(py, agent)
        )
    result["savings"] = savings(OURS_PY, agents["ours, console off"]["modules"])
    result["console_adds"] = sorted(
        set(agents["ours, console on"]["modules"]) - set(agents["ours, console off"]["modules"])
    )
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        "| agent | RSS (rounds) | USS | modules | interpreter | libraries | own code | beyond imports |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, a in result["agents"].items():
        each = ", ".join(f"{x:.1f}" for x in a["rounds_rss_mb"])
        print(
            f"| {name} | {a['rss_mb']:.1f} ({each}) | {a['uss_mb']:.1f} | {a['modules']}"
            f" | {a['interpreter_mb']:.1f} | {a['libraries_mb']:.1f} | {a['own_code_mb']:.1f}"
            f" | {a['beyond_imports_mb']:.1f} |"
        )
    print("\n| not imported at idle | saves (MB) | modules |\n|---|---|---|")
    for label, s in result["savings"].items():
        print(f"| {label} | {s['mb']:.1f} | {s['modules']} |")
    print(f"\nthe console adds: {', '.join(result['console_adds'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
