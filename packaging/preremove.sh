#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
  systemctl stop flashnode.service >/dev/null 2>&1 || true
fi
