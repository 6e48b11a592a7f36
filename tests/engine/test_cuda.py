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


async def test_cuda_sleep_frees_device_memory_and_wakes_exactly(tiny_model: Path) -> None:
    """Level 1 frees the KV cache, level 2 the weights too, measured by the device's free
    memory; a request in flight continues token for token after each."""
    from agentroll.backends.torch import TorchBackend
    from agentroll.validate.common import collect_stream, sample_request
    from agentroll.validate.placement import check_sleep_wake_parity

    r = await check_sleep_wake_parity(tiny_model, device="cuda")
    assert r.passed, r.line()
    async with TorchBackend(tiny_model, device="cuda", kv_cache_mb=512) as backend:
        prompt = backend.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n")
        torch.cuda.synchronize()
        free0, _ = torch.cuda.mem_get_info()
        report = await backend.sleep(1)
        free1, _ = torch.cuda.mem_get_info()
        assert free1 - free0 >= 0.9 * report.kv_bytes, (free0, free1, report)
        await backend.wake()
        free2, _ = torch.cuda.mem_get_info()
        report = await backend.sleep(2)
        free3, _ = torch.cuda.mem_get_info()
        assert free3 - free2 >= 0.9 * report.freed_bytes, (free2, free3, report)
        print(
            f"cuda_sleep level1_freed_mb={(free1 - free0) / 2**20:.1f} "
            f"level2_freed_mb={(free3 - free2) / 2**20:.1f}"
        )
        await backend.wake(fallback=True)
        ids, _, _ = await collect_stream(backend, sample_request(0, prompt, 8))
        assert len(ids) == 8
