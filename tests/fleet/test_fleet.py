"""FleetBackend over real tiny-model replicas: migration and failover parity, the four update
strategies under load, per-request resume policies, version pinning and faults.

What each test asserts is a learning-semantics property (DESIGN.md "Fleet", invariants 2-5):
tokens and logprobs that do not change when a call moves, per-token provenance that never
lies (``kv_version <= policy_version``, versions non-decreasing within a turn), every episode
finishing, every replica ending at the version the trainer published.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agentroll.backends.base import GenerationChunk, GenerationRequest, SamplingParams
from agentroll.chat import ChatTokenizer
from agentroll.env import Environment, EpisodeState, load_environment
from agentroll.errors import BackendError, ConfigError, WeightSyncError
from agentroll.fleet import FleetBackend, LocalReplica, Replica, SyncReport
from agentroll.model.tokenizer import tiny_chat_tokenizer
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.rollout.pause import fixed_policy
from agentroll.testing import SyntheticTrainer
from agentroll.types import Message, Task, Trajectory
from agentroll.validate.common import collect_stream, sample_prompts

KINDS = ["local", pytest.param("ray", marks=pytest.mark.ray)]

MAX_TOKENS = 24
ENGINE = {"kv_cache_mb": 4, "max_num_seqs": 16}  # small KV pools: 4 replicas fit anywhere

Make = Callable[..., Awaitable[list[Replica]]]


@pytest.fixture(params=KINDS)
def make(request: pytest.FixtureRequest, make_replicas: Any, tiny_model: Path) -> Make:
    """``await make(n, **engine_overrides)``: n started replicas of the tiny model, in this
    process or in Ray actors (closed by ``make_replicas`` at teardown)."""
    kind = request.param

    async def build(n: int, **overrides: Any) -> list[Replica]:
        return list(await make_replicas(kind, n, tiny_model, **{**ENGINE, **overrides}))

    return build


@pytest.fixture(scope="module")
def updates(tiny_model: Path) -> list[Any]:
    """Three consecutive delta ``WeightUpdate``s of the tiny model (versions 1, 2, 3), made
    once: what a trainer publishes after each step."""
    trainer = SyntheticTrainer(tiny_model)
    return [trainer.step() for _ in range(3)]


@functools.cache
def tokenizer() -> ChatTokenizer:
    """The tiny model's tokenizer (a fleet of Ray replicas holds none in this process)."""
    return tiny_chat_tokenizer()


# -- helpers --------------------------------------------------------------------------------


class Traffic:
    """Watches the chunks every replica streams (wraps ``generate``/``restore`` of each
    replica object), so a test can act at a moment of generation instead of sleeping."""

    def __init__(self, fleet: FleetBackend) -> None:
        self.fleet = fleet
        self.chunks: list[tuple[str, str, GenerationChunk]] = []  # (replica, request, chunk)
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        self._ended: str | None = None  # why later waits fail at once (the episodes ended)
        # cleared: every call holds its next chunk, so none ends (a test that needs calls
        # in flight at a moment of its choosing, whatever the machine's load)
        self.flowing = asyncio.Event()
        self.flowing.set()
        for replica in fleet.replicas.values():
            for method in ("generate", "restore"):
                setattr(replica, method, self._wrap(replica.name, getattr(replica, method)))

    def _wrap(self, name: str, open_stream: Callable[[Any], AsyncIterator[GenerationChunk]]) -> Any:
        async def watched(arg: Any) -> AsyncIterator[GenerationChunk]:
            stream = open_stream(arg)  # arg: a GenerationRequest or a RequestSnapshot
            try:
                async for chunk in stream:
                    self.chunks.append((name, arg.request_id, chunk))
                    await self.flowing.wait()
                    yield chunk
                    self._check()
            finally:
                await stream.aclose()  # type: ignore[attr-defined]

        return watched

    def fail_waiters(self, why: str) -> None:
        """Fail every wait, now and later (a wait that starts after the episodes ended, say
        one the test reaches only after an update it ran meanwhile, must not hang)."""
        self._ended = why
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(AssertionError(why))
        self._waiters = []

    def _check(self) -> None:
        for pred, fut in list(self._waiters):
            if not fut.done() and pred():
                fut.set_result(None)
        self._waiters = [(p, f) for p, f in self._waiters if not f.done()]

    async def wait(self, pred: Callable[[], bool], timeout: float = 30.0) -> None:
        """Return once ``pred()`` holds: checked after every streamed chunk, and every 10 ms
        for what no chunk announces (a replica found dead, a failover started)."""
        if self._ended is not None and not pred():
            raise AssertionError(self._ended)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((pred, fut))
        try:
            async with asyncio.timeout(timeout):
                while not pred():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(fut), 0.01)
                    if fut.done():
                        fut.result()  # raises when the episodes ended first
                        return
        finally:
            self._waiters = [(p, f) for p, f in self._waiters if f is not fut]
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # retrieved: no "never retrieved" warning

    def busy(self, calls: int = 4, tokens: int = 2) -> Callable[[], bool]:
        """At least ``calls`` calls in flight with ``tokens`` delivered each."""
        return lambda: sum(c.delivered >= tokens for c in self.fleet._calls.values()) >= calls

    def since(self, mark: int) -> set[str]:
        """Replicas that streamed a token after ``mark = len(traffic.chunks)``."""
        return {name for name, _, chunk in self.chunks[mark:] if chunk.token_ids}


