"""A weight sync while streamed calls are in flight, under ``keep``: the calls pause at a
chunk boundary and go on under the new weights; nothing restarts, every token keeps the
version that sampled it, and each client receives its whole reply."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import openai
import pytest
from gateway_helpers import (
    PacedMock,
    Recorder,
    aend_session,
    aopen_session,
    check_session,
    forbid_internet,
    gateway_on_loop,
    message_of,
    mock_logprob,
    script_ids,
)

from agentroll.chat import ChatTokenizer
from agentroll.rollout.pause import EpisodeView
from agentroll.types import ResumePolicy

LONG = " ".join(f"word{k}" for k in range(30))  # ~60 tokens: the sync lands mid-stream


@pytest.fixture(autouse=True)
def _no_internet(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_internet(monkeypatch)


@dataclass
class Update:
    """What ``Gateway.sync`` needs of a weight update here (MockBackend.apply reads it)."""

    version: int


@pytest.mark.parametrize("chunk_size", [1, 3])
async def test_sync_under_keep_mid_stream(tok: ChatTokenizer, chunk_size: int) -> None:
    backend = PacedMock([LONG], tokenizer=tok, chunk_size=chunk_size, pace=0.005)
    recorder = Recorder()
    recorder.attach(backend)
    expected = script_ids(tok, LONG)
    num_chunks = -(-len(expected) // chunk_size)
    assert num_chunks >= 20
    async with gateway_on_loop(backend) as (gw, url):
        sids = [await aopen_session(url, task_id="sync") for _ in range(3)]

        async def streamed(sid: str) -> tuple[str, str | None]:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid, max_retries=0)
            events = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "talk"}], stream=True
            )
            reply, finish, _ = message_of([c async for c in events])
            return reply["content"], finish

        calls = [asyncio.create_task(streamed(sid)) for sid in sids]
        # every call has streamed a few chunks and none is done: the sync lands mid-turn
        await backend.wait_for(
            lambda: len(backend.chunks) == 3 and min(backend.chunks.values()) >= 3
        )
        at_sync = dict(backend.chunks)
        report = await gw.sync(Update(1), policy="keep")
        assert set(backend.outcomes.values()) == {"running"}
        assert all(n < num_chunks for n in at_sync.values())
        replies = await asyncio.gather(*calls)
        for sid in sids:
            await aend_session(url, sid, reward=1.0)
        trajs = {t.id: t for t in gw.finished}
    assert replies == [(LONG, "stop")] * 3  # each client saw its whole reply
    assert report.strategy == "pause" and report.version == 1
    kinds = [e[0] for e in backend.events]
    assert kinds == ["pause", "apply", "resume"]
    resumed = backend.events[2][1]
    assert resumed == {g.request.request_id: "keep" for g in recorder.generations}
    assert len(recorder.generations) == 3  # nothing restarted: one generation per call
    assert all(not c.rollback for g in recorder.generations for c in g.chunks)
    for sid in sids:
        traj = trajs[sid]
        check_session([traj], recorder.of(sid), logprob_of=mock_logprob)
        (turn,) = traj.turns
        assert traj.token_ids[turn.gen_start :].tolist() == expected
        versions = traj.policy_version[turn.gen_start : turn.gen_end]
        switch = int(np.argmax(versions == 1))
        assert 0 < switch < len(versions)
        assert (versions[:switch] == 0).all() and (versions[switch:] == 1).all()
        assert switch % chunk_size == 0  # at a chunk boundary
        assert switch >= at_sync[recorder.of(sid)[0].request.request_id] * chunk_size
        # the mock reports its weights' version as the KV's too (no KV kept across)
        np.testing.assert_array_equal(traj.kv_version[turn.gen_start : turn.gen_end], versions)


async def test_the_policy_sees_each_call_and_its_versions(tok: ChatTokenizer) -> None:
    """A resume policy is asked once per call in flight, with what it generated and the
    versions of the session's sampled tokens (a second sync sees the first one's tokens)."""
    backend = PacedMock([LONG], tokenizer=tok, chunk_size=1, pace=0.005)
    seen: list[EpisodeView] = []

    def policy(view: EpisodeView) -> ResumePolicy:
        seen.append(view)
        return "keep"

    async with gateway_on_loop(backend) as (gw, url):
        sid = await aopen_session(url, task_id="views")
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=sid, max_retries=0)

        async def streamed() -> None:
            events = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "talk"}], stream=True
            )
            async for _ in events:
                pass

        call = asyncio.create_task(streamed())
        await backend.wait_for(lambda: min(backend.chunks.values(), default=0) >= 3)
        await gw.sync(Update(1), policy=policy)
        await backend.wait_for(lambda: min(backend.chunks.values(), default=0) >= 10)
        await gw.sync(Update(2), policy=policy)
        await call
        await aend_session(url, sid)
    first, second = seen
    assert first.episode_id == second.episode_id == sid
    assert first.request_id == second.request_id
    assert 3 <= first.tokens_generated < second.tokens_generated
    assert (first.min_policy_version, first.min_kv_version) == (0, 0)
    assert (second.min_policy_version, second.min_kv_version) == (0, 0)
    # asked at resume, after the apply: the version it resumes under
    assert (first.policy_version, second.policy_version) == (1, 2)
