"""Sleep and wake of the torch backend: memory really released, requests in flight kept
exactly, updates installed at wake, and bad calls refused with nothing half-applied."""

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from agentroll._mem import rss_bytes
from agentroll.backends.base import GenerationRequest, SamplingParams, SupportsSleep
from agentroll.backends.torch import TorchBackend
from agentroll.errors import BackendError, WeightSyncError
from agentroll.validate.common import collect_stream
from agentroll.validate.placement import check_sleep_wake_parity
from agentroll.weights.exporter import WeightExporter


async def test_check_sleep_wake_parity(tiny_model: Path) -> None:
    r = await check_sleep_wake_parity(tiny_model)
    assert r.passed, r.line()


LONG = 160  # tokens of a request slept mid-generation: far more than it has by then


def _request(rid: str, max_tokens: int = LONG, seed: int = 5) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        prompt_ids=[5, 6, 7, 8, 9],
        sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed),
    )


def _state(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in backend.engine.runner.state_dict().items()}


def _perturbed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in state.items()}


def _next_version(backend: TorchBackend) -> Any:
    """A delta update of the backend's weights to version 1 (seeded small changes)."""
    live = _state(backend)
    exporter = WeightExporter(lambda: live)
    live.update(_perturbed(live))
    return exporter.export()


async def _started(backend: TorchBackend, rid: str, at_least: int) -> asyncio.Task:  # type: ignore[type-arg]
    """A request streaming in the background, once it has at least ``at_least`` tokens."""
    got = asyncio.Event()

    async def on_token(n: int) -> None:
        if n >= at_least:
            got.set()

    task = asyncio.create_task(collect_stream(backend, _request(rid), on_token))
    await got.wait()
    return task


async def test_sleep_releases_the_kv_cache_and_the_weights(tiny_model: Path) -> None:
    async with TorchBackend(tiny_model, kv_cache_mb=96) as backend:
        assert isinstance(backend, SupportsSleep) and backend.asleep == 0
        kv = backend.engine.runner.kv_bytes
        before = rss_bytes()
        report = await backend.sleep(1)
        after = rss_bytes()
        assert backend.asleep == 1 and report.kv_bytes == kv and report.weight_bytes == 0
        assert before - after >= 0.9 * kv, (before, after, kv)
        await backend.wake()
        assert backend.engine.runner.kv_bytes == kv

        weights = backend.engine.runner.weight_bytes
        before = rss_bytes()
        report = await backend.sleep(2)
        after = rss_bytes()
        assert report.weight_bytes >= weights and report.freed_bytes == kv + report.weight_bytes
        assert before - after >= 0.9 * report.freed_bytes, (before, after, report)
        assert backend.engine.runner.weight_bytes == 0
        await backend.wake(fallback=True)
        ids, _, _ = await collect_stream(backend, _request("after", 8))
        assert len(ids) == 8


async def test_requests_made_while_asleep_wait_for_wake(tiny_model: Path) -> None:
    async with TorchBackend(tiny_model) as backend:
        ref = await collect_stream(backend, _request("r", 12))
        await backend.sleep(2)
        task = asyncio.create_task(collect_stream(backend, _request("r", 12)))
        await asyncio.sleep(0.05)
        assert not task.done() and backend.steps > 0
        steps = backend.steps
        await asyncio.sleep(0.05)
        assert backend.steps == steps  # nothing ran while asleep
        await backend.wake(fallback=True)
        assert await task == ref


async def test_keep_across_a_delta_update_at_wake_keeps_old_kv_versions(tiny_model: Path) -> None:
    async with TorchBackend(tiny_model) as backend:
        update = _next_version(backend)
        assert update.kind == "delta"
        task = await _started(backend, "k", 10)
        report = await backend.sleep(2, policy="keep")
        assert report.parked == 1 and report.kept_bytes > 0
        wake = await backend.wake(update)
        assert wake.version == 1 and wake.updated and wake.restored == 1
        ids, _, versions = await task
        assert len(ids) == LONG
        split = next(i for i, (p, _) in enumerate(versions) if p == 1)
        assert split >= 10
        assert all(v == (0, 0) for v in versions[:split])
        # keep: new tokens are sampled by version 1 over KV computed (partly) by version 0
        assert all(v == (1, 0) for v in versions[split:])
        digest = backend.engine.weight_store().verify()
        assert digest == update.digest