def request(
    i: int, prompt: list[int], max_tokens: int = MAX_TOKENS, tag: str = "req"
) -> GenerationRequest:
    """Request ``i`` (seeded by ``i``; ``tag`` keeps the ids of two runs apart)."""
    return GenerationRequest(
        request_id=f"{tag}-{i}",
        prompt_ids=prompt,
        sampling=SamplingParams(
            temperature=1.0, max_tokens=max_tokens, seed=1000 + i, ignore_eos=True
        ),
        episode_id=f"ep-{i}",
    )


Collected = tuple[list[int], list[float], list[tuple[int, int]]]


async def collect(
    fleet: FleetBackend,
    req: GenerationRequest,
    on_token: Callable[[int], Awaitable[None]] | None = None,
) -> Collected:
    return await collect_stream(fleet, req, on_token)


def turn_spans(traj: Trajectory) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(policy_version, kv_version) of each turn's sampled tokens."""
    for turn in traj.turns:
        span = slice(turn.gen_start, turn.gen_end)
        yield traj.policy_version[span], traj.kv_version[span]


def check_provenance(traj: Trajectory, newest: int) -> None:
    """Invariant 2 on a finished trajectory: sampled tokens carry a real version, never a KV
    newer than the weights that sampled them, versions never go back within a turn."""
    assert traj.status != "failed", traj.error
    gen = traj.loss_mask.astype(bool)
    assert gen.any()
    pol, kv = traj.policy_version[gen], traj.kv_version[gen]
    assert ((pol >= 0) & (pol <= newest)).all() and (kv >= 0).all()
    assert (kv <= pol).all(), (pol, kv)
    assert (traj.policy_version[~gen] == -1).all() and np.isnan(traj.logprobs[~gen]).all()
    for turn in traj.turns:  # the mask marks exactly each turn's sampled span
        assert gen[turn.gen_start : turn.gen_end].all()
        assert not gen[turn.gen_end : turn.env_end].any()
    for pol_t, kv_t in turn_spans(traj):
        assert (np.diff(pol_t) >= 0).all(), pol_t
        assert (np.diff(kv_t) >= 0).all(), kv_t


def assert_quiet(fleet: FleetBackend) -> None:
    """Nothing in flight, no load left on any replica."""
    assert fleet._calls == {}
    assert all(s.load == 0 for s in fleet.router.slots.values()), fleet.router.slots


async def no_blocks_in_use(fleet: FleetBackend) -> None:
    """Every KV block is free (or only cached) on every replica once nothing runs: the
    holds of moved calls were all handed back (at each replica's next step boundary)."""

    def used() -> dict[str, int]:
        return {
            name: r.backend.engine.scheduler.block_manager.num_used_blocks  # type: ignore[attr-defined]
            for name, r in fleet.replicas.items()
        }

    for _ in range(100):
        if not any(used().values()):
            return
        await asyncio.sleep(0.02)
    holds = [o for o in gc.get_objects() if type(o).__name__ == "KVHold"]
    referrers = [type(r).__name__ for h in holds for r in gc.get_referrers(h)]
    # who keeps the snapshots that keep the holds (a frame: which function)
    snaps = [r for h in holds for r in gc.get_referrers(h) if type(r).__name__ == "RequestSnapshot"]
    keepers = [
        f"frame {r.f_code.co_name}" if isinstance(r, types.FrameType) else type(r).__name__
        for snap in snaps
        for r in gc.get_referrers(snap)
    ]
    raise AssertionError(
        f"KV blocks still in use (held?) after the run: {used()}; {len(holds)} KVHold "
        f"objects alive, referred to by {referrers[:10]}; their snapshots by {keepers[:10]}"
    )


def check_report(report: SyncReport, strategy: str, version: int, n_replicas: int) -> None:
    assert report.strategy == strategy and report.version == version
    assert report.failed == {}
    assert report.seconds > 0
    assert len(report.pause_ms) >= n_replicas
    assert all(ms >= 0 for ms in report.pause_ms)
    assert report.pause_ms and max(report.pause_ms) <= report.seconds * 1e3 + 1.0
    assert 0.0 <= report.busy_fraction <= 1.05
    assert report.migrated >= 0 and report.tokens_recomputed >= 0


