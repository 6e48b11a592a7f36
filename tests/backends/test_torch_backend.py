"""The torch backend through the Backend protocol, the rollout engine on it, and the
learning-semantics checks of ``agentroll validate`` (each a test)."""

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agentroll.backends.base import GenerationRequest, SamplingParams
from agentroll.backends.torch import TorchBackend
from agentroll.env import Environment, tool
from agentroll.errors import BackendError
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.types import Task
from agentroll.validate import parity
from agentroll.validate.parity import (
    check_batch_invariance,
    check_bf16_parity,
    check_recompute_rescore,
    check_reference_parity,
    check_token_parity_migrate,
    check_token_parity_pause,
)


async def test_check_token_parity_pause(tiny_model: Path) -> None:
    r = await check_token_parity_pause(tiny_model, n=16, max_tokens=24)
    assert r.passed, r.line()


async def test_check_recompute_rescore(tiny_model: Path) -> None:
    r = await check_recompute_rescore(tiny_model)
    assert r.passed, r.line()


async def test_check_batch_invariance(tiny_model: Path) -> None:
    r = await check_batch_invariance(tiny_model, max_tokens=16)
    assert r.passed, r.line()


@pytest.mark.slow
def test_check_token_parity_migrate(tiny_model: Path) -> None:
    r = check_token_parity_migrate(tiny_model)
    assert r.passed, r.line()


@pytest.mark.slow
def test_check_reference_parity(tiny_model: Path) -> None:
    r = check_reference_parity(tiny_model, max_tokens=16)
    assert r.passed, r.line()


def test_check_bf16_parity_measures_a_real_difference(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = check_bf16_parity(tiny_model, max_tokens=16, requests=4)
    assert r.passed, r.line()
    assert r.figures["tokens"] == 64 and 0 < float(r.figures["p99"]) <= parity.BF16_P99_TOLERANCE
    monkeypatch.setattr(parity, "BF16_P99_TOLERANCE", 1e-6)  # bf16 is not fp32: caught
    assert not check_bf16_parity(tiny_model, max_tokens=16, requests=4).passed


async def test_errors_reach_only_their_request(tiny_model: Path) -> None:
    async with TorchBackend(tiny_model, max_model_len=64) as backend:
        ok = GenerationRequest(
            request_id="ok",
            prompt_ids=[5, 6, 7],
            sampling=SamplingParams(max_tokens=8, ignore_eos=True, seed=1),
        )
        bad = GenerationRequest(
            request_id="bad", prompt_ids=[5] * 100, sampling=SamplingParams(max_tokens=8)
        )
        oov = GenerationRequest(
            request_id="oov", prompt_ids=[10**9], sampling=SamplingParams(max_tokens=8)
        )

        async def drain(req: GenerationRequest) -> list[int]:
            return [t async for c in backend.generate(req) for t in c.token_ids]

        results = await asyncio.gather(drain(ok), drain(bad), drain(oov), return_exceptions=True)
        assert isinstance(results[0], list) and len(results[0]) == 8
        assert isinstance(results[1], BackendError) and "context length" in str(results[1])
        assert isinstance(results[2], BackendError) and "vocabulary" in str(results[2])


async def test_cancelled_generation_frees_its_request(tiny_model: Path) -> None:
    async with TorchBackend(tiny_model) as backend:
        req = GenerationRequest(
            request_id="c",
            prompt_ids=[5, 6],
            sampling=SamplingParams(max_tokens=10_000, ignore_eos=True),
        )

        async def consume() -> None:
            async for _ in backend.generate(req):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)
        assert "c" not in backend.engine.requests
        assert backend.engine.scheduler.num_unfinished == 0


async def test_pause_requires_nothing_and_weights_need_pause(tiny_model: Path) -> None:
    async with TorchBackend(tiny_model) as backend:
        with pytest.raises(BackendError, match="pause"):
            await backend.load_weights({})
        await backend.pause("keep")
        version = await backend.load_weights(backend.engine.runner.state_dict())
        await backend.resume()
        assert version == backend.policy_version == 1


class Echo(Environment):
    max_turns = 3

    @tool
    def echo(self, text: str) -> str:
        """Echo the text."""
        return text


async def test_rollout_on_the_torch_backend_with_restart_mid_turn(tiny_model: Path) -> None:
    """Episodes run on the real engine; a restart resume in the middle of generation rolls
    back the partial turn and the trajectory stays token-in-token-out."""
    first_token = asyncio.Event()

    class Signalling(TorchBackend):
        async def generate(self, request: GenerationRequest):  # type: ignore[no-untyped-def,override]
            async for chunk in super().generate(request):
                first_token.set()
                yield chunk

    async with Signalling(tiny_model) as backend:
        cfg = RolloutConfig(
            concurrency=4, progress="off", sampling=SamplingParams(temperature=1.0, max_tokens=48)
        )
        tasks = [Task(id=f"t{i}", data={"prompt": f"say something {i}"}) for i in range(4)]

        restarted_streams = 0

        async def disturb() -> None:
            nonlocal restarted_streams
            await first_token.wait()  # restart while generations are in flight
            await backend.pause("restart")
            restarted_streams = len(backend._streams)
            await backend.resume()

        async with RolloutEngine(backend, Echo(), cfg) as engine:
            disturber = asyncio.create_task(disturb())
            trajs = [t async for t in engine.run(tasks)]
            await disturber
    assert len(trajs) == 4 and restarted_streams > 0
    for t in trajs:
        assert t.status in ("ok", "truncated"), t.error
        gen = t.loss_mask.astype(bool)
        assert gen.sum() > 0 and (t.policy_version[gen] == 0).all()
        for turn in t.turns:  # every turn's sampled span is exactly what the mask marks
            assert (
                gen[turn.gen_start : turn.gen_end].all()
                and not gen[turn.gen_end : turn.env_end].any()
            )


