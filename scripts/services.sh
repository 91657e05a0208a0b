#!/usr/bin/env bash
# Make sure the servers the tests use are up: Redis on 127.0.0.1:6379 and PostgreSQL on
# 127.0.0.1:5432. Starts what is installed but stopped; says clearly what it cannot start
# (the tests that need it then skip with that reason, or fail under CI=true).
set -u

redis_up() { python3 - <<'PY'
import socket, sys
try:
    s = socket.create_connection(("127.0.0.1", 6379), timeout=1); s.sendall(b"PING\r\n")
    sys.exit(0 if s.recv(16).startswith(b"+PONG") else 1)
except OSError:
    sys.exit(1)
PY
}

if ! redis_up; then
  if command -v redis-server >/dev/null; then
    echo "services: starting redis-server on 127.0.0.1:6379"
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do redis_up && break; sleep 0.5; done
  fi
  redis_up || echo "services: Redis is not reachable on 127.0.0.1:6379 and redis-server is not installed (apt install redis-server); Redis tests will skip"
fi

if command -v pg_isready >/dev/null && ! pg_isready -q -h 127.0.0.1 -p 5432; then
  if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
    echo "services: starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done
  fi
fi
if ! (command -v pg_isready >/dev/null && pg_isready -q -h 127.0.0.1 -p 5432); then
  echo "services: PostgreSQL is not reachable on 127.0.0.1:5432 (apt install postgresql, trust auth for 127.0.0.1); PostgreSQL tests will skip"
fi

# Headless Chromium draws the HTML report in tests/store/test_report_render.py (a screenshot).
# Debian's package (~110 MB, ~20 s here); installed when this runs as root with apt-get, as
# on CI. Without it that test skips and says why (under CI=true it fails).
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "services: installing chromium (apt-get) for the HTML report screenshot test"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; } \
      || true
  fi
  command -v chromium >/dev/null \
    || echo "services: chromium is not installed (apt install chromium); the HTML report screenshot test will skip"
fi
exit 0