def calculator_config(concurrency: int = 16, **sampling: Any) -> RolloutConfig:
    params = {"temperature": 1.0, "max_tokens": MAX_TOKENS, **sampling}
    return RolloutConfig(concurrency=concurrency, sampling=SamplingParams(**params), progress="off")


async def run_episodes(
    fleet: FleetBackend,
    traffic: Traffic,
    during: Callable[[RolloutEngine], Coroutine[Any, Any, Any]],
    *,
    env: Environment | None = None,
    episodes: int = 24,
    config: RolloutConfig | None = None,
    admit: Callable[[int], Coroutine[Any, Any, None]] | None = None,
) -> tuple[list[Trajectory], Any]:
    """Run ``episodes`` calculator episodes on ``fleet`` while ``during(engine)`` runs; a
    trigger ``during`` still waits for when the last episode ends fails the test.  ``admit``
    is awaited before each episode group starts (``RolloutEngine.run``)."""
    env = env or load_environment("calculator", num_tasks=episodes)
    tasks = list(env.tasks())[:episodes]
    cfg = config or calculator_config()
    async with RolloutEngine(fleet, env, cfg, tokenizer=tokenizer()) as engine:
        side = asyncio.create_task(during(engine))
        trajs = [t async for t in engine.run(tasks, admit=admit)]
        traffic.fail_waiters("the episodes ended before the test's trigger came")
        result = await side
    assert len(trajs) == episodes
    return trajs, result


def admit_after(first: int, event: asyncio.Event) -> Callable[[int], Coroutine[Any, Any, None]]:
    """An ``admit`` for ``run_episodes``: the first ``first`` episodes start at once, the
    rest once ``event`` is set (at most 120 s later)."""
    started = 0

    async def admit(n: int) -> None:
        nonlocal started
        started += n
        if started > first:
            await asyncio.wait_for(event.wait(), 120)

    return admit


class Chatter(Environment):
    """Multi-turn episodes without tools: the user always asks for more (3 turns)."""

    name = "chatter"
    max_turns = 3

    def tasks(self) -> list[Task]:
        return [Task(id=f"chat-{i}", data={"prompt": f"tell me about {i}"}) for i in range(64)]

    async def env_response(
        self, messages: list[Message], state: EpisodeState
    ) -> list[Message] | None:
        return [Message(role="user", content="go on")]


def chatter_config(concurrency: int = 12) -> RolloutConfig:
    # ~1 in 8 vocabulary ids ends a turn, so turns stop (finish "stop") and episodes go on
    stops = tuple(range(3, tokenizer().vocab_size, 8))
    return calculator_config(concurrency, stop_token_ids=stops)


# -- construction -----------------------------------------------------------------------------


async def test_config_errors_say_what_to_change(make_replicas: Any, tiny_model: Path) -> None:
    reps = await make_replicas("local", 2, tiny_model, **ENGINE)
    with pytest.raises(ConfigError, match="at least one"):
        FleetBackend([])
    with pytest.raises(ConfigError, match="unique"):
        FleetBackend([reps[0], reps[0]])
    with pytest.raises(ConfigError, match="strategy"):
        FleetBackend(reps, strategy="fast")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="group_size"):
        FleetBackend(reps, group_size=0)
    async with FleetBackend(reps) as fleet:
        with pytest.raises(ConfigError, match="strategy"):
            await fleet.update(object(), strategy="nope")  # type: ignore[arg-type]
        prompt = sample_prompts(tokenizer(), 1)[0]
        stream = fleet.generate(request(0, prompt))
        first = await anext(stream)
        with pytest.raises(BackendError, match="already streaming"):
            await anext(fleet.generate(request(0, prompt)))
        assert first.token_ids
        await stream.aclose()  # type: ignore[attr-defined]
        assert_quiet(fleet)


# -- parity: a call that moves yields what it would have yielded ----------------------------


