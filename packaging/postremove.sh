#!/bin/sh
# After removal. On purge (deb: "purge"; rpm: 0, an erase; never on an upgrade: deb "upgrade",
# rpm 1) nothing of flashnode is left: its state (node id, journal, ledger, workspaces), the
# stored credentials, and the users and the group the package made (flashnode.sysusers); a
# state dir the owner chose elsewhere (state_dir) is the owner's: it is named, not removed. A
# plain removal (deb "remove") keeps the users, for the config and the state it keeps too.
set -e
case "$1" in
  purge | 0)
    if [ -d /var/lib/flashnode ] || [ -d /etc/flashnode/credentials ]; then
      echo "flashnode: removing its state (/var/lib/flashnode) and stored credentials"
    fi
    # The accounts this package made (postinstall's record), read before the state goes: an
    # account of the same name that was there before (the owner's) is kept.
    record=/var/lib/flashnode/.package-accounts
    users=
    group=
    if [ -f "$record" ]; then
      users=$(sed -n 's/^user \(flashnode-[a-z0-9-]*\)$/\1/p' "$record" | sort -u)
      ! grep -qx "group flashnode" "$record" || group=flashnode
    fi
    # The state dir the owner chose (preremove noted it from the config): left, and named.
    chosen=
    if [ -f /var/lib/flashnode/.owner-state-dir ]; then
      chosen=$(head -n 1 /var/lib/flashnode/.owner-state-dir)
    fi
    rm -rf /var/lib/flashnode /etc/flashnode/credentials
    if [ -n "$chosen" ] && [ -d "$chosen" ]; then
      printf 'flashnode: the agent'"'"'s state dir %s (state_dir in /etc/flashnode/flashnode.toml)\n' "$chosen"
      printf '  is the owner'"'"'s choice and is left as it is (its ledger, node id, caches)'
      # Removal is suggested only for what is plainly a flashnode state dir, named safely.
      case "$chosen" in
        *"'"*) printf '.\n' ;;
        *)
          if [ -f "$chosen/ledger.jsonl" ] || [ -f "$chosen/status.json" ]; then
            printf ': remove it with\n  sudo rm -rf '"'"'%s'"'"'\n' "$chosen"
          else
            printf '.\n'
          fi ;;
      esac
    fi
    rmdir /etc/flashnode 2>/dev/null || true
    rmdir /work 2>/dev/null || true  # the mount point, if nothing was put there
    # The agent is stopped (preremove): no process of these users is left to keep them. Each
    # user's own group goes with it; the group flashnode last (its members lose it).
    removed=0
    kept=
    if ! command -v userdel >/dev/null 2>&1; then
      [ -z "$users" ] || echo "flashnode: no userdel here: the users it made are left: $(echo $users)"
      users=
    fi
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
    said=
    if [ -n "$group" ] && getent group flashnode >/dev/null 2>&1 && groupdel flashnode >/dev/null 2>&1; then
      said="the group flashnode and "
    fi
    if [ "$removed" -gt 0 ] || [ -n "$said" ]; then
      echo "flashnode: removed ${said}$removed of the users it made (task users, flashnode-build, flashnode-helper)"
    fi
    [ -z "$kept" ] || echo "flashnode: could not remove the users $kept (is a process still running as one?): userdel them by hand"
    ;;
esac
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
fi
