"""The engine on CUDA (run by scripts/gpu-check.sh on a GPU machine; skipped elsewhere)."""

from pathlib import Path

import pytest
import torch

from agentroll.backends.base import SamplingParams
from agentroll.engine.engine import EngineConfig, LLMEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.mark.parametrize("invariant", [False, True])
def test_cuda_generation_matches_cpu_scoring(tiny_model: Path, invariant: bool) -> None:
    gpu = LLMEngine(EngineConfig(model=str(tiny_model), device="cuda", batch_invariant=invariant))
    cpu = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu"))
    prompt = gpu.tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    gpu.add_request("g", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    out = []
    while gpu.has_work():
        out += gpu.step()
    ids = prompt + [o.token_id for o in out]
    ref = cpu.score(ids)[len(prompt) - 1 :]
    assert max(abs(a - o.logprob) for a, o in zip(ref, out, strict=True)) <= 1e-4