@pytest.mark.parametrize("with_kv", [True, False], ids=["with-kv", "recompute-kv"])
async def test_migration_mid_generation_is_token_and_logprob_exact(
    make: Make, with_kv: bool
) -> None:
    """Each request is moved to the other replica after 8 tokens (its replica paused, its
    snapshot truncated to what was delivered): tokens and logprobs equal an unmoved run
    bit for bit.  Needs ``batch_invariant`` (otherwise logprobs differ by float rounding).
    Long requests: a remote replica generates ahead of its consumer, and a request that
    already finished there has nothing left to move (with 128 tokens a Ray replica finished
    the last of the four, waiting for the three moves before it, in about half the runs)."""
    reps = await make(2, batch_invariant=True)
    n_tokens = 512
    async with FleetBackend(reps, migrate_with_kv=with_kv) as fleet:
        prompts = sample_prompts(tokenizer(), 4)
        reference = await asyncio.gather(
            *(collect(fleet, request(i, p, n_tokens, tag="ref")) for i, p in enumerate(prompts))
        )
        moves: dict[int, tuple[str, str]] = {}
        one_at_a_time = asyncio.Lock()  # a move pauses a replica another request may be on

        def mover(i: int) -> Callable[[int], Awaitable[None]]:
            async def on_token(n: int) -> None:
                if n < 8 or i in moves:
                    return
                async with one_at_a_time:
                    call = fleet._calls[f"req-{i}"]
                    src = call.replica
                    assert src is not None
                    await fleet.pause_replica(src.name)
                    assert await fleet.migrate(call, {src.name})
                    await fleet.resume_replica(src.name)
                    assert call.replica is not None
                    moves[i] = (src.name, call.replica.name)

            return on_token

        moved = await asyncio.gather(
            *(collect(fleet, request(i, p, n_tokens), mover(i)) for i, p in enumerate(prompts))
        )
        assert_quiet(fleet)
    assert len(moves) == 4 and all(a != b and b for a, b in moves.values())
    assert fleet.stats.migrated == 4
    assert (fleet.stats.tokens_recomputed > 0) == (not with_kv)
    for (ids, lps, vers), (ref_ids, ref_lps, _) in zip(moved, reference, strict=True):
        assert len(ids) == n_tokens
        assert ids == ref_ids
        assert lps == ref_lps  # exact, not approximately
        assert set(vers) == {(0, 0)}


@pytest.mark.parametrize("held", [False, True], ids=["copied", "held"])
async def test_a_target_that_refuses_the_kv_recomputes_it(
    make_replicas: Any, tiny_model: Path, monkeypatch: pytest.MonkeyPatch, held: bool
) -> None:
    """A migration target that cannot take the moved KV now (too few free blocks) does not
    fail the call: it continues from the delivered tokens, KV recomputed, tokens unchanged.
    A KV held on the source (``hold_kv``) goes back to it at once: the refusal's exception
    keeps the restore's frame, and with it the snapshot, in a reference cycle until a
    garbage collection (CI saw 28 blocks kept on a replica after a rolling update)."""
    reps = await make_replicas("local", 2, tiny_model, **ENGINE, batch_invariant=True)
    for replica in reps:  # no room for moved KV anywhere; a recompute is admitted as usual
        scheduler = replica.backend.engine.scheduler
        monkeypatch.setattr(scheduler, "add_with_kv", lambda *a, **k: False)
    async with FleetBackend(reps) as fleet:
        assert fleet.hold_kv
        prompt = sample_prompts(tokenizer(), 1)[0]
        reference = await collect(fleet, request(0, prompt, tag="ref"))

        async def move_at_8(n: int) -> None:
            if n >= 8 and fleet.stats.migrated == 0:
                call = fleet._calls["req-0"]
                assert call.replica is not None
                src = call.replica
                await fleet.pause_replica(src.name)
                snapshot = None  # migrate takes a copy of the KV
                if held:
                    snapshot = (await src.snapshot_many(["req-0"], hold_kv=True))["req-0"]
                    assert snapshot.kv_hold is not None
                assert await fleet.migrate(call, {src.name}, snapshot=snapshot)
                del snapshot
                await fleet.resume_replica(src.name)

        got = await collect(fleet, request(0, prompt), move_at_8)
        assert_quiet(fleet)
        await no_blocks_in_use(fleet)
    assert fleet.stats.migrated == 1 and fleet.stats.failovers == 0
    assert fleet.stats.tokens_recomputed > 0
    assert got == reference


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["batch-invariant", "default"])
async def test_failover_after_kill_continues_from_delivered_tokens(
    make: Make, batch_invariant: bool
) -> None:
    """A replica dies mid-stream: its calls continue elsewhere from the tokens already
    delivered (the KV is recomputed there).  Tokens always equal an undisturbed run; logprobs
    are bit-exact with ``batch_invariant`` and equal up to float rounding without it (the
    recomputing prefill runs other matmul shapes than the incremental decode did)."""
    reps = await make(3, batch_invariant=batch_invariant)
    async with FleetBackend(reps) as fleet:
        prompts = sample_prompts(tokenizer(), 4)
        reference = await asyncio.gather(
            *(collect(fleet, request(i, p, tag="ref")) for i, p in enumerate(prompts))
        )
        killed: list[Replica] = []

        async def kill_at_8(n: int) -> None:
            if n >= 8 and not killed:  # chunks may carry several tokens
                replica = fleet._calls["req-0"].replica
                assert replica is not None
                killed.append(replica)
                replica.kill()  # type: ignore[attr-defined]

        traffic = Traffic(fleet)
        got = await asyncio.gather(
            *(
                collect(fleet, request(i, p), kill_at_8 if i == 0 else None)
                for i, p in enumerate(prompts)
            )
        )
        assert_quiet(fleet)
        dead = killed[0].name
        assert fleet.status(dead) == "down"
        assert fleet.stats.failovers >= 1 and fleet.stats.tokens_recomputed > 0
        mark = len(traffic.chunks)  # nothing is routed to the dead replica afterwards
        await asyncio.gather(
            *(collect(fleet, request(i, p, tag="after")) for i, p in enumerate(prompts))
        )
        assert dead not in traffic.since(mark)
    for (ids, lps, vers), (ref_ids, ref_lps, _) in zip(got, reference, strict=True):
        assert ids == ref_ids
        if batch_invariant:
            assert lps == ref_lps
        else:
            np.testing.assert_allclose(lps, ref_lps, rtol=0, atol=1e-4)
        assert set(vers) == {(0, 0)}


