#!/usr/bin/env bash
# The GPU-only checks, for a machine with CUDA (skipped, never faked, elsewhere):
# the learning-semantics checks with the engine on cuda, and the tests marked gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
make venv
.venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check here')"
.venv/bin/agentroll validate --backend torch --device cuda
AGENTROLL_REQUIRE=gpu .venv/bin/pytest -q -m gpu
