#!/bin/sh
# Create the user and reload systemd; never start an agent that has not been configured.
set -e
if command -v systemd-sysusers >/dev/null 2>&1; then
  systemd-sysusers /usr/lib/sysusers.d/flashnode.conf || true
elif ! id flashnode >/dev/null 2>&1; then
  useradd --system --home-dir /var/lib/flashnode --shell /usr/sbin/nologin flashnode || true
fi
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
fi
echo "flashnode installed: edit /etc/flashnode/flashnode.toml, then: systemctl enable --now flashnode"