async def test_a_call_whose_consumer_left_during_failover_is_not_started(make: Make) -> None:
    """The consumer of a call goes away while the call's failover waits for a replica: when
    one becomes available nothing is started there for nobody, and no load is left behind."""
    reps = await make(2)
    src, spare = reps
    async with FleetBackend(reps) as fleet:
        traffic = Traffic(fleet)
        fleet._set_status(spare.name, "draining")  # the only other replica takes no calls
        prompt = sample_prompts(tokenizer(), 1)[0]
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in fleet.generate(request(0, prompt, max_tokens=10_000)):
                started.set()

        consumer = asyncio.create_task(consume())
        await started.wait()
        src.kill()  # type: ignore[attr-defined]
        await traffic.wait(lambda: fleet.stats.failovers == 1, timeout=10)
        consumer.cancel()  # the episode is cancelled while its call waits for a replica
        with pytest.raises(asyncio.CancelledError):
            await consumer
        mark = len(traffic.chunks)
        fleet._set_status(spare.name, "active")
        await collect(fleet, request(1, prompt))  # the fleet serves the next call
        assert {rid for _, rid, _ in traffic.chunks[mark:]} == {"req-1"}
        assert_quiet(fleet)


# -- update strategies under load -----------------------------------------------------------


@pytest.mark.parametrize("strategy", ["pause", "rolling", "drain", "background"])
async def test_strategy_under_load(make: Make, updates: list[Any], strategy: str) -> None:
    """Two updates land while calls are in flight: every episode finishes, every replica ends
    at the trainer's version, every token's provenance is honest."""
    n_replicas = 4
    fleet = FleetBackend(await make(n_replicas), strategy=strategy)  # type: ignore[arg-type]
    async with fleet:
        traffic = Traffic(fleet)

        async def load_until_cancelled(i: int, started: asyncio.Event) -> None:
            prompt = sample_prompts(tokenizer(), 1)[0]
            for j in range(10**6):  # 400-token calls back to back: bounded KV per call
                async for _ in fleet.generate(request(i * 10**6 + j, prompt, 400, tag="load")):
                    started.set()

        async def two_updates(engine: RolloutEngine) -> list[SyncReport]:
            reports = []
            for k, update in enumerate(updates[:2]):
                await traffic.wait(traffic.busy(calls=4))
                # rolling: extra calls keep every replica loaded for the whole sync, however
                # fast the episodes' short turns end, so busy_fraction measures the strategy
                load: list[asyncio.Task[None]] = []
                if strategy == "rolling":
                    started = [asyncio.Event() for _ in range(2 * n_replicas)]
                    load = [
                        asyncio.create_task(load_until_cancelled(100 * k + i, e))
                        for i, e in enumerate(started)
                    ]
                    await asyncio.gather(*(e.wait() for e in started))
                reports.append(await fleet.update(update, policies=engine.pauses.policies))
                for task in load:
                    task.cancel()
                await asyncio.gather(*load, return_exceptions=True)
                first_done.set()
            return reports

        # the second half of the episodes starts after the first update: a slow first update
        # (under CI load, or rolling with Ray) must not see every episode end before the
        # second trigger
        first_done = asyncio.Event()
        admitted = 0

        async def admit(_: int) -> None:
            nonlocal admitted
            admitted += 1
            if admitted > 24:
                await first_done.wait()

        trajs, reports = await run_episodes(fleet, traffic, two_updates, episodes=48, admit=admit)
        assert_quiet(fleet)
        if fleet.hold_kv:  # in-process moves held their KV where it was: every hold went back
            await no_blocks_in_use(fleet)

    assert all(r.version == 2 for r in fleet.replicas.values())
    assert all(s.version == 2 and s.status == "active" for s in fleet.router.slots.values())
    for i, report in enumerate(reports, start=1):
        check_report(report, strategy, i, n_replicas)
    for traj in trajs:
        check_provenance(traj, newest=2)
    versions = set(
        np.concatenate([t.policy_version[t.loss_mask.astype(bool)] for t in trajs]).tolist()
    )
    assert 0 in versions and len(versions) > 1  # tokens were sampled before and after
    mixed = [
        pol for t in trajs for pol, _ in turn_spans(t) if len(set(pol.tolist())) > 1
    ]  # turns that span an update
    if strategy == "drain":
        # in-flight calls finish before any replica applies: no turn spans two versions
        assert mixed == [] and all(r.migrated == 0 for r in reports)
    if strategy in ("pause", "background"):
        assert all(r.migrated == 0 for r in reports)
        assert all(len(r.pause_ms) == n_replicas for r in reports)
    if strategy == "rolling":
        # the other replicas keep generating while one is updated (a pause-like sync
        # measures about 0.2; `bench pause` gives the real figure)
        fractions = [r.busy_fraction for r in reports]
        assert sum(fractions) / len(fractions) > 0.3, fractions
        assert sum(r.migrated for r in reports) > 0
        assert fleet.stats.migrated == sum(r.migrated for r in reports)


