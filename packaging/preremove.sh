#!/bin/sh
# Before removal (deb: "remove"; rpm: 0) stop the agent (it drains) and disable it; before an
# upgrade (deb: "upgrade"; rpm: 1) leave it running: the new package's postinstall restarts it.
set -e
case "$1" in
  remove | 0)
    if [ -d /run/systemd/system ]; then
      systemctl disable --now flashnode.service >/dev/null 2>&1 || true
    elif command -v systemctl >/dev/null 2>&1; then
      systemctl disable flashnode.service >/dev/null 2>&1 || true
    fi
    ;;
esac
