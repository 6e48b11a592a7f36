#!/usr/bin/env bash
# A private Docker engine for the test suite and the sandbox bench:
#   scripts/dockerd.sh start | stop | status | host
# start: installs docker.io with apt-get if dockerd is missing (root only), starts dockerd
# with its own socket, data root and exec root under $AGENTROLL_DOCKERD_DIR (default
# /tmp/agentroll-dockerd), with NO bridge network and NO iptables (containers only ever
# run with network_mode=none), then makes the offline base image agentroll/base:host (an
# empty `docker import`; sandboxes bind the host's /usr, /lib... read-only).  Idempotent:
# a daemon that already answers is reused.  host: prints the DOCKER_HOST to use.
# It never touches the system's own docker daemon or /var/run/docker.sock.
set -euo pipefail

DIR="${AGENTROLL_DOCKERD_DIR:-/tmp/agentroll-dockerd}"
SOCK="$DIR/docker.sock"
HOST="unix://$SOCK"
IMAGE="agentroll/base:host"

answers() {
  command -v docker >/dev/null 2>&1 && [ -S "$SOCK" ] && docker -H "$HOST" version >/dev/null 2>&1
}

install_engine() {
  if command -v dockerd >/dev/null 2>&1 && command -v docker >/dev/null 2>&1; then
    return 0
  fi
  if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "==> docker: dockerd is not installed and this is not root with apt-get; install" \
      "docker.io (or Docker Engine), or point AGENTROLL_DOCKER_HOST at a running daemon" >&2
    exit 1
  fi
  echo "==> docker: installing docker.io with apt-get (about 15 s)"
  apt-get install -y -q docker.io >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && apt-get install -y -q docker.io >/dev/null; }
}

start() {
  if answers; then
    ensure_image
    echo "==> docker: ok ($(docker -H "$HOST" version --format '{{.Server.Version}}'), DOCKER_HOST=$HOST)"
    return 0
  fi
  install_engine
  if [ "$(id -u)" != "0" ]; then
    echo "==> docker: starting dockerd needs root; run as root or start a daemon yourself" >&2
    exit 1
  fi
  mkdir -p "$DIR"
  if [ -f "$DIR/dockerd.pid" ] && kill -0 "$(cat "$DIR/dockerd.pid")" 2>/dev/null; then
    echo "==> docker: dockerd (pid $(cat "$DIR/dockerd.pid")) runs but does not answer; see $DIR/dockerd.log" >&2
    exit 1
  fi
  rm -f "$SOCK"
  echo "==> docker: starting dockerd (socket $SOCK, no bridge, no iptables; log $DIR/dockerd.log)"
  setsid dockerd \
    --host "$HOST" \
    --data-root "$DIR/data" \
    --exec-root "$DIR/exec" \
    --pidfile "$DIR/dockerd.pid" \
    --bridge=none --iptables=false --ip-forward=false --ip-masq=false \
    >"$DIR/dockerd.log" 2>&1 </dev/null &
  for _ in $(seq 1 60); do
    if answers; then
      ensure_image
      echo "==> docker: ok ($(docker -H "$HOST" version --format '{{.Server.Version}}'), DOCKER_HOST=$HOST)"
      return 0
    fi
    sleep 0.5
  done
  echo "==> docker: dockerd did not answer within 30 s; last lines of $DIR/dockerd.log:" >&2
  tail -n 20 "$DIR/dockerd.log" >&2 || true
  exit 1
}

ensure_image() {
  if ! docker -H "$HOST" image inspect "$IMAGE" >/dev/null 2>&1; then
    tar cf - --files-from /dev/null | docker -H "$HOST" import - "$IMAGE" >/dev/null
    echo "==> docker: made the base image $IMAGE (empty, offline)"
  fi
}

stop() {
  if [ -f "$DIR/dockerd.pid" ] && kill -0 "$(cat "$DIR/dockerd.pid")" 2>/dev/null; then
    pid="$(cat "$DIR/dockerd.pid")"
    if answers; then
      ids="$(docker -H "$HOST" ps -aq --filter label=agentroll.sandbox)"
      [ -z "$ids" ] || docker -H "$HOST" rm -f $ids >/dev/null
    fi
    kill "$pid"
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    echo "==> docker: stopped dockerd (pid $pid)"
  else
    echo "==> docker: not running"
  fi
}

case "${1:-status}" in
  start) start ;;
  stop) stop ;;
  host) echo "$HOST" ;;
  status)
    if answers; then
      echo "==> docker: running (DOCKER_HOST=$HOST, $(docker -H "$HOST" ps -q | wc -l) containers up)"
    else
      echo "==> docker: not running"
      exit 1
    fi
    ;;
  *) echo "usage: $0 start|stop|status|host" >&2; exit 2 ;;
esac