# -- per-request resume policies ------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["pause", "rolling"])
@pytest.mark.parametrize("policy", ["recompute", "restart"])
async def test_update_honours_each_requests_resume_policy(
    make: Make, updates: list[Any], policy: str, strategy: str
) -> None:
    """The engine's resume policy reaches every call in flight: under ``pause`` when its
    replica resumes, under ``rolling`` when the call moves off a replica being updated."""
    # no staging: a rolling update pauses its first group right after the trigger (staging
    # on Ray actors took long enough that a fresh-clone run saw every call end first)
    fleet = FleetBackend(
        await make(2),
        strategy=strategy,  # type: ignore[arg-type]
        stage_updates=False,
    )
    async with fleet:
        traffic = Traffic(fleet)

        async def update(engine: RolloutEngine) -> SyncReport:
            engine.pauses.policy = fixed_policy(policy)  # type: ignore[arg-type]
            await traffic.wait(traffic.busy(calls=4, tokens=4))
            return await fleet.update(updates[0], policies=engine.pauses.policies)

        # long turns: calls are still in flight when a rolling group's turn comes
        config = calculator_config(max_tokens=4 * MAX_TOKENS, ignore_eos=True)
        trajs, report = await run_episodes(fleet, traffic, update, episodes=16, config=config)
        assert_quiet(fleet)

    check_report(report, strategy, 1, 2)
    for traj in trajs:
        check_provenance(traj, newest=1)
    spans = [(pol, kv) for t in trajs for pol, kv in turn_spans(t)]
    if policy == "recompute":
        assert fleet.stats.tokens_recomputed > 0 and report.tokens_recomputed > 0
        assert fleet.stats.tokens_discarded == 0
        # every call in flight was re-prefilled under the new weights: no stale KV remains
        for pol, kv in spans:
            assert (kv[pol == 1] == 1).all()
        assert any(len(set(pol.tolist())) > 1 for pol, _ in spans)  # turns did span the sync
    else:
        assert fleet.stats.tokens_discarded > 0 and fleet.stats.episodes_restarted > 0
        # the partial turns were dropped and sampled again: no turn mixes versions, and the
        # trajectories hold exactly what the backend sampled in the end
        for pol, kv in spans:
            assert len(set(pol.tolist())) == 1 and (kv == pol).all()


# -- pinning --------------------------------------------------------------------------------


