"""Shared pieces of the gateway tests: a gateway served in a background thread (so that
synchronous clients such as openai and langchain can call it from the test's thread) or on
the test's loop, backends that are observed while they generate, and the invariants every
published trajectory must keep (token-in/token-out, per-token provenance)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import msgspec
import numpy as np

from agentroll.backends.base import Backend, GenerationChunk, GenerationRequest
from agentroll.backends.mock import MockBackend
from agentroll.bench.gateway_load import TOOLS_JSON
from agentroll.chat import ChatTokenizer
from agentroll.gateway import Gateway, GatewayConfig, serve_gateway
from agentroll.types import Trajectory

B = TypeVar("B", bound=Backend)


class Served:
    """A gateway on its own event loop thread: ``url``, ``gateway``, ``run(coro)``."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self.gateway: Gateway | None = None

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextmanager
def served_gateway(
    make_backend: Callable[[], Backend], config: GatewayConfig | None = None, **kwargs: Any
) -> Iterator[Served]:
    served = Served()
    ready = threading.Event()
    stop: asyncio.Event | None = None
    errors: list[BaseException] = []

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        backend = make_backend()
        async with (
            backend,
            Gateway(backend, config=config, **kwargs) as gw,
            serve_gateway(gw) as url,
        ):
            served.url, served.gateway = url, gw
            ready.set()
            await stop.wait()

    def thread() -> None:
        asyncio.set_event_loop(served.loop)
        try:
            served.loop.run_until_complete(main())
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)
            ready.set()

    t = threading.Thread(target=thread, daemon=True)
    t.start()
    assert ready.wait(30), "the gateway did not start"
    if errors:
        raise errors[0]
    try:
        yield served
    finally:
        assert stop is not None
        served.loop.call_soon_threadsafe(stop.set)
        t.join(30)
        if errors:
            raise errors[0]


def open_session(url: str, **fields: Any) -> str:
    reply = httpx.post(f"{url}/sessions", json=fields, timeout=10)
    reply.raise_for_status()
    return str(reply.json()["id"])


def end_session(url: str, sid: str, reward: float | None = None) -> None:
    if reward is not None:
        r = httpx.post(f"{url}/sessions/{sid}/reward", json={"reward": reward}, timeout=10)
        r.raise_for_status()
    httpx.post(f"{url}/sessions/{sid}/end", json={}, timeout=10).raise_for_status()


@contextlib.asynccontextmanager
async def gateway_on_loop(
    backend: Backend, config: GatewayConfig | None = None, **kwargs: Any
) -> AsyncIterator[tuple[Gateway, str]]:
    """The backend, a gateway over it and its HTTP server, on the running loop (for async
    clients); yields the gateway and its URL."""
    async with backend, Gateway(backend, config=config, **kwargs) as gw, serve_gateway(gw) as url:
        yield gw, url


async def aopen_session(url: str, **fields: Any) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        reply = await client.post(f"{url}/sessions", json=fields)
    reply.raise_for_status()
    return str(reply.json()["id"])


async def aend_session(url: str, sid: str, reward: float | None = None) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        if reward is not None:
            r = await client.post(f"{url}/sessions/{sid}/reward", json={"reward": reward})
            r.raise_for_status()
        (await client.post(f"{url}/sessions/{sid}/end", json={})).raise_for_status()


# -- scripted episodes -----------------------------------------------------------------------

# the benchmark's tool: one definition of the `add` function for the load and the tests
TOOLS: list[dict[str, Any]] = msgspec.json.decode(TOOLS_JSON)
CALL_ADD = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ANSWER = "The answer is 5."
TOOL_OUTPUT = "sum=5"


def add_script(request: GenerationRequest) -> str:
    """A tool call on the session's first call, the final answer after it."""
    return CALL_ADD if request.turn_index == 0 else ANSWER


def script_ids(tok: ChatTokenizer, text: str) -> list[int]:
    """What the MockBackend samples for ``text``: its encoding and the end-of-turn token."""
    return [*tok.encode(text), tok.eot_id]


def mock_logprob(pos: int) -> float:
    """The MockBackend's logprob of the token it samples at position ``pos``."""
    return -0.01 * (pos % 97 + 1)


