#!/bin/sh
# Before removal (deb: "remove"; rpm: 0) drain the agent (`flashnode drain --wait`: running tasks
# may finish first) and disable it; before an upgrade (deb: "upgrade"; rpm: 1) leave it running:
# the new package's postinstall restarts it. The drain says so, and for how long at most.
set -e
case "$1" in
  remove | 0)
    if [ -d /run/systemd/system ]; then
      if systemctl is-active --quiet flashnode.service; then
        running=$(/usr/bin/flashnode status --json 2>/dev/null \
          | /opt/flashnode/bin/python -IB -c \
            'import json, sys; print(len(json.load(sys.stdin).get("running") or []))' \
            2>/dev/null || echo 0)
        drain=$(sed -n 's/^[[:space:]]*drain_seconds[[:space:]]*=[[:space:]]*\([0-9.]*\).*/\1/p' \
          /etc/flashnode/flashnode.toml 2>/dev/null | tail -1)
        if [ "${running:-0}" -gt 0 ]; then
          echo "flashnode: stopping the agent: $running running task(s) may finish first, for up to"
          echo "  ${drain:-300} s (drain_seconds), then they are stopped; sudo flashnode drain in another"
          echo "  shell stops them at once"
        else
          echo "flashnode: stopping the agent"
        fi
        /usr/bin/flashnode drain --wait 2>&1 | sed 's/^/  /' || true
      fi
      systemctl disable --now flashnode.service >/dev/null 2>&1 || true
      # Tasks a stopped agent left running for its next start (reattach_seconds) end now, with
      # their supervisors: nothing of the package is left running once it is gone.
      /opt/flashnode/bin/python -IB -c 'import pathlib
from flashnode.cli.common import state_dir_of
from flashnode.sandbox.procs.supervisor import sweep_homes
config = pathlib.Path("/etc/flashnode/flashnode.toml")
sweep_homes(state_dir_of(config, None), set())' 2>/dev/null || true
    elif command -v systemctl >/dev/null 2>&1; then
      systemctl disable flashnode.service >/dev/null 2>&1 || true
    fi
    # A state dir the owner chose (state_dir in the config, not the service's /var/lib/flashnode)
    # is the owner's, not the package's to remove: noted now, while the config is still here,
    # for a purge to name it (and say how to remove it).
    chosen=$(/opt/flashnode/bin/python -IB -c 'import pathlib
from flashnode.cli.common import SERVICE_STATE_DIR, config_value
chosen = config_value(pathlib.Path("/etc/flashnode/flashnode.toml"), "state_dir")
if isinstance(chosen, str) and chosen.startswith("/"):
    path = pathlib.Path(chosen)
    if path.resolve() != SERVICE_STATE_DIR.resolve():
        print(path)' 2>/dev/null || true)
    if [ -n "$chosen" ] && [ -d /var/lib/flashnode ]; then
      printf '%s\n' "$chosen" >/var/lib/flashnode/.owner-state-dir
    fi
    ;;
esac
