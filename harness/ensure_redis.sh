#!/usr/bin/env bash
# Make sure Debian's redis-server is installed (the multi-host tests run a REAL
# Redis as LMCache's shared L2). Idempotent: exits at once when redis-server is
# on PATH; otherwise installs the Debian package (needs root or sudo).
#
#   harness/ensure_redis.sh
#
# Nothing is started here: harness/redis_server.py starts its own
# redis-server on a free loopback port and stops exactly that pid.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "ensure_redis.sh: redis-server is missing and this is not root (no sudo):" >&2
        echo "  install it with: apt-get install -y redis-server" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get install -y --no-install-recommends redis-server; then
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends redis-server
fi
command -v redis-server >/dev/null