class PacedMock(MockBackend):
    """A MockBackend whose chunks come ``pace`` seconds apart (a slow model), which counts
    the chunks each generation yielded (``chunks``) and notes how it ended (``outcomes``:
    ``finished``, its last chunk was taken, or ``closed``, closed or cancelled before)."""

    def __init__(self, script: Any, *, pace: float, **kwargs: Any) -> None:
        super().__init__(script, **kwargs)
        self.pace = pace
        self.chunks: dict[str, int] = {}
        self.outcomes: dict[str, str] = {}
        self._changed = asyncio.Condition()

    async def _note(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Return once ``predicate()`` holds (it is checked whenever a generation moves)."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        rid = request.request_id
        self.outcomes[rid], self.chunks[rid] = "running", 0
        finished = False
        try:
            async with contextlib.aclosing(super().generate(request)) as chunks:  # type: ignore[type-var]
                async for chunk in chunks:
                    if self.chunks[rid]:
                        await asyncio.sleep(self.pace)
                    finished = chunk.finish_reason is not None
                    self.chunks[rid] += 1
                    await self._note()
                    yield chunk
        finally:
            self.outcomes[rid] = "finished" if finished else "closed"
            await asyncio.shield(self._note())


# -- what the client saw ---------------------------------------------------------------------


def message_of(chunks: list[Any]) -> tuple[dict[str, Any], str | None, list[float]]:
    """The assistant message a streamed reply carried, as a client rebuilds it from the
    deltas; its finish reason; the logprobs of its tokens."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    logprobs: list[float] = []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(
                    tc.index,
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                entry["id"] = tc.id or entry["id"]
                if tc.function is not None:
                    entry["function"]["name"] += tc.function.name or ""
                    entry["function"]["arguments"] += tc.function.arguments or ""
            if choice.logprobs is not None and choice.logprobs.content:
                logprobs += [e.logprob for e in choice.logprobs.content]
            finish = choice.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish, logprobs


# -- what the backend did --------------------------------------------------------------------


@dataclass
class Generation:
    """One backend call as the gateway consumed it."""

    request: GenerationRequest
    chunks: list[GenerationChunk] = field(default_factory=list)
    outcome: str = "running"  # finished | closed (before its last chunk)

    @property
    def prompt(self) -> list[int]:
        return list(self.request.prompt_ids)

    def _per_token(self, value: Callable[[GenerationChunk], list[Any]]) -> list[Any]:
        out: list[Any] = []
        for c in self.chunks:
            if c.rollback:  # the backend took back tokens it had streamed
                del out[len(out) - c.rollback :]
            out += value(c)
        return out

    @property
    def ids(self) -> list[int]:
        return self._per_token(lambda c: list(c.token_ids))

    @property
    def logprobs(self) -> list[float]:
        return self._per_token(lambda c: list(c.logprobs))

    @property
    def policy(self) -> list[int]:
        return self._per_token(lambda c: [c.policy_version] * len(c.token_ids))

    @property
    def kv(self) -> list[int]:
        return self._per_token(lambda c: [c.kv_version] * len(c.token_ids))


class Recorder:
    """Observes a backend's ``generate`` (any backend): each request, the chunks it streamed
    and how it ended.  ``attach`` returns the backend, so it fits ``served_gateway``."""

    def __init__(self) -> None:
        self.generations: list[Generation] = []

    def attach(self, backend: B) -> B:
        inner = backend.generate

        async def generate(request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
            gen = Generation(request)
            self.generations.append(gen)
            try:
                async with contextlib.aclosing(inner(request)) as chunks:  # type: ignore[type-var]
                    async for chunk in chunks:
                        gen.chunks.append(chunk)
                        yield chunk
            finally:
                last = gen.chunks[-1].finish_reason if gen.chunks else None
                gen.outcome = "finished" if last is not None else "closed"

        backend.generate = generate  # type: ignore[method-assign]
        return backend

    def of(self, sid: str) -> list[Generation]:
        return [g for g in self.generations if g.request.episode_id == sid]


# -- invariants of published trajectories ----------------------------------------------------


def _is_prefix(prefix: list[int], ids: list[int]) -> bool:
    return len(prefix) <= len(ids) and ids[: len(prefix)] == prefix


def check_trajectory(
    traj: Trajectory,
    generations: list[Generation],
    *,
    logprob_of: Callable[[int], float] | None = None,
) -> None:
    """Token-in, token-out and per-token provenance of one published trajectory.

    Each turn's ``[gen_start, gen_end)`` holds exactly the ids a finished backend call
    sampled, and that call's prompt is the trajectory's tokens before it; logprobs and
    versions are the backend's on sampled tokens (``logprob_of(position)`` too, when given),
    NaN and -1 elsewhere; ``loss_mask`` is 1 exactly on sampled tokens; the turns tile the
    trajectory after its first prompt."""
    ids = traj.token_ids.tolist()
    n = len(ids)
    assert traj.turns, "a published trajectory has at least one turn"
    assert traj.turns[0].gen_start == traj.prompt_len > 0
    for a, b in zip(traj.turns, traj.turns[1:], strict=False):
        assert a.gen_start < a.gen_end <= a.env_end == b.gen_start
    assert traj.turns[-1].env_end == n
    mask = np.zeros(n, dtype=np.uint8)
    for turn in traj.turns:
        gs, ge = turn.gen_start, turn.gen_end
        mask[gs:ge] = 1
        matches = [
            g
            for g in generations
            if g.outcome == "finished" and g.prompt == ids[:gs] and g.ids == ids[gs:ge]
        ]
        assert matches, f"turn {turn.index}: no backend call sampled tokens [{gs}, {ge})"
        gen = matches[0]
        np.testing.assert_array_equal(
            traj.logprobs[gs:ge], np.array(gen.logprobs, dtype=np.float32)
        )
        assert traj.policy_version[gs:ge].tolist() == gen.policy
        assert traj.kv_version[gs:ge].tolist() == gen.kv
        if logprob_of is not None:
            want = np.array([logprob_of(p) for p in range(gs, ge)], dtype=np.float32)
            np.testing.assert_array_equal(traj.logprobs[gs:ge], want)
    np.testing.assert_array_equal(traj.loss_mask, mask)
    sampled, context = mask == 1, mask == 0
    assert not np.isnan(traj.logprobs[sampled]).any()
    assert np.isnan(traj.logprobs[context]).all()
    assert (traj.policy_version[context] == -1).all() and (traj.kv_version[context] == -1).all()
    assert (traj.policy_version[sampled] >= 0).all() and (traj.kv_version[sampled] >= 0).all()
    assert traj.num_generated == int(mask.sum())


def check_session(
    trajs: list[Trajectory],
    generations: list[Generation],
    *,
    logprob_of: Callable[[int], float] | None = None,
) -> None:
    """``check_trajectory`` on each, and every request the backend got for the session is
    a prefix of one of its trajectories (of the only one, when the session never forked)."""
    assert trajs
    for traj in trajs:
        check_trajectory(traj, generations, logprob_of=logprob_of)
    tokens = [t.token_ids.tolist() for t in trajs]
    sid = trajs[0].id.split("-")[0]
    mine = [g for g in generations if g.request.episode_id == sid]
    assert mine, "the backend saw none of this session's calls"
    for g in mine:
        assert any(_is_prefix(g.prompt, ids) for ids in tokens), "a prompt is no prefix"


def env_text(tok: ChatTokenizer, traj: Trajectory, turn: int) -> str:
    """The environment's reply after ``turn`` as the trajectory holds it."""
    t = traj.turns[turn]
    return tok.decode(traj.token_ids[t.gen_end : t.env_end].tolist(), skip_special_tokens=False)


def transcript(tok: ChatTokenizer, traj: Trajectory) -> str:
    """A short account of a trajectory: per turn the prompt, sampled and reply tokens."""
    lines = [
        f"trajectory {traj.id[:8]} status={traj.status} tokens={traj.num_tokens} "
        f"sampled={traj.num_generated} reward={traj.reward} forks={len(traj.forks)}"
    ]
    for t in traj.turns:
        calls = ", ".join(f"{c.name}({c.arguments})" for c in t.tool_calls) or "-"
        reply = tok.decode(traj.token_ids[t.gen_end : t.env_end].tolist()).strip()
        lines.append(
            f"  turn {t.index}: prompt={t.gen_start} sampled={t.gen_end - t.gen_start} "
            f"tool_reply={t.env_end - t.gen_end} finish={t.finish_reason} calls={calls} "
            f"text={t.text[:64]!r} reply={reply[:64]!r}"
        )
    return "\n".join(lines)


# -- no internet -----------------------------------------------------------------------------

_LOCAL = {"127.0.0.1", "::1", "localhost", "", None}


def forbid_internet(monkeypatch: Any) -> None:
    """Make any connection or name lookup beyond loopback fail loudly (a client that tries
    to fetch something, e.g. tiktoken's encodings, fails the test instead of hanging)."""
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def check(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in _LOCAL:
            raise AssertionError(f"a test tried to reach {address!r} (no internet in tests)")

    def connect(sock: socket.socket, address: Any) -> None:
        check(sock, address)
        real_connect(sock, address)

    def connect_ex(sock: socket.socket, address: Any) -> int:
        check(sock, address)
        return real_connect_ex(sock, address)

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name not in _LOCAL:
            raise AssertionError(f"a test tried to resolve {name!r} (no internet in tests)")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9")  # never api.openai.com
