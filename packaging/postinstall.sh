#!/bin/sh
# After install or upgrade (deb: "configure" [old version]; rpm: 1 install, 2 upgrade).
# Makes the users and the group, reloads systemd, and restarts an agent that was running (an
# upgrade); it never starts an agent that has not been configured. It says what it did, each in
# one line: what it made, what it restarts and how long that may take, and (after a removal had
# disabled the service) how to enable it again.
set -e
upgrade=
case "$1" in
  configure) [ -z "$2" ] || upgrade=1 ;;
  2) upgrade=1 ;;
esac
made=
# The accounts this package makes, by name, so that a purge removes those and no other: an
# owner's own account of the same name (./scripts/task-users makes them too) is never ours.
record=/var/lib/flashnode/.package-accounts
new_users=
new_group=
getent group flashnode >/dev/null 2>&1 || { made="the group flashnode"; new_group=1; }
missing=0
i=0
while [ "$i" -lt 16 ]; do
  id "flashnode-task-$i" >/dev/null 2>&1 || { missing=$((missing + 1)); new_users="$new_users flashnode-task-$i"; }
  i=$((i + 1))
done
own=
for user in flashnode-build flashnode-helper; do
  id "$user" >/dev/null 2>&1 || { own="${own:+$own, }$user"; new_users="$new_users $user"; }
done
if command -v systemd-sysusers >/dev/null 2>&1; then
  systemd-sysusers /usr/lib/sysusers.d/flashnode.conf >/dev/null 2>&1
else
  # The same as flashnode.sysusers, by hand.
  getent group flashnode >/dev/null 2>&1 || groupadd --system flashnode
  nologin=$(command -v nologin || echo /usr/sbin/nologin)
  i=0
  while [ "$i" -lt 16 ]; do
    id "flashnode-task-$i" >/dev/null 2>&1 \
      || useradd --system --user-group --no-create-home --home-dir / --shell "$nologin" \
           --comment "flashnode task slot $i" "flashnode-task-$i" >/dev/null
    i=$((i + 1))
  done
  for user in flashnode-build flashnode-helper; do
    id "$user" >/dev/null 2>&1 \
      || useradd --system --user-group --no-create-home --home-dir / --shell "$nologin" \
           --comment "flashnode's own ${user#flashnode-} user" "$user" >/dev/null
  done
fi
if [ -n "$new_users$new_group" ]; then
  [ -d /var/lib/flashnode ] || mkdir -m 0711 /var/lib/flashnode
  for user in $new_users; do
    ! id "$user" >/dev/null 2>&1 || echo "user $user" >>"$record"
  done
  [ -z "$new_group" ] || ! getent group flashnode >/dev/null 2>&1 || echo "group flashnode" >>"$record"
  chmod 0600 "$record"
fi
if [ "$missing" -gt 0 ]; then
  made="${made:+$made, }$missing task users (flashnode-task-0 to -15, one per slot)"
fi
[ -z "$own" ] || made="${made:+$made, }the agent's own users ($own)"
# The trusted runner binds each task's workspace at /work in the task's own mount namespace: the
# host's /work is only the mount point (the service cannot make it: ProtectSystem=strict). An
# owner's own /work is left as it is.
if [ ! -e /work ] && [ ! -L /work ]; then
  mkdir -m 0755 /work
  made="${made:+$made, }the mount point /work"
fi
[ -z "$made" ] || echo "flashnode: made $made"
# What `flashnode login` writes, root's alone (the package makes it 0700; an old one may differ).
chown root:root /etc/flashnode/credentials
chmod 0700 /etc/flashnode/credentials
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
  # An upgrade replaces the code under a running agent: restart it. That takes seconds: running
  # tasks run on under their supervisors and the new agent re-attaches them.
  if [ -n "$upgrade" ] && systemctl is-active --quiet flashnode.service; then
    echo "flashnode: restarting the agent on the new version (seconds): running tasks run on and"
    echo "  are re-attached by it (journalctl -u flashnode shows it)"
    systemctl try-restart flashnode.service || true
  fi
fi
# Installed again after a removal (deb passes the old version then, as for an upgrade): removing
# the package disabled the service, and an agent ran here before.
if [ -e /var/lib/flashnode/status.json ] && [ -d /run/systemd/system ] \
  && ! systemctl is-enabled --quiet flashnode.service 2>/dev/null \
  && ! systemctl is-active --quiet flashnode.service; then
  echo "flashnode: the service is disabled (removing the package disables it) and your config is"
  echo "  kept: sudo flashnode doctor, then sudo systemctl enable --now flashnode"
elif [ -z "$upgrade" ]; then
  echo "flashnode installed. Next: edit /etc/flashnode/flashnode.toml, run 'flashnode login',"
  echo "'flashnode doctor', then: systemctl enable --now flashnode"
fi
