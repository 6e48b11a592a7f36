"""The ``vllm`` backend on CUDA (run by scripts/gpu-check.sh with the official vllm build;
skipped elsewhere).  On CUDA vLLM keeps every weight in checkpoint layout, so the served
digests cover all parameters; the NCCL transfers (``nccl``, ``sparse_nccl``) need a second
device for the sender (NCCL refuses two ranks on one GPU): marker ``gpu2``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from streams import consume

from agentroll.backends.base import GenerationRequest, SamplingParams
from agentroll.backends.vllm import VLLMBackend, vllm_available
from agentroll.errors import WeightSyncError
from agentroll.testing import SyntheticTrainer

_WHY = vllm_available() or (None if torch.cuda.is_available() else "no CUDA device")
pytestmark = [
    pytest.mark.asyncio,
    *([pytest.mark.skip(reason=_WHY)] if _WHY else []),
]
PROMPT = [1, 2, 3, 4, 5, 6, 7]
ALL_PARAMS = 17  # the tiny model: embedding, head, final norm, 2 layers x 7


def request(rid: str) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        prompt_ids=PROMPT,
        sampling=SamplingParams(max_tokens=48, seed=1, ignore_eos=True),
    )


def _backend(tiny_model: Path, **kwargs: Any) -> VLLMBackend:
    return VLLMBackend(tiny_model, max_model_len=512, max_num_seqs=8, **kwargs)


async def _update_checks(backend: VLLMBackend, trainer: SyntheticTrainer) -> None:
    """An update mid-turn is applied, verified on every parameter and probed; a corrupt
    one is refused with the old weights kept."""
    v0 = backend.policy_version
    got = await consume(backend, request("mid"), pause_at=10, policy="keep", update=trainer.step())
    v1 = backend.policy_version
    assert v1 == v0 + 1 and (v1, v0) in got.versions
    checked = backend.check.last_verified
    assert checked is not None and checked.checked == ALL_PARAMS and not checked.unverifiable
    assert backend.check.last_probe_diff is not None and backend.check.last_probe_diff <= 1e-3
    ref = await consume(backend, request("ref"))
    good = trainer.step()
    corrupt = msgspec.structs.replace(
        good,
        tensors=(msgspec.structs.replace(good.tensors[0], checksum="0" * 32), *good.tensors[1:]),
    )
    await backend.pause("keep")
    try:
        with pytest.raises(WeightSyncError):
            await backend.apply(corrupt)
    finally:
        await backend.resume()
    again = await consume(backend, request("again"))
    assert backend.policy_version == v1 and again.ids == ref.ids


@pytest.mark.gpu
async def test_reload_updates_are_verified_on_every_parameter(tiny_model: Path) -> None:
    async with _backend(tiny_model) as backend:
        await _update_checks(backend, SyntheticTrainer(tiny_model, fraction=0.05, seed=3))


@pytest.mark.gpu2
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL sender needs a second GPU")
@pytest.mark.parametrize("transfer", ["nccl", "sparse_nccl"])
async def test_nccl_transfers(tiny_model: Path, transfer: str) -> None:
    async with _backend(tiny_model, transfer=transfer, transfer_device="cuda:1") as backend:
        await _update_checks(backend, SyntheticTrainer(tiny_model, fraction=0.05, seed=4))


@pytest.mark.gpu
async def test_sleep_mode_frees_memory_and_wakes_on_an_update(tiny_model: Path) -> None:
    """vLLM's own sleep mode: both levels free device memory; after level 2 the verified
    host weights are reloaded and the update applied; requests in flight finish."""
    trainer = SyntheticTrainer(tiny_model, fraction=0.05, seed=3)
    async with _backend(tiny_model, sleep_mode=True) as backend:
        for level in (1, 2):
            report = await backend.sleep(level)
            assert backend.asleep == level and report.freed_bytes > 0, report
            print(f"vllm_sleep level={level} freed_mb={report.freed_bytes / 2**20:.1f}")
            wake = await backend.wake(trainer.step())
            assert wake.updated and backend.policy_version == wake.version
            got = await consume(backend, request(f"after-{level}"))
            assert len(got.ids) == 48
