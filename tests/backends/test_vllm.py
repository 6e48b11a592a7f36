"""The ``vllm`` backend on vLLM's CPU build (marker ``vllm``): token-in/token-out with
logprobs, pause/resume policies, versions, weight updates and parity with the built-in
engine on the project's tiny model.  One engine serves the whole module (about 25 s to
start on these machines)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from streams import Run, consume

from agentroll.backends.base import GenerationRequest, SamplingParams
from agentroll.backends.vllm import VLLMBackend, vllm_available
from agentroll.errors import BackendError, WeightSyncError
from agentroll.testing import SyntheticTrainer

_WHY = vllm_available()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.asyncio(loop_scope="module"),
    *([pytest.mark.skip(reason=_WHY)] if _WHY else []),
]

PROMPT = [1, 2, 3, 4, 5, 6, 7]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(tiny_model: Path) -> AsyncIterator[VLLMBackend]:
    async with VLLMBackend(tiny_model, max_model_len=512, max_num_seqs=16) as b:
        yield b


@pytest.fixture(scope="module")
def trainer(tiny_model: Path) -> SyntheticTrainer:
    return SyntheticTrainer(tiny_model, fraction=0.05, seed=3)


async def run(
    backend: VLLMBackend,
    rid: str,
    *,
    max_tokens: int = 32,
    seed: int = 1,
    pause_at: int | None = None,
    policy: Any = "keep",
    update: Any = None,
    prompt: list[int] = PROMPT,
) -> Run:
    req = GenerationRequest(
        request_id=rid,
        prompt_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True),
    )
    return await consume(backend, req, pause_at=pause_at, policy=policy, update=update)


async def test_tokens_logprobs_and_seeds(backend: VLLMBackend) -> None:
    a = await run(backend, "seed-a")
    b = await run(backend, "seed-b")
    c = await run(backend, "seed-c", seed=2)
    assert len(a.ids) == 32 and a.ids == b.ids and a.logprobs == b.logprobs
    assert a.ids != c.ids
    assert all(lp <= 0 for lp in a.logprobs)
    assert set(a.versions) == {(backend.policy_version, backend.policy_version)}


async def test_pause_keep_without_update_changes_nothing(backend: VLLMBackend) -> None:
    """token_parity_pause: paused and resumed mid-generation equals uninterrupted."""
    ref = await run(backend, "parity-ref", seed=7)
    for at in (1, 9, 20):
        got = await run(backend, f"parity-{at}", seed=7, pause_at=at)
        assert got.ids == ref.ids
        assert got.logprobs == ref.logprobs  # bit-identical


async def test_recompute_after_an_update_matches_rescoring(
    backend: VLLMBackend, trainer: SyntheticTrainer
) -> None:
    """recompute_rescore: tokens after the resume have the new version on both counts and
    their logprobs are those of a fresh prefill under the new weights."""
    v0 = backend.policy_version
    update = trainer.step()
    got = await run(
        backend, "recompute", max_tokens=128, pause_at=12, policy="recompute", update=update
    )
    v1 = backend.policy_version
    assert v1 == update.version != v0
    first = got.versions.index((v1, v1))
    assert set(got.versions[:first]) == {(v0, v0)} and set(got.versions[first:]) == {(v1, v1)}
    assert 12 <= first < 128  # where vLLM was when the pause held (the reader may lag)
    rescored = await backend.prompt_logprobs(PROMPT + got.ids)
    after = rescored[len(PROMPT) - 1 :][first:]
    diffs = [abs(x - y) for x, y in zip(after, got.logprobs[first:], strict=True)]
    before = rescored[len(PROMPT) - 1 :][:first]
    assert max(diffs) < 1e-4
    # and the check has teeth: the tokens sampled before the update were not
    assert max(abs(x - y) for x, y in zip(before, got.logprobs[:first], strict=True)) > 1e-3


async def test_keep_after_an_update_keeps_the_old_kv_version(
    backend: VLLMBackend, trainer: SyntheticTrainer
) -> None:
    v0 = backend.policy_version
    got = await run(
        backend, "keep", max_tokens=128, pause_at=10, policy="keep", update=trainer.step()
    )
    v1 = backend.policy_version
    first = got.versions.index((v1, v0))
    assert set(got.versions[:first]) == {(v0, v0)} and set(got.versions[first:]) == {(v1, v0)}
    fresh = await run(backend, "keep-fresh")
    assert set(fresh.versions) == {(v1, v1)}  # a new request starts on the new weights


async def test_restart_regenerates_the_turn(backend: VLLMBackend) -> None:
    got = await run(backend, "restart", pause_at=10, policy="restart")
    assert got.rollbacks == 1 and len(got.ids) == 32
    ref = await run(backend, "restart-ref")
    assert got.ids == ref.ids  # same seed, same weights: the same turn again


async def test_a_failed_update_keeps_the_old_weights(
    backend: VLLMBackend, trainer: SyntheticTrainer
) -> None:
    before = backend.policy_version
    ref = await run(backend, "failed-ref")
    good = trainer.step()
    first = good.tensors[0]
    corrupt = msgspec.structs.replace(
        good, tensors=(msgspec.structs.replace(first, checksum="0" * 32), *good.tensors[1:])
    )
    await backend.pause("keep")
    try:
        with pytest.raises(WeightSyncError):
            await backend.apply(corrupt)
        stale = msgspec.structs.replace(good, base_version=before + 100)
        with pytest.raises(WeightSyncError):
            await backend.apply(stale)
    finally:
        await backend.resume()  # a pause never outlives a failed update
    assert backend.policy_version == before
    again = await run(backend, "failed-again")
    assert again.ids == ref.ids and again.logprobs == ref.logprobs
    # the trainer's later update still applies (the good one was never applied)
    await backend.pause("keep")
    try:
        await backend.apply(good)
    finally:
        await backend.resume()
    assert backend.policy_version == good.version


async def _apply(backend: VLLMBackend, update: Any) -> None:
    await backend.pause("keep")
    try:
        await backend.apply(update)
    finally:
        await backend.resume()


async def test_an_update_is_verified_in_vllm_and_probed(
    backend: VLLMBackend, trainer: SyntheticTrainer
) -> None:
    probes = backend.check.probes
    await _apply(backend, trainer.step())
    checked = backend.check.last_verified
    # vLLM's CPU build repacks linear weights (it reports them empty); everything else is
    # compared byte for byte: embedding, head, final norm, and per layer 2 norms + qkv bias
    assert checked.checked == 9
    assert len(checked.unverifiable) == 8
    assert set(checked.unverifiable.values()) == {"repacked by the engine (CPU)"}
    # ... and the linear weights are covered by the rescoring probe
    assert backend.check.probes == probes + 1
    assert backend.check.last_probe_diff is not None and backend.check.last_probe_diff <= 1e-4


async def test_served_bytes_that_differ_from_the_update_are_rolled_back(
    backend: VLLMBackend, trainer: SyntheticTrainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = backend.policy_version
    ref = await run(backend, "served-ref")
    stale, real = backend.weights.served, backend._reload

    async def wrong(directory: Path) -> None:  # vLLM "loads" the old checkpoint, whatever
        await real(stale)

    monkeypatch.setattr(backend, "_reload", wrong)
    update = trainer.step()
    await backend.pause("keep")
    try:
        with pytest.raises(WeightSyncError, match="differ from the verified weights"):
            await backend.apply(update)
    finally:
        await backend.resume()
    monkeypatch.undo()
    assert backend.policy_version == before
    again = await run(backend, "served-again")
    assert again.ids == ref.ids and again.logprobs == ref.logprobs
    await _apply(backend, update)  # the real load then succeeds
    assert backend.policy_version == update.version


async def test_cross_backend_parity_with_the_builtin_engine(
    backend: VLLMBackend, trainer: SyntheticTrainer
) -> None:
    """On the same weights, vLLM's logprobs equal the built-in engine's (fp32), and greedy
    tokens match (``check_cross_backend_parity`` runs the built-in engine on the host copy
    of the served weights; that copy is checked against the trainer's own state here)."""
    import torch

    from agentroll.validate.vllm import check_cross_backend_parity

    assert backend.policy_version == trainer.version  # the trainer's state is what vLLM serves
    served = backend.weights.store.tensors
    assert served.keys() == trainer.state.keys()
    assert all(torch.equal(served[n], t) for n, t in trainer.state.items())
    result = await check_cross_backend_parity(backend)
    assert result.figures["max_abs_logprob_diff"] < 1e-3, result.line()
    assert result.figures["greedy_equal"], result.line()


async def test_sleep_is_refused_with_the_reason_on_the_cpu_build(backend: VLLMBackend) -> None:
    from agentroll.backends.base import SupportsSleep
    from agentroll.backends.vllm import sleep_mode_unavailable

    assert isinstance(backend, SupportsSleep)
    why = sleep_mode_unavailable()
    if why is None:
        pytest.skip("this platform has vLLM's sleep mode (see test_vllm_gpu.py)")
    assert "sleep mode" in why and "torch backend" in why
    with pytest.raises(BackendError, match="sleep mode is not available"):
        await backend.sleep(1)
    assert backend.asleep == 0
    assert len((await run(backend, "after-sleep", max_tokens=4)).ids) == 4
    with pytest.raises(BackendError, match="not available"):
        await VLLMBackend(backend.model_dir, sleep_mode=True).start()  # refused before loading


async def test_a_consumer_that_leaves_aborts_its_request(backend: VLLMBackend) -> None:
    req = GenerationRequest(
        request_id="leaver",
        prompt_ids=PROMPT,
        sampling=SamplingParams(max_tokens=400, seed=1, ignore_eos=True),
    )
    stream = backend.generate(req)
    got = 0
    async for chunk in stream:
        got += len(chunk.token_ids)
        if got >= 3:
            break
    await stream.aclose()  # type: ignore[attr-defined]
    assert backend.llm.output_processor.get_num_unfinished_requests() == 0
    assert "leaver" not in backend._live


async def test_bench_line(backend: VLLMBackend) -> None:
    import re

    from agentroll.bench.vllm import format_line, run_vllm_bench

    result = await run_vllm_bench(4, 8, pairs=5, progress=False, backend=backend)
    line = format_line(result)
    assert re.fullmatch(
        r"tokens_per_s=[\d.]+ raw_tokens_per_s=[\d.]+ overhead_ratio=[\d.]+"
        r" pairs=\d+ ratio_min=[\d.]+ ratio_max=[\d.]+",
        line,
    ), line
    assert result["tokens_per_s"] > 0 and result["raw_tokens_per_s"] > 0


async def test_validate_checks_pass(backend: VLLMBackend) -> None:
    from agentroll.validate.vllm import run_vllm_checks

    results = await run_vllm_checks(Path(backend.model_dir), backend=backend)
    assert [r.name for r in results] == [
        "token_parity_pause",
        "recompute_rescore",
        "provenance",
        "served_weights",
        "cross_backend_parity",
    ]
    assert all(r.passed for r in results), [r.line() for r in results]


def synced_trainer(backend: VLLMBackend, seed: int) -> SyntheticTrainer:
    """A trainer whose next update applies to what the backend serves now (validate's
    checks apply updates of their own)."""
    from agentroll.weights.exporter import WeightExporter

    trainer = SyntheticTrainer(backend.model_dir, fraction=0.05, seed=seed)
    trainer.state = {k: v.clone() for k, v in backend.weights.store.tensors.items()}
    trainer.exporter = WeightExporter(lambda: trainer.state, version=backend.policy_version)
    return trainer


async def test_a_failed_probe_takes_the_backend_out_of_service_until_recovered(
    backend: VLLMBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = synced_trainer(backend, seed=5)
    stale, real = backend.weights.served, backend._reload

    async def wrong(directory: Path) -> None:
        await real(stale)

    monkeypatch.setattr(backend, "_reload", wrong)
    monkeypatch.setattr(backend.check, "verify_served", False)  # only the probe can see it now
    await backend.pause("keep")
    try:
        await backend.apply(trainer.step())
    finally:
        with pytest.raises(WeightSyncError, match="rescoring probe"):
            await backend.resume()
    assert not backend._paused
    assert backend.check.last_probe_diff is not None and backend.check.last_probe_diff > 1e-3
    with pytest.raises(BackendError, match="out of service"):
        await run(backend, "after-a-failed-probe")
    monkeypatch.undo()
    await backend.recover()  # the verified weights again, verified and probed
    assert backend.check.last_probe_diff <= 1e-4
    fine = await run(backend, "after-recover")
    assert len(fine.ids) == 32


async def _fleet_round(fleet: Any, trainer: SyntheticTrainer, strategy: str) -> list[Any]:
    """Six 48-token episodes; once one has 8 tokens the trainer's next update goes out with
    ``strategy``.  Returns each episode's (policy, kv) versions per token, then the report."""
    import asyncio

    reached = asyncio.Event()

    async def one(i: int) -> list[tuple[int, int]]:
        req = GenerationRequest(
            request_id=f"fleet-{strategy}-{i}",
            prompt_ids=PROMPT + [i + 10],
            sampling=SamplingParams(max_tokens=48, seed=i, ignore_eos=True),
        )
        versions: list[tuple[int, int]] = []
        async for chunk in fleet.generate(req):
            versions += [(chunk.policy_version, chunk.kv_version)] * len(chunk.token_ids)
            if len(versions) >= 8:
                reached.set()
        return versions

    async def sync() -> Any:
        await reached.wait()
        return await fleet.update(trainer.step(), strategy=strategy)

    return list(await asyncio.gather(*(one(i) for i in range(6)), sync()))


async def test_zz_a_fleet_of_two_vllm_replicas_syncs_with_every_strategy(
    backend: VLLMBackend,
) -> None:
    """The fleet drives vLLM replicas unchanged: pause, rolling and background updates while
    episodes generate on two replicas (vLLM cannot hand a request's KV over, so the fleet
    moves none).  Runs last: closing the fleet closes the module's engine."""
    import itertools

    from agentroll.fleet.backend import FleetBackend
    from agentroll.fleet.replica import LocalReplica

    trainer = synced_trainer(backend, seed=9)
    second = VLLMBackend(backend.model_dir, max_model_len=512, max_num_seqs=16)
    await second.start()
    await _apply(second, trainer.exporter.full())  # the same weights and version as the first
    assert second.policy_version == backend.policy_version
    fleet = FleetBackend(
        [LocalReplica(backend, name="vllm-0"), LocalReplica(second, name="vllm-1")],
        strategy="pause",
    )
    async with fleet:
        for strategy in ("pause", "rolling", "background"):
            v0 = backend.policy_version
            *runs, report = await _fleet_round(fleet, trainer, strategy)
            v1 = v0 + 1
            assert report.failed == {}, (strategy, report)
            assert backend.policy_version == second.policy_version == v1, strategy
            for versions in runs:
                assert len(versions) == 48 and versions[0] == (v0, v0), strategy
                assert all(b >= a for a, b in itertools.pairwise(versions)), strategy
                assert all(kv <= pv for pv, kv in versions), strategy
            if strategy != "rolling":  # in-flight episodes continue on the new weights
                assert any(v[0] == v1 for versions in runs for v in versions), strategy
            # (rolling moves a group's calls to replicas still on the old version: vLLM has
            # no KV hand-over, so they move by re-prefilling what was delivered)
            after = await consume(
                fleet,
                GenerationRequest(
                    request_id=f"fleet-{strategy}-after",
                    prompt_ids=PROMPT,
                    sampling=SamplingParams(max_tokens=8, seed=1, ignore_eos=True),
                ),
            )
            assert set(after.versions) == {(v1, v1)}, strategy
    # both replicas served what the trainer sent, verified on their side
    for replica in (backend, second):
        assert replica.check.last_verified is not None and replica.check.last_verified.checked
