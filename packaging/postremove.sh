#!/bin/sh
# After removal. On purge (deb: "purge"; rpm: 0, an erase) nothing of flashnode is left: its
# state (node id, journal, ledger, workspaces) and the stored credentials go too. The users and
# the group stay (removing users is unsafe: files may still carry their ids).
set -e
case "$1" in
  purge | 0)
    if [ -d /var/lib/flashnode ] || [ -d /etc/flashnode/credentials ]; then
      echo "flashnode: removing its state (/var/lib/flashnode) and stored credentials"
    fi
    rm -rf /var/lib/flashnode /etc/flashnode/credentials
    rmdir /etc/flashnode 2>/dev/null || true
    rmdir /work 2>/dev/null || true  # the mount point, if nothing was put there
    ;;
esac
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
fi