async def test_pinned_episodes_never_see_a_version_change(make: Make, updates: list[Any]) -> None:
    """With ``pin_versions`` a rolling update keeps the last old-version replica until every
    episode pinned to it has ended; each multi-turn episode is sampled by one version."""
    fleet = FleetBackend(await make(3), strategy="rolling", pin_versions=True)
    async with fleet:
        traffic = Traffic(fleet)

        rolled = asyncio.Event()

        async def update(engine: RolloutEngine) -> SyncReport:
            # a few chunks in: the first wave's episodes are under way (and pinned to 0).
            # Not "n calls busy": with the CPU kernels a short turn often arrives in one chunk
            await traffic.wait(lambda: len(traffic.chunks) >= 6)
            task = asyncio.create_task(fleet.update(updates[0]))
            # polled: the fleet has no event for "a replica is on the new version"
            while not task.done() and not any(r.version == 1 for r in fleet.replicas.values()):  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            rolled.set()
            return await task

        # the first wave (12 slots) runs on version 0; the rest start once the roll has
        # updated a replica, so both versions serve episodes however fast they run
        admit = admit_after(12, rolled)

        trajs, report = await run_episodes(
            fleet,
            traffic,
            update,
            env=Chatter(),
            episodes=30,
            config=chatter_config(),
            admit=admit,
        )
        assert_quiet(fleet)
    check_report(report, "rolling", 1, 3)
    assert fleet.stats.pin_breaks == 0
    assert all(r.version == 1 for r in fleet.replicas.values())
    seen = set()
    for traj in trajs:
        check_provenance(traj, newest=1)
        pol = set(traj.policy_version[traj.loss_mask.astype(bool)].tolist())
        assert len(pol) == 1, (traj.id, pol)
        seen |= pol
    assert seen == {0, 1}  # both versions served episodes
    assert any(len(t.turns) > 1 for t in trajs)


# -- faults ---------------------------------------------------------------------------------


async def test_killed_replica_moves_its_calls_and_episodes_finish(
    make: Make, updates: list[Any]
) -> None:
    reps = await make(3)
    dead = reps[0]
    fleet = FleetBackend(reps)
    async with fleet:
        traffic = Traffic(fleet)

        async def kill(engine: RolloutEngine) -> SyncReport:
            await traffic.wait(lambda: any(c.delivered >= 2 for c in fleet.calls_on(dead.name)))
            dead.kill()  # type: ignore[attr-defined]
            await traffic.wait(lambda: fleet.status(dead.name) == "down")
            mark = len(traffic.chunks)
            # the fleet still updates: the dead replica is not waited for
            await traffic.wait(traffic.busy(calls=2))
            report = await fleet.update(updates[0], strategy="rolling")
            updated.set()
            await traffic.wait(traffic.busy(calls=1, tokens=1))
            assert dead.name not in traffic.since(mark)
            return report

        # the second half of the episodes starts once the update returned, so calls are
        # in flight after it however fast the first half ran (a fresh-clone run saw all 48
        # end during the rolling update)
        updated = asyncio.Event()
        admit = admit_after(24, updated)

        trajs, report = await run_episodes(fleet, traffic, kill, episodes=48, admit=admit)
        assert_quiet(fleet)
    assert fleet.stats.failovers > 0
    assert fleet.status(dead.name) == "down" and dead.version == 0
    assert report.failed == {} and {r.version for r in reps[1:]} == {1}
    for traj in trajs:
        check_provenance(traj, newest=1)


@pytest.mark.parametrize("strategy", ["pause", "rolling", "drain", "background"])
async def test_replica_that_died_idle_does_not_stall_an_update(
    make: Make, updates: list[Any], strategy: str
) -> None:
    """A replica that died while idle is noticed by the update: it is reported down, the
    others take the update and serve."""
    reps = await make(2)
    alive, dead = reps
    async with FleetBackend(reps, strategy=strategy) as fleet:  # type: ignore[arg-type]
        dead.kill()  # type: ignore[attr-defined]
        report = await asyncio.wait_for(fleet.update(updates[0]), 30)
        assert set(report.failed) == {dead.name} and fleet.status(dead.name) == "down"
        assert alive.version == 1 and fleet.status(alive.name) == "active"
        prompt = sample_prompts(tokenizer(), 1)[0]
        ids, _, versions = await collect(fleet, request(0, prompt))
        assert len(ids) == MAX_TOKENS and set(versions) == {(1, 1)}
        assert_quiet(fleet)


