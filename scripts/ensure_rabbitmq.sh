#!/usr/bin/env bash
# Make sure a RabbitMQ answers on BATON_AMQP_URL's host:port (default 127.0.0.1:5672);
# start the local one if it does not.
set -euo pipefail
url="${BATON_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/}"
hostport="${url#*@}"; hostport="${hostport%%/*}"
host="${hostport%%:*}"; port="${hostport##*:}"; [ "$port" = "$host" ] && port=5672

answers() { python3 - "$host" "$port" <<'PY'
import socket, sys
s = socket.socket(); s.settimeout(1.0)
try:
    s.connect((sys.argv[1], int(sys.argv[2]))); s.sendall(b"AMQP\x00\x00\x09\x01")
    sys.exit(0 if s.recv(1) else 1)
except OSError:
    sys.exit(1)
PY
}

if answers; then echo "RabbitMQ answers on $host:$port"; exit 0; fi
if ! command -v rabbitmq-server >/dev/null; then
  echo "RabbitMQ is not answering on $host:$port and rabbitmq-server is not installed." >&2
  echo "Install it (apt-get install rabbitmq-server) or point BATON_AMQP_URL at a broker." >&2
  exit 1
fi
echo "Starting RabbitMQ..."
rabbitmq-server -detached || true
for _ in $(seq 1 90); do
  if answers; then echo "RabbitMQ is up on $host:$port"; exit 0; fi
  sleep 1
done
echo "RabbitMQ did not come up within 90 s" >&2
exit 1
