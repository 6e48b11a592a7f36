#!/usr/bin/env bash
# Install and start what the test suite needs.  Idempotent; safe to run repeatedly.
# bubblewrap: the local sandbox runs commands inside it (no network, read-only host).
# docker: a private engine for the docker sandbox tests (scripts/dockerd.sh).
set -euo pipefail

# disk: the suite writes its files under the temporary directory (pytest keeps its last
# three runs there), and a full disk fails tests far from the cause: say so up front.
tmp="${TMPDIR:-/tmp}"
free_mb=$(df -Pm "$tmp" | awk 'NR==2 {print $4}')
if [ "${free_mb:-0}" -lt 4096 ]; then
  echo "==> disk: only ${free_mb} MB free under $tmp; keep at least 4 GB free." >&2
  echo "    Free some: old $tmp/pytest-of-$(id -un) runs, earlier clones, pip caches." >&2
else
  echo "==> disk: ok (${free_mb} MB free under $tmp)"
fi

have_working_bwrap() {
  command -v bwrap >/dev/null 2>&1 && bwrap --unshare-all --die-with-parent --ro-bind / / true >/dev/null 2>&1
}

if have_working_bwrap; then
  echo "==> bubblewrap: ok ($(bwrap --version))"
else
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "==> bubblewrap: installing with apt-get"
    apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }
  fi
  if have_working_bwrap; then
    echo "==> bubblewrap: ok ($(bwrap --version))"
  else
    echo "==> bubblewrap: NOT available; install it (apt-get install bubblewrap) or run tests without AGENTROLL_REQUIRE=bwrap" >&2
    exit 1
  fi
fi

# g++: builds the engine's C++ CPU kernels (agentroll/engine/kernels.py; ninja comes from pip).
if command -v g++ >/dev/null 2>&1; then
  echo "==> g++: ok ($(g++ -dumpversion))"
elif [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "==> g++: installing with apt-get"
  apt-get install -y -q g++ >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q g++ >/dev/null; }
fi

"$(dirname "$0")/dockerd.sh" start