async def test_restart_resume_rolls_back_and_replays(tiny_model: Path) -> None:
    from agentroll.validate.common import collect_stream, sample_request

    async with TorchBackend(tiny_model) as backend:
        prompt = backend.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
        ref = await collect_stream(backend, sample_request(0, prompt, 32))
        restarted = False

        async def on_token(n: int) -> None:
            nonlocal restarted
            if n >= 10 and not restarted:
                restarted = True
                await backend.pause("restart")
                await backend.resume()

        got = await collect_stream(backend, sample_request(0, prompt, 32), on_token)
    assert restarted and got[0] == ref[0] and got[1] == ref[1]


def test_steps_per_call_is_validated(tiny_model: Path) -> None:
    from agentroll.engine.engine import EngineConfig
    from agentroll.errors import ConfigError

    for bad in ({"steps_per_call": 0}, {"max_call_s": 0.0}, {"max_call_s": float("nan")}):
        with pytest.raises(ConfigError, match="steps_per_call"):
            EngineConfig(model=str(tiny_model), **bad)  # type: ignore[arg-type]


async def _chunks(backend: TorchBackend, rid: str, max_tokens: int) -> list[list[int]]:
    req = GenerationRequest(
        request_id=rid,
        prompt_ids=[5, 6, 7],
        sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=3),
    )
    return [chunk.token_ids async for chunk in backend.generate(req)]


async def test_several_steps_per_call_hand_over_tokens_in_runs_and_change_none(
    tiny_model: Path,
) -> None:
    async with TorchBackend(tiny_model, steps_per_call=1) as one:
        single = await _chunks(one, "a", 24)
    async with TorchBackend(tiny_model, steps_per_call=4, max_call_s=60.0) as four:
        runs = await _chunks(four, "a", 24)
        calls = four.steps
    assert [len(c) for c in single] == [1] * 24  # one hand-off per token
    assert [t for c in runs for t in c] == [t for c in single for t in c]  # seed for seed
    assert max(len(c) for c in runs) == 4 and len(runs) <= 7  # at most 4 steps per hand-off
    assert calls <= 7


async def test_a_pause_stops_a_run_of_steps_after_the_step_in_flight(tiny_model: Path) -> None:
    async with TorchBackend(tiny_model, steps_per_call=64, max_call_s=60.0) as backend:
        gen = backend.generate(
            GenerationRequest(
                request_id="p",
                prompt_ids=[5, 6, 7],
                sampling=SamplingParams(max_tokens=512, ignore_eos=True, seed=1),
            )
        )
        first = await anext(gen)  # a run of up to 64 steps has ended: the next one runs now
        await asyncio.sleep(0.002)
        await backend.pause()
        steps = backend.engine.num_steps
        done = backend.inflight()["p"]
        # the run in flight ended after its current step, not 64 steps later
        assert done - len(first.token_ids) < 64
        await asyncio.sleep(0.05)
        assert backend.engine.num_steps == steps and backend.inflight()["p"] == done
        await backend.resume()
        total = len(first.token_ids) + sum([len(c.token_ids) async for c in gen])
        assert total == 512


def test_restores_are_handed_over_a_few_at_a_time() -> None:
    """Calls moved in with their KV are restored at most ``restore_tokens_per_call`` KV
    tokens per hand-off (at least one each time), in order: a pause of this replica then
    waits for one step's share, not for all of a group's moved calls at once."""
    from types import SimpleNamespace

    def restore(n: int) -> tuple[str, Any]:
        return ("restore", SimpleNamespace(has_kv=True, num_computed_tokens=n))

    queued = [("add", "a"), restore(300), restore(300), ("abort", "b"), restore(500), restore(10)]
    fake = SimpleNamespace(
        _commands=list(queued),
        engine=SimpleNamespace(config=SimpleNamespace(restore_tokens_per_call=700)),
    )
    rounds = []
    while fake._commands:
        rounds.append(TorchBackend._take_commands(fake))  # type: ignore[arg-type]
    assert rounds == [queued[:4], queued[4:]]
    big, small = restore(5000), restore(1)
    fake._commands = [big, small]  # one over the budget still goes, alone
    assert TorchBackend._take_commands(fake) == [big]  # type: ignore[arg-type]
    assert fake._commands == [small]
