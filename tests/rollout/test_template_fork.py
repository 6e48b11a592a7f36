"""A class environment whose chat template rewrites history forks into a new sample each
time (recorded), instead of failing with ChatTemplateError or drifting from what was
sampled; the samples survive a checkpoint and share the episode's reward."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from agentroll.backends.base import GenerationChunk, GenerationRequest
from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.env import Environment, EpisodeState, tool
from agentroll.model.tokenizer import build_tokenizer
from agentroll.rollout.builder import common_prefix
from agentroll.rollout.checkpoint import load_checkpoints
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.types import Task, Trajectory

# only the last two messages are rendered: adding a message rewrites what came before
REWRITING = (
    "{% for m in messages[-2:] %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'


class Echo(Environment):
    max_turns = 3

    @tool
    def echo(self, text: str) -> str:
        """Say it back."""
        return f"echo {text}"

    async def reward(self, trajectory: Trajectory, state: EpisodeState) -> float:
        return 0.75


class SecondTurn(MockBackend):
    """Tells when the second turn's generation starts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.second = asyncio.Event()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if request.turn_index == 1:
            self.second.set()
        async for chunk in super().generate(request):
            yield chunk


def script(request: GenerationRequest) -> str:
    return CALL if request.turn_index < 2 else "done"


async def test_a_rewriting_template_forks_each_turn() -> None:
    tok = ChatTokenizer(build_tokenizer(), REWRITING, eot_token="<|im_end|>")
    backend = MockBackend(script, tokenizer=tok, record=True)
    config = RolloutConfig(progress="off")
    async with backend, RolloutEngine(backend, Echo(), config, tokenizer=tok) as engine:
        trajs = [t async for t in engine.run([Task(id="t", data={"prompt": "go"})])]
    assert [t.stop_reason for t in trajs[:-1]] == ["forked", "forked"]
    assert [t.status for t in trajs] == ["ok"] * 3
    main = trajs[-1]
    assert main.id != trajs[0].id and len({t.id for t in trajs}) == 3
    assert all(t.reward == 0.75 for t in trajs)  # one episode, one reward
    assert len({t.group_id for t in trajs}) == 1
    assert [f.reason for t in trajs[1:] for f in t.forks] == ["template_rewrites"] * 2
    # each sample is token-in, token-out: its one request's prompt is its prefix, and what
    # follows is exactly what the backend sampled for it
    for t, req in zip(trajs, backend.requests, strict=True):
        ids = t.token_ids.tolist()
        assert ids[: len(req.prompt_ids)] == list(req.prompt_ids)
        (turn,) = t.turns
        assert turn.gen_start == len(req.prompt_ids) == t.prompt_len
        sampled = ids[turn.gen_start : turn.gen_end]
        assert sampled == tok.encode(CALL if req.turn_index < 2 else "done") + [tok.eot_id]
        assert np.flatnonzero(t.loss_mask).tolist() == list(range(turn.gen_start, turn.gen_end))
    for before, after in itertools.pairwise(trajs):
        (fork,) = after.forks
        assert fork.common_tokens == common_prefix(before.token_ids, after.token_ids)
        assert fork.mismatched_tokens == before.num_tokens - fork.common_tokens > 0
    assert "echo hi" in tok.decode(main.token_ids.tolist())  # the tool's result is rendered


async def test_the_samples_of_a_forked_episode_survive_a_checkpoint(tmp_path: Path) -> None:
    tok = ChatTokenizer(build_tokenizer(), REWRITING, eot_token="<|im_end|>")
    config = RolloutConfig(progress="off")
    task = Task(id="t", data={"prompt": "go"})
    backend = SecondTurn(script, tokenizer=tok, latency=0.05)
    async with backend, RolloutEngine(backend, Echo(), config, tokenizer=tok) as engine:
        consumer = asyncio.create_task(_collect(engine.run([task])))
        await backend.second.wait()  # the first fork happened: stopped in the second sample

        async def leave() -> None:
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)

        report = await engine.stop(tmp_path, leave=leave)
    assert len(report.checkpoints) == 1 and not report.undelivered
    backend = MockBackend(script, tokenizer=tok)
    async with backend, RolloutEngine(backend, Echo(), config, tokenizer=tok) as engine:
        trajs = [t async for t in engine.run([], checkpoints=load_checkpoints(tmp_path))]
    assert [t.stop_reason for t in trajs] == ["forked", "forked", "no_tool_call"]
    assert len({t.id for t in trajs}) == 3 and all(t.reward == 0.75 for t in trajs)
    assert [len(t.forks) for t in trajs] == [0, 1, 1]


async def _collect(run: AsyncIterator[Trajectory]) -> list[Trajectory]:
    return [t async for t in run]
