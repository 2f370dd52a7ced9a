#!/bin/sh
# After install or upgrade (deb: "configure" [old version]; rpm: 1 install, 2 upgrade).
# Makes the users and the group, reloads systemd, and restarts an agent that was running (an
# upgrade); it never starts an agent that has not been configured.
set -e
if command -v systemd-sysusers >/dev/null 2>&1; then
  systemd-sysusers /usr/lib/sysusers.d/flashnode.conf >/dev/null
else
  # The same as flashnode.sysusers, by hand.
  getent group flashnode >/dev/null 2>&1 || groupadd --system flashnode
  nologin=$(command -v nologin || echo /usr/sbin/nologin)
  i=0
  while [ "$i" -lt 16 ]; do
    id "flashnode-task-$i" >/dev/null 2>&1 \
      || useradd --system --user-group --no-create-home --home-dir / --shell "$nologin" \
           --comment "flashnode task slot $i" "flashnode-task-$i"
    i=$((i + 1))
  done
  for user in flashnode-build flashnode-helper; do
    id "$user" >/dev/null 2>&1 \
      || useradd --system --user-group --no-create-home --home-dir / --shell "$nologin" "$user"
  done
fi
# The trusted runner binds each task's workspace at /work in the task's own mount namespace: the
# host's /work is only the mount point (the service cannot make it: ProtectSystem=strict). An
# owner's own /work is left as it is.
[ -e /work ] || [ -L /work ] || mkdir -m 0755 /work
# What `flashnode login` writes, root's alone (the package makes it 0700; an old one may differ).
chown root:root /etc/flashnode/credentials
chmod 0700 /etc/flashnode/credentials
upgrade=
case "$1" in
  configure) [ -z "$2" ] || upgrade=1 ;;
  2) upgrade=1 ;;
esac
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
  # An upgrade replaces the code under a running agent: restart it (it drains first), in the
  # background so that the package manager does not wait for the drain.
  if [ -n "$upgrade" ]; then
    systemctl try-restart --no-block flashnode.service || true
  fi
fi
if [ -z "$upgrade" ]; then
  echo "flashnode installed. Next: edit /etc/flashnode/flashnode.toml, run 'flashnode login',"
  echo "'flashnode doctor', then: systemctl enable --now flashnode"
fi
