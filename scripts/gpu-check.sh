#!/usr/bin/env bash
# The GPU-only checks, for a machine with CUDA (skipped, never faked, elsewhere).  Prepared
# for a lent GPU machine; not run on the CPU development machines.
#   1. the built-in engine's learning-semantics checks on cuda, and the tests marked gpu
#      (sleep/wake freeing device memory, measured with torch.cuda.mem_get_info);
#   2. vLLM on CUDA: the official vllm==0.32.0 build, then `validate --backend vllm`,
#      `bench vllm` and the vllm-marked tests (in-process and OpenAI-server backends), then
#      the CUDA-only vLLM tests: full served-weight verification, and the NCCL weight
#      transfers when there are two GPUs (skipped, and said so, on one), and vLLM's sleep mode;
#   3. layout conversion from FSDP2 shards over NCCL (two processes, one GPU each; skipped,
#      and said so, on one GPU).
# Every result line goes to gpu-results.txt (override with GPU_RESULTS=path).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${GPU_RESULTS:-gpu-results.txt}"
: >"$out"
make venv
.venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check here')"
.venv/bin/python -c "import torch; print('device', torch.cuda.get_device_name(0), 'torch', torch.__version__)" | tee -a "$out"

echo "==> built-in engine on cuda" | tee -a "$out"
.venv/bin/agentroll validate --backend torch --device cuda 2>&1 | tee -a "$out"
AGENTROLL_REQUIRE=gpu .venv/bin/pytest -q -s -m gpu tests/engine 2>&1 | grep -E '^cuda_sleep|passed|failed' | tee -a "$out"

echo "==> vLLM on cuda (the official build)" | tee -a "$out"
# vllm 0.32 is built against torch 2.13: it keeps the venv's torch when that is a CUDA build
.venv/bin/pip install --progress-bar off -q 'vllm==0.32.0' 2>&1 | tail -n 3 | tee -a "$out"
.venv/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" | tee -a "$out"
.venv/bin/agentroll validate --backend vllm 2>&1 | grep '^check=' | tee -a "$out"
.venv/bin/agentroll bench vllm --concurrency 16 --max-tokens 64 2>/dev/null | tee -a "$out"
AGENTROLL_REQUIRE=vllm .venv/bin/pytest -q -m vllm tests/backends 2>&1 | tail -n 5 | tee -a "$out"
# every served parameter verified after an update (CUDA keeps checkpoint layout), and the
# NCCL transfers (nccl, sparse_nccl: marker gpu2, they need a second GPU for the sender)
AGENTROLL_REQUIRE=gpu .venv/bin/pytest -q -rs -m "gpu or gpu2" tests/backends/test_vllm_gpu.py 2>&1 \
    | tail -n 6 | tee -a "$out"
echo "==> layout conversion from FSDP2 shards over NCCL" | tee -a "$out"
if [ "$(.venv/bin/python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    .venv/bin/python -c "from agentroll.model.tiny import create_tiny; from agentroll.validate.layout import check_layout_roundtrip as c; import tempfile, pathlib; m = create_tiny(pathlib.Path(tempfile.mkdtemp()) / 'm'); print(c(m, device='cuda').line())" 2>&1 | tail -n 1 | tee -a "$out"
else
    echo "layout_roundtrip over NCCL needs two GPUs (one per rank): skipped; the gloo check ran in validate" | tee -a "$out"
fi
echo "==> results in $out"