def break_apply(replica: Replica, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``replica`` refuse every update, applied or staged (in its backend when it is in
    this process), as verification of a corrupt update would."""

    async def refuse(update: Any, **kwargs: Any) -> Any:
        raise WeightSyncError("checksum mismatch on model.norm.weight (injected)")

    target: Any = replica.backend if isinstance(replica, LocalReplica) else replica
    monkeypatch.setattr(target, "apply", refuse)
    monkeypatch.setattr(target, "stage", refuse)


@pytest.mark.parametrize("strategy", ["pause", "rolling"])
async def test_update_failing_on_one_replica_takes_it_out_of_rotation(
    make: Make, updates: list[Any], monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    reps = await make(3)
    bad = reps[1]
    break_apply(bad, monkeypatch)
    fleet = FleetBackend(reps, strategy=strategy)  # type: ignore[arg-type]
    async with fleet:
        traffic = Traffic(fleet)
        updated = [asyncio.Event(), asyncio.Event()]

        async def update(engine: RolloutEngine) -> tuple[SyncReport, SyncReport]:
            await traffic.wait(lambda: any(c.delivered >= 2 for c in fleet.calls_on(bad.name)))
            first = await fleet.update(updates[0])
            updated[0].set()
            mark = len(traffic.chunks)
            await traffic.wait(traffic.busy(calls=2))
            second = await fleet.update(updates[1])  # the failed replica is not asked again
            updated[1].set()
            await traffic.wait(traffic.busy(calls=1, tokens=1))
            assert bad.name not in traffic.since(mark)
            return first, second

        started = 0

        async def admit(n: int) -> None:
            # three waves of 16 (the engine's concurrency): the second starts once the
            # first update returned, the third once the second did, so calls are in flight
            # after each update however fast the episodes run
            nonlocal started
            wave = min(started // 16, 2)
            started += n
            if wave:
                await asyncio.wait_for(updated[wave - 1].wait(), 120)

        trajs, (first, second) = await run_episodes(
            fleet, traffic, update, episodes=48, admit=admit
        )
        assert_quiet(fleet)
    assert set(first.failed) == {bad.name} and "WeightSyncError" in first.failed[bad.name]
    assert second.failed == {}
    assert fleet.status(bad.name) == "failed" and bad.version == 0
    assert {r.version for r in reps if r is not bad} == {2}
    assert fleet.policy_version == 2
    for traj in trajs:
        check_provenance(traj, newest=2)


async def test_update_refused_by_every_replica_raises_and_keeps_serving(
    make: Make, updates: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """When no replica takes an update (a corrupt one, say), the fleet says so and goes on
    serving its old weights: a bad update must not take the whole fleet down."""
    reps = await make(2)
    for replica in reps:
        break_apply(replica, monkeypatch)
    async with FleetBackend(reps) as fleet:
        traffic = Traffic(fleet)

        async def update(engine: RolloutEngine) -> None:
            await traffic.wait(traffic.busy(calls=4))
            with pytest.raises(WeightSyncError, match="no replica took"):
                await fleet.update(updates[0])

        trajs, _ = await run_episodes(fleet, traffic, update, episodes=16)
        assert_quiet(fleet)
        assert all(fleet.status(r.name) == "active" for r in reps)
    assert all(r.version == 0 for r in reps)
    for traj in trajs:
        check_provenance(traj, newest=0)


async def test_an_update_that_breaks_midway_leaves_the_fleet_serving(
    make: Make, updates: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A strategy that raises (here: snapshots fail while a rolling group moves its calls)
    reports the error; the replicas it paused or took out of routing serve again."""
    reps = await make(3)

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("snapshot failed (injected)")

    for replica in reps:
        monkeypatch.setattr(replica, "snapshot", broken)
        monkeypatch.setattr(replica, "snapshot_many", broken)
    async with FleetBackend(reps, strategy="rolling") as fleet:
        traffic = Traffic(fleet)

        async def update(engine: RolloutEngine) -> None:
            await traffic.wait(lambda: bool(fleet.calls_on(reps[0].name)))
            # reps[0]'s calls stay in flight until its group moves them: under load they
            # could end first, and the update went through without a snapshot (DID NOT RAISE)
            traffic.flowing.clear()
            try:
                with pytest.raises(RuntimeError, match="injected"):
                    await fleet.update(updates[0])
            finally:
                traffic.flowing.set()
            assert fleet.paused_replicas == set()
            assert all(fleet.status(r.name) == "active" for r in reps)

        trajs, _ = await run_episodes(fleet, traffic, update, episodes=16)
        assert_quiet(fleet)
    for traj in trajs:
        check_provenance(traj, newest=1)


async def test_background_update_that_does_not_fit_changes_nothing(
    make: Make, updates: list[Any]
) -> None:
    reps = await make(2)
    update = updates[0]
    async with FleetBackend(reps, strategy="background", background_max_bytes=1) as fleet:
        prompt = sample_prompts(tokenizer(), 1)[0]
        refused: list[str] = []

        async def refuse_once(n: int) -> None:
            if n >= 4 and not refused:
                with pytest.raises(WeightSyncError, match="refused, nothing changed") as exc:
                    await fleet.update(update)
                refused.append(str(exc.value))

        ids, _, versions = await collect(fleet, request(0, prompt), refuse_once)
        assert refused and len(ids) == MAX_TOKENS and set(versions) == {(0, 0)}
        assert all(r.version == 0 for r in reps)
        assert all(fleet.status(r.name) == "active" for r in reps)
        assert fleet.reports == []
        # the same update still applies on its base with a strategy that needs no copy
        report = await fleet.update(update, strategy="pause")
        assert report.failed == {} and all(r.version == 1 for r in reps)
