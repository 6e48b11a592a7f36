#!/usr/bin/env bash
# Install and start what the test suite needs.  Idempotent; safe to run repeatedly.
# bubblewrap: the local sandbox runs commands inside it (no network, read-only host).
# docker: a private engine for the docker sandbox tests (scripts/dockerd.sh).
set -euo pipefail

# disk: the suite's files go under the temporary directory (pytest keeps its last three
# runs, about 0.3 GB each), and a full disk fails tests far from the cause: warn up front.
"$(dirname "$0")/check_disk.sh" "${TMPDIR:-/tmp}" 2

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