async def test_recompute_at_wake_rescores_under_the_new_weights(tiny_model: Path) -> None:
    async with TorchBackend(tiny_model) as backend:
        update = _next_version(backend)
        task = await _started(backend, "c", 10)
        report = await backend.sleep(1, policy="recompute")
        assert report.kept_bytes == 0
        await backend.wake(update)
        _, _, versions = await task
        split = next(i for i, (p, _) in enumerate(versions) if p == 1)
        assert all(v == (1, 1) for v in versions[split:])  # the KV was recomputed by v1


async def test_bad_calls_are_refused_and_nothing_is_half_applied(tiny_model: Path) -> None:
    async with TorchBackend(tiny_model) as backend:
        with pytest.raises(BackendError, match="awake"):
            await backend.wake()
        with pytest.raises(ValueError, match="sleep level"):
            await backend.sleep(3)
        live = _state(backend)
        exporter = WeightExporter(lambda: live)
        good_digest = backend.engine.weight_store().digest()
        await backend.sleep(2)
        with pytest.raises(BackendError, match="sleeps already"):
            await backend.sleep(1)
        with pytest.raises(BackendError, match="wake"):
            await backend.wake()  # level 2 needs the next weights, or fallback
        with pytest.raises(BackendError, match="sleeps"):
            await backend.apply(exporter.full())
        with pytest.raises(BackendError, match="sleeps"):
            await backend.resume()
        # an update whose layout is not the engine's: refused, still asleep, weights parked
        wrong = {n: t[..., :1].contiguous() if t.dim() == 2 else t for n, t in live.items()}
        bad = WeightExporter(lambda: wrong).full()
        with pytest.raises(WeightSyncError):
            await backend.wake(bad)
        assert backend.asleep == 2 and backend.engine.runner.weight_bytes == 0
        # a delta on the wrong base: refused the same way
        live.update(_perturbed(live))
        delta = exporter.export()
        stale = WeightExporter(lambda: live, version=5).export()
        with pytest.raises(WeightSyncError, match="based on version"):
            await backend.wake(stale)
        assert backend.asleep == 2
        await backend.wake(fallback=True)  # the last good weights, bit for bit
        assert backend.engine.weight_store().verify() == good_digest
        ids, _, _ = await collect_stream(backend, _request("x", 6))
        assert len(ids) == 6
        # the delta still applies on the version it names
        await backend.pause()
        await backend.apply(delta)
        await backend.resume()
        assert backend.policy_version == 1


async def test_sleep_during_a_weight_update_is_refused(tiny_model: Path) -> None:
    async with TorchBackend(tiny_model) as backend:
        update = _next_version(backend)
        await backend.stage(update)  # staged, not swapped yet: an update in progress
        with pytest.raises(BackendError, match="update is in progress"):
            await backend.sleep(1)
        assert backend.asleep == 0
        await backend.swap()
        await backend.sleep(1)
        await backend.wake()


async def test_level_two_parks_weights_in_a_file_removed_at_wake_and_close(
    tiny_model: Path, tmp_path: Path
) -> None:
    async with TorchBackend(tiny_model) as backend:
        backend.spill_dir = str(tmp_path)
        await backend.sleep(2)
        assert len(os.listdir(tmp_path)) == 1
        await backend.wake(fallback=True)
        assert os.listdir(tmp_path) == []
        await backend.sleep(2)
        assert len(os.listdir(tmp_path)) == 1
    assert os.listdir(tmp_path) == []


async def test_a_parked_request_can_be_aborted_and_snapshotted(tiny_model: Path) -> None:
    async with TorchBackend(tiny_model) as backend:
        task = await _started(backend, "a", 5)
        other = await _started(backend, "b", 5)
        await backend.sleep(1)
        assert set(backend.inflight()) == {"a", "b"}
        snap = await backend.snapshot("b")
        assert snap.has_kv and snap.num_generated >= 5
        await backend.abort("a")
        await backend.wake()
        ids, _, _ = await task
        assert len(ids) < LONG  # ended by the abort
        assert len((await other)[0]) == LONG
