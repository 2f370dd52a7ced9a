#!/bin/sh
# After removal. On purge (deb: "purge"; rpm: 0, an erase; never on an upgrade: deb "upgrade",
# rpm 1) nothing of flashnode is left: its state (node id, journal, ledger, workspaces), the
# stored credentials, and the users and the group the package made (flashnode.sysusers). A
# plain removal (deb "remove") keeps the users, for the config and the state it keeps too.
set -e
case "$1" in
  purge | 0)
    if [ -d /var/lib/flashnode ] || [ -d /etc/flashnode/credentials ]; then
      echo "flashnode: removing its state (/var/lib/flashnode) and stored credentials"
    fi
    rm -rf /var/lib/flashnode /etc/flashnode/credentials
    rmdir /etc/flashnode 2>/dev/null || true
    rmdir /work 2>/dev/null || true  # the mount point, if nothing was put there
    # The agent is stopped (preremove): no process of these users is left to keep them. Each
    # user's own group goes with it; the group flashnode last (its members lose it).
    users="flashnode-build flashnode-helper"
    i=0
    while [ "$i" -lt 16 ]; do
      users="$users flashnode-task-$i"
      i=$((i + 1))
    done
    removed=0
    kept=
    command -v userdel >/dev/null 2>&1 || users=  # said below: none can be removed here
    for user in $users; do
      id "$user" >/dev/null 2>&1 || continue
      if userdel "$user" >/dev/null 2>&1; then
        removed=$((removed + 1))
      else
        kept="${kept:+$kept, }$user"
      fi
      if getent group "$user" >/dev/null 2>&1; then
        groupdel "$user" >/dev/null 2>&1 || true
      fi
    done
    group=
    if getent group flashnode >/dev/null 2>&1 && groupdel flashnode >/dev/null 2>&1; then
      group="the group flashnode and "
    fi
    if [ "$removed" -gt 0 ] || [ -n "$group" ]; then
      echo "flashnode: removed ${group}$removed of its users (task users, flashnode-build, flashnode-helper)"
    fi
    if ! command -v userdel >/dev/null 2>&1 && id flashnode-task-0 >/dev/null 2>&1; then
      echo "flashnode: no userdel here: its users (flashnode-task-0 to -15, flashnode-build, flashnode-helper) are left"
    fi
    [ -z "$kept" ] || echo "flashnode: could not remove the users $kept (is a process still running as one?): userdel them by hand"
    ;;
esac
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
fi
