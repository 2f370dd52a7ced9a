"""What the console costs an idle agent: our agent alone, console off and on (no browser), with
the real coordinator; the same measurement as bench.py's console rows, without the rest of the
benchmark. Uses benchmarks/.venv-ours when ``benchmarks/run`` made it, else the checkout's .venv.

    .venv/bin/python benchmarks/console_idle.py [SECONDS]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import bench

if not Path(bench.OURS[0]).exists():
    bench.OURS = [str(bench.ROOT / ".venv" / "bin" / "flashnode"), "work"]


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    root = Path(tempfile.mkdtemp(prefix="flashnode-bench-console-"))
    count_file = root / "requests.log"
    count_file.touch()
    server = bench.CoordinatorServer(
        root,
        env={"FLASHNODE_BENCH_COUNT": str(count_file)},
        app="counting_app:app",
        app_path=(bench.HERE,),
    )
    server.start()
    try:
        print(json.dumps(bench.idle_console(server, count_file, seconds), indent=1))
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
