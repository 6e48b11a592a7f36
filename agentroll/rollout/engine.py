"""The asyncio episode engine: many multi-turn, tool-using episodes at once.

Invariants (DESIGN.md 1-3, 6, 8): a later request's prompt is the trajectory so far, sampled
ids verbatim; ``loss_mask`` is 1 exactly on sampled tokens; a failing episode becomes a
``failed`` trajectory and never cancels its siblings; every worker task belongs to the
engine's task group; pauses are invisible to environment code; a ``stop`` loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
)
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from agentroll.backends.base import (
    Backend,
    ReportsInflight,
    ResumePolicy,
    SamplingParams,
    SupportsSnapshot,
    UpdatesInRotation,
)
from agentroll.chat import ChatTokenizer, get_tool_parser
from agentroll.env import DrivesEpisodes, Environment
from agentroll.errors import ConfigError
from agentroll.progress import Progress, ProgressMode
from agentroll.rollout.builder import TrajectoryBuilder
from agentroll.rollout.checkpoint import EpisodeCheckpoint, EpisodeJob, EpisodeRun, make_checkpoint
from agentroll.rollout.episode_loop import (
    EpisodeLoop,
    _finite,
    _Outcome,
    episode_seed,
)
from agentroll.rollout.pause import EpisodeView, PauseController, PolicyFn, as_policy_fn
from agentroll.rollout.prewarm import WarmPool
from agentroll.rollout.tool_cache import ToolCache
from agentroll.types import Strategy, SyncReport, Task, Trajectory, new_id, unicode_safe

if TYPE_CHECKING:
    from agentroll.weights.update import WeightUpdate

logger = logging.getLogger("agentroll.rollout.engine")
# (task, sample index, group id, checkpoint to continue or unstarted job): run()'s work items
_Job = tuple[Task, int, str, EpisodeCheckpoint | EpisodeJob | None]


class RolloutConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Static settings of a rollout engine (sampling is per request, seeded per episode)."""

    concurrency: int = 64
    samples_per_task: int = 1
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    generation_timeout: float | None = 600.0
    tool_timeout: float = 60.0
    episode_timeout: float | None = 3600.0
    tool_threads: int = 8
    tool_parser: str = "hermes"
    max_tool_output_chars: int = 16_384
    keep_messages: bool = True
    progress: ProgressMode = "auto"
    # results of pure tools (@tool(pure=True)) cached per engine; a hit runs again with
    # this chance (its first two per tool always) and a differing result turns it off
    tool_cache: bool = False
    tool_cache_verify: float = 0.05
    # early group cut-off: once this share of a group's samples finished with one reward
    # (and none failed), the rest stop and take that reward (status "cut", nothing of them
    # trained on); 0 turns it off.  Changes the data: `agentroll validate` checks it.
    group_cutoff: float = 0.0
    # sandbox pre-warm: the sandboxes of the next ``prewarm_groups`` groups' samples are kept
    # started ahead of their episodes (rollout.prewarm), from the engine's start to its close
    prewarm_sandboxes: bool = False
    prewarm_groups: int = 1

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigError("concurrency must be >= 1")
        if self.samples_per_task < 1:
            raise ConfigError("samples_per_task must be >= 1")
        if self.tool_threads < 1:
            raise ConfigError("tool_threads must be >= 1")
        if not 0.0 <= self.group_cutoff < 1.0:
            raise ConfigError(
                f"group_cutoff={self.group_cutoff}: use 0 (off) or a share in (0, 1), e.g. 0.75"
            )
        if not 1 <= self.prewarm_groups <= 64:
            raise ConfigError(
                f"prewarm_groups={self.prewarm_groups}: use 1 to 64 groups started ahead"
            )
        if not 0.0 <= self.tool_cache_verify <= 1.0:
            raise ConfigError(f"tool_cache_verify={self.tool_cache_verify}: use a value in [0, 1]")
        for name in ("generation_timeout", "tool_timeout", "episode_timeout"):
            val = getattr(self, name)
            if val is not None and not val > 0:  # NaN too
                raise ConfigError(f"{name} must be > 0 seconds (or None for no limit)")


class StopReport(NamedTuple):
    """What ``RolloutEngine.stop`` saved and handed back."""

    checkpoints: list[Path]  # one directory per episode in flight
    undelivered: list[Trajectory]  # finished, not yielded by ``run``: for ``finished=``
    unstarted: list[EpisodeJob]  # samples of started groups with no episode: ``unstarted=``


class RolloutEngine(EpisodeLoop):
    """Runs episodes of ``env`` against ``backend``.

    ``async with RolloutEngine(backend, env, config, tokenizer=tok) as engine:`` then
    ``async for traj in engine.run(tasks): ...``.  The engine owns its worker tasks and the
    thread pool for sync hooks and tools; leaving the block cancels what still runs.

    The prompt is rendered once and every later request's prompt is the trajectory so far
    (sampled ids appended verbatim, environment replies rendered incrementally); the tokens end
    on the last sampled turn, ``messages`` also holds the reply the episode ended on.
    Cancellation propagates and sandboxes are closed shielded from it.

    ``pause`` / ``resume`` (agentroll.rollout.pause) are invisible to environment code: a turn
    waits at the gate, a generation waits in the backend, deadlines exclude paused time.
    ``checkpoint`` writes every in-flight episode at a quiescent point so another process can
    finish it; ``stop`` also hands back every episode that finished but that ``run`` had not
    yielded (its consumer was busy, or the episode waited for its group) and every sample of a
    started group that has neither finished nor a checkpoint, so a stop loses none and leaves
    no group waiting forever for a member nobody runs.
    """

    def __init__(
        self,
        backend: Backend,
        env: Environment,
        config: RolloutConfig | None = None,
        *,
        tokenizer: ChatTokenizer | None = None,
    ) -> None:
        tok = tokenizer or backend.tokenizer
        if tok is None:
            raise ConfigError("RolloutEngine needs a ChatTokenizer (pass tokenizer=...)")
        self.backend = backend
        self.env = env
        self.config = config or RolloutConfig()
        self.tokenizer: ChatTokenizer = tok
        self.parser = get_tool_parser(self.config.tool_parser)
        self._tools = env.tools
        self.tool_cache: ToolCache | None = (
            ToolCache(verify_rate=self.config.tool_cache_verify, seed=self.config.seed)
            if self.config.tool_cache
            else None
        )
        self._tool_inflight = {}
        self._warm = None
        self._tool_specs = env.tool_specs or None
        self._has_group_reward = bool(env.rubric and env.rubric.group_funcs)
        self._executor: ThreadPoolExecutor | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._workers: set[asyncio.Task[None]] = set()
        self._live: dict[str, EpisodeRun] = {}
        # finished episodes run() has not yielded yet (in its queue, or waiting for the rest
        # of their group): what a stop must hand back (take_undelivered), by trajectory id
        self._undelivered: dict[str, Trajectory] = {}
        # every sample of a group run() started (its first sample was admitted) that has not
        # finished yet, by (group id, sample index); those the last checkpoint() did not
        # write are what a stop must hand back (take_unstarted)
        self._owed: dict[tuple[str, int], EpisodeJob] = {}
        self._checkpointed: set[tuple[str, int]] = set()
        # cleared by checkpoint() until resume(): run() starts no more workers meanwhile
        self._ramp = asyncio.Event()
        self._ramp.set()
        self.pauses = PauseController(backend, self._views)
        self.stats = {
            "episodes": 0,
            "failed": 0,
            "turns": 0,
            "restarted_turns": 0,
            "forks": 0,
            "groups_cut": 0,
            "prewarmed_sandboxes": 0,  # episodes that found their sandbox started
        }

    async def __aenter__(self) -> RolloutEngine:
        self._executor = ThreadPoolExecutor(
            self.config.tool_threads, thread_name_prefix="agentroll-hook"
        )
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        if isinstance(self.env, DrivesEpisodes):
            await self.env.open_driver(self.backend, self.tokenizer)
        box = self.env.sandbox_config
        if self.config.prewarm_sandboxes and box is not None:
            n = self.config.prewarm_groups * self.config.samples_per_task
            self._warm = WarmPool(box, n)
            self._warm.fill()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        tg, self._tg = self._tg, None
        # A consumer that broke out of ``run()`` without closing it leaves workers blocked on
        # a queue nobody reads: leaving the engine cancels them.
        for w in self._workers:
            w.cancel()
        try:
            if tg is not None:
                try:
                    await tg.__aexit__(*exc)
                except BaseExceptionGroup as group:
                    # the task group wraps the body's own error (a ConfigError out of run(),
                    # the consumer's bug): when that is all, it propagates as itself
                    if exc[1] is None or list(group.exceptions) != [exc[1]]:
                        raise
        finally:
            warm, self._warm = self._warm, None
            if warm is not None:
                await warm.close()
            if isinstance(self.env, DrivesEpisodes):
                await self.env.close_driver()
            if self._executor is not None:
                # Threads of hung sync tools cannot be killed; they are abandoned, not joined.
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None

    # -- pause, resume, checkpoint (agentroll.rollout.pause, agentroll.rollout.checkpoint) -----------------

    def _views(self) -> list[EpisodeView]:
        version = self.backend.policy_version
        views = []
        for run in self._live.values():
            if run.phase != "generating":
                continue
            min_pol, min_kv = run.min_versions()
            views.append(
                EpisodeView(
                    episode_id=run.episode_id,
                    request_id=run.request_id,
                    turn=run.next_turn,
                    tokens_generated=len(run.builder) - run.gen_start,
                    min_policy_version=min_pol,
                    min_kv_version=min_kv,
                    policy_version=version,
                )
            )
        return views

    @property
    def live_episodes(self) -> int:
        """Episodes running now (started, not finished)."""
        return len(self._live)

    @property
    def paused(self) -> bool:
        return self.pauses.paused

    async def pause(self, policy: ResumePolicy | PolicyFn = "keep") -> None:
        """Stop every episode: generations at a token boundary, no new turn starts; tool
        calls already running finish.  ``policy`` (a name, or a function of an
        ``EpisodeView``) picks each paused generation's resume policy at ``resume``."""
        await self.pauses.pause(policy)

    async def resume(self, policies: Mapping[str, ResumePolicy] | None = None) -> float:
        """Continue every episode where it stopped; returns the seconds spent paused."""
        self._ramp.set()
        return await self.pauses.resume(policies)

    async def sync(
        self,
        update: WeightUpdate,
        *,
        policy: ResumePolicy | PolicyFn = "keep",
        strategy: Strategy | None = None,
    ) -> SyncReport:
        """Install a ``WeightUpdate`` while episodes go on: the one entry point for a sync.

        ``policy`` (a ``ResumePolicy``, or a function of ``EpisodeView`` such as
        ``staleness_policy(1)``) decides how each generation in flight resumes.  On a fleet
        (``UpdatesInRotation``) the replicas are updated in turn with ``strategy`` (default:
        the fleet's), each asking ``policy`` for its requests when it pauses; on a single
        backend the engine pauses, applies and resumes (``strategy`` must then be None or
        ``"pause"``).  A refused update raises ``WeightSyncError`` with the old weights
        still serving."""
        backend = self.backend
        if isinstance(backend, UpdatesInRotation):
            choose = as_policy_fn(policy)
            return await backend.update(
                update,
                strategy=strategy,
                policies=None
                if policy == "keep"
                else lambda: self.pauses.policies(update.version, choose),
            )
        if strategy not in (None, "pause"):
            raise ConfigError(
                f"strategy {strategy!r} needs a fleet (FleetBackend); a single backend "
                "syncs with the pause strategy"
            )
        t0 = time.perf_counter()
        await self.pause(policy)
        try:
            await backend.apply(update)
        finally:
            paused_for = await self.resume()
        return SyncReport(
            strategy="pause",
            version=update.version,
            seconds=time.perf_counter() - t0,
            pause_ms=[paused_for * 1000.0],
        )

    def _quiescent(self, run: EpisodeRun, inflight: set[str] | None) -> bool:
        if run.phase == "turn":
            return True
        if run.phase == "generating":
            return inflight is None or run.request_id in inflight
        return False

    async def quiesce(self, timeout: float | None = 60.0) -> None:
        """While paused, wait until every live episode is at the turn gate or has its
        generation paused in the backend (running tool calls and scoring finish first)."""
        if not self.paused:
            raise RuntimeError("quiesce() needs the engine paused; call `await engine.pause()`")
        backend = self.backend
        async with asyncio.timeout(timeout):
            while True:
                inflight = set(backend.inflight()) if isinstance(backend, ReportsInflight) else None
                if all(self._quiescent(r, inflight) for r in self._live.values()):
                    return
                await asyncio.sleep(0.005)

    async def checkpoint(
        self, directory: str | Path, *, with_kv: bool = True, timeout: float | None = 60.0
    ) -> list[Path]:
        """Write an ``EpisodeCheckpoint`` of every live episode under ``directory`` (one
        sub-directory per episode).  The engine must be paused; it stays paused, and
        ``run`` starts no more workers until ``resume`` (the set it writes is not ramping)."""
        if self.paused:
            self._ramp.clear()
        await self.quiesce(timeout)
        out = Path(directory)
        await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
        snapshot = self.backend.snapshot if isinstance(self.backend, SupportsSnapshot) else None
        paths = []
        runs = list(self._live.values())
        self._checkpointed = {(run.group_id, run.state.sample_index) for run in runs}
        for run in runs:
            blob = await run.sandbox.snapshot() if run.sandbox is not None else None
            pending = None
            if run.phase == "generating" and snapshot is not None:
                snap = await snapshot(run.request_id, with_kv=with_kv)
                pending = snap.truncated(len(run.builder) - run.gen_start)
            cp = make_checkpoint(run, sandbox_blob=blob, pending=pending)
            paths.append(await asyncio.to_thread(cp.save, out / run.episode_id))
        return paths

    async def stop(
        self,
        directory: str | Path,
        *,
        leave: Callable[[], Awaitable[object]],
        with_kv: bool = True,
        timeout: float | None = 60.0,
    ) -> StopReport:
        """The stop protocol, in its one safe order: pause; checkpoint every episode in
        flight under ``directory``; ``await leave()`` (the caller leaves its loop over
        ``run``: cancels it and waits, after draining what it wants delivered); then take
        back what finished but was not yielded and the samples of started groups that
        neither finished nor were checkpointed.  Hand the report's three parts to the next
        ``run(checkpoints=..., finished=..., unstarted=...)`` and nothing is lost.  The
        engine stays paused; ``TimeoutError`` when tool calls do not finish in ``timeout``.
        """
        await self.pause()
        paths = await self.checkpoint(directory, with_kv=with_kv, timeout=timeout)
        await leave()
        return StopReport(paths, self.take_undelivered(), self.take_unstarted())

    def take_undelivered(self) -> list[Trajectory]:
        """The episodes that finished but that ``run`` has not yielded (its consumer was busy
        or left: they waited in its queue, or for the rest of their group), oldest first;
        they are forgotten here.  ``stop`` calls it in the safe order: once the loop over
        ``run`` is left (after ``pause`` + ``checkpoint``), so none is yielded as well; hand
        them to the next ``run(finished=...)``, which yields them (or scores them with
        their group) without running them again."""
        out = list(self._undelivered.values())
        self._undelivered.clear()
        return out

    def take_unstarted(self) -> list[EpisodeJob]:
        """The samples of groups ``run`` started that neither finished nor were written by
        the last ``checkpoint``: never started (no worker was free), or started after the
        checkpoint and cancelled with the loop.  Without them a finished or checkpointed
        sample of the group would wait for its group forever.  Call it with
        ``take_undelivered`` (the loop over ``run`` left) and hand them to the next
        ``run(unstarted=...)``; they are forgotten here."""
        out = [job for key, job in self._owed.items() if key not in self._checkpointed]
        self._owed.clear()
        self._checkpointed = set()
        return out

    # -- running many episodes ------------------------------------------------------------

    def _jobs(
        self,
        tasks: Iterable[Task],
        checkpoints: Iterable[EpisodeCheckpoint],
        unstarted: Iterable[EpisodeJob],
    ) -> Iterator[_Job]:
        """(task, sample index, group id, checkpoint to continue or unstarted job):
        checkpoints first, then the samples a stop left unstarted (and those restarted
        because their checkpoint was refused), then every task's samples in new groups."""
        for cp in checkpoints:
            yield cp.task, cp.sample_index, cp.group_id, cp
        for job in unstarted:
            yield job.task, job.sample_index, job.group_id, job
        for task in tasks:
            if not isinstance(task, Task) or not isinstance(task.id, str):
                raise ConfigError(f"tasks must be Task objects with a str id, got {task!r:.80}")
            if unicode_safe(task.id) != task.id:
                raise ConfigError(f"task id {task.id!r:.80} is not valid Unicode (lone surrogates)")
            group = new_id()
            for i in range(self.config.samples_per_task):
                yield task, i, group, None

    async def run(
        self,
        tasks: Iterable[Task] | None = None,
        *,
        total: int | None = None,
        checkpoints: Iterable[EpisodeCheckpoint] = (),
        finished: Iterable[Trajectory] = (),
        unstarted: Iterable[EpisodeJob] = (),
        admit: Callable[[int], Awaitable[None]] | None = None,
    ) -> AsyncIterator[Trajectory]:
        """Run every task ``samples_per_task`` times; yield trajectories as they finish
        (a whole group at once when the environment has group rewards).  ``checkpoints``
        (from ``checkpoint``, maybe in another process) are continued first; pass
        ``tasks=[]`` to run only them.  ``finished``: trajectories a stop handed back
        (``take_undelivered``): yielded first, or, with group rewards, they wait for the
        rest of their group (its other samples among ``checkpoints``) and are scored with
        it.  ``unstarted``: samples a stop left unstarted (``take_unstarted``), started
        afresh after the checkpoints.  ``admit(n)`` (admission control, e.g. a staleness
        bound) is awaited before a new group of ``n`` samples starts; groups are admitted
        one at a time, in order; a checkpointed or unstarted sample needs no admission.

        Leaving the loop early cancels the episodes still running; episodes that finished
        but were not yielded yet stay with ``take_undelivered``.
        """
        deliveries = self._deliveries(
            tasks,
            total=total,
            checkpoints=checkpoints,
            finished=finished,
            unstarted=unstarted,
            admit=admit,
        )
        async with contextlib.aclosing(deliveries):
            async for batch in deliveries:
                for traj in batch:
                    self._undelivered.pop(traj.id, None)
                    yield traj

    async def run_groups(
        self,
        tasks: Iterable[Task] | None = None,
        *,
        total: int | None = None,
        checkpoints: Iterable[EpisodeCheckpoint] = (),
        finished: Iterable[Trajectory] = (),
        unstarted: Iterable[EpisodeJob] = (),
        admit: Callable[[int], Awaitable[None]] | None = None,
    ) -> AsyncIterator[list[Trajectory]]:
        """As ``run``, but yield each group whole (its ``samples_per_task`` trajectories, by
        sample index) once its last sample finishes: the engine is the one place groups are
        assembled.  Members of groups not yet whole stay with ``stop``'s ``undelivered``."""
        deliveries = self._deliveries(
            tasks,
            total=total,
            checkpoints=checkpoints,
            finished=finished,
            unstarted=unstarted,
            admit=admit,
            whole_groups=True,
        )
        async with contextlib.aclosing(deliveries):
            async for group in deliveries:
                for traj in group:
                    self._undelivered.pop(traj.id, None)
                yield group

    async def _deliveries(
        self,
        tasks: Iterable[Task] | None = None,
        *,
        total: int | None = None,
        checkpoints: Iterable[EpisodeCheckpoint] = (),
        finished: Iterable[Trajectory] = (),
        unstarted: Iterable[EpisodeJob] = (),
        admit: Callable[[int], Awaitable[None]] | None = None,
        whole_groups: bool = False,
    ) -> AsyncGenerator[list[Trajectory], None]:
        """``run``'s deliveries: one trajectory, or a whole group (when the environment
        has group rewards, or with ``whole_groups``), each still in ``_undelivered``: the
        caller forgets it there right before handing it on."""
        if self._tg is None:
            raise RuntimeError("use `async with RolloutEngine(...) as engine` before run()")
        if tasks is None:
            tasks = self.env.tasks()
        checkpoints, finished, unstarted = list(checkpoints), list(finished), list(unstarted)
        n = self.config.samples_per_task
        if total is None and hasattr(tasks, "__len__"):
            total = len(tasks) * n  # type: ignore[arg-type]
            total += len(checkpoints) + len(finished) + len(unstarted)
        jobs = self._jobs(tasks, checkpoints, unstarted)
        undelivered, owed = self._undelivered, self._owed
        for job in unstarted:
            owed[job.group_id, job.sample_index] = job
        for traj in finished:
            undelivered[traj.id] = traj
        results: asyncio.Queue[_Outcome | BaseException | None] = asyncio.Queue(
            maxsize=2 * self.config.concurrency
        )

        gate = asyncio.Lock()

        async def next_job() -> _Job | None:
            async with gate:  # one group is admitted at a time, and whole
                job = next(jobs, None)
                if job is None or job[3] is not None or (job[2], job[1]) in owed:
                    return job  # continued, or a sample of a group already started
                # the first sample of a new group: admitted, then the whole group is owed
                if admit is not None:
                    await admit(n)
                task, _, group, _ = job
                for i in range(n):
                    owed[group, i] = EpisodeJob(task=task, sample_index=i, group_id=group)
                return job

        # Workers follow the jobs: the newest one, once it holds a job, starts the next (up to
        # ``concurrency``), so start-up costs what runs, not the setting (a concurrency of
        # 65536 for 8 tasks starts 9 workers), and the loop is never blocked spawning them.
        # Once a checkpoint began, the next one waits for ``resume``: a stop's checkpoint
        # sees a settled set of episodes, not a ramp that keeps adding to it.
        tg, workers = self._tg, list[asyncio.Task[None]]()

        def spawn() -> None:
            w = tg.create_task(worker(ramp=bool(workers)))
            workers.append(w)
            self._workers.add(w)

        async def worker(ramp: bool) -> None:
            try:
                if ramp:
                    await self._ramp.wait()
                while (job := await next_job()) is not None:
                    newest = workers[-1] is asyncio.current_task()
                    if newest and len(workers) < self.config.concurrency:
                        spawn()
                    task, index, group, origin = job
                    outcome = await self.run_episode(
                        task,
                        sample_index=index,
                        group_id=group,
                        checkpoint=origin if isinstance(origin, EpisodeCheckpoint) else None,
                        restart_of=origin.episode_id if isinstance(origin, EpisodeJob) else "",
                        cut=group in decided,
                    )
                    traj = outcome.trajectory
                    for t in outcome.all:
                        undelivered[t.id] = t
                    owed.pop((traj.group_id, traj.sample_index), None)
                    cutoff(traj)  # before this worker takes its next job: no lag to decide
                    await results.put(outcome)
            except asyncio.CancelledError:
                raise  # the consumer is gone or leaving: nobody waits for a sentinel
            except Exception as exc:  # an engine bug: surface it to the consumer
                await results.put(exc)
                return
            await results.put(None)

        # early group cut-off: the decided reward of each group cut, and what each group's
        # finished samples scored (kept until the group is complete)
        decided: dict[str, float] = {}
        scores: dict[str, list[tuple[str, float]]] = {}

        def cutoff(traj: Trajectory) -> None:
            """Record a finished sample; cut its group's stragglers once it is decided, and
            give a cut straggler the decided reward."""
            if not self.config.group_cutoff or self._has_group_reward:
                return
            group = traj.group_id
            if traj.status == "cut" and group in decided:
                traj.reward, traj.rewards = decided[group], {"group_cutoff": decided[group]}
            seen = scores.setdefault(group, [])
            seen.append((traj.status, traj.reward))
            if len(seen) >= n:
                scores.pop(group, None)
                decided.pop(group, None)
                return
            if group in decided or len(seen) < math.ceil(self.config.group_cutoff * n):
                return
            if all(st in ("ok", "truncated") for st, _ in seen) and len({r for _, r in seen}) == 1:
                decided[group] = seen[0][1]
                self.stats["groups_cut"] += 1
                now_ = asyncio.get_running_loop().time()
                for run in self._live.values():
                    # one in its close ("done") has left its timers: it finished by itself
                    if run.group_id == group and run.cut_timer is not None and run.phase != "done":
                        run.cut_timer.reschedule(now_)

        spawn()
        pending: dict[str, list[_Outcome]] = {}
        stopped = 0  # workers that found no job left
        progress = Progress("episodes", total, mode=self.config.progress)
        try:
            grouped = whole_groups or self._has_group_reward
            for traj in finished:
                progress.advance(failed=traj.status == "failed")
                if not grouped:
                    yield [traj]
                    continue
                # delivered (and scored) with the rest of its group, which may be among
                # ``finished`` too (a stop took the whole group back before delivering it)
                group = pending.setdefault(traj.group_id, [])
                group.append(_Outcome(traj, self.env))
                # a forked episode hands back several samples under one sample index
                if len({o.trajectory.sample_index for o in group}) == self.config.samples_per_task:
                    del pending[traj.group_id]
                    yield await self._whole(group)
            while stopped < len(workers):  # a worker starts the next before it can stop
                item = await results.get()
                if item is None:
                    stopped += 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                progress.advance(failed=item.trajectory.status == "failed")
                if not grouped:
                    yield item.all
                    continue
                group = pending.setdefault(item.trajectory.group_id, [])
                group.append(item)
                if len(group) == self.config.samples_per_task:
                    del pending[item.trajectory.group_id]
                    yield await self._whole(group)
        finally:
            progress.close()
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self._workers.difference_update(workers)

    async def _whole(self, group: list[_Outcome]) -> list[Trajectory]:
        """A complete group as delivered: scored with its group rewards when the
        environment has them, by sample index otherwise."""
        if self._has_group_reward:
            return await self._score_group(group)
        return sorted((t for o in group for t in o.all), key=lambda t: t.sample_index)

    async def _score_group(self, group: list[_Outcome]) -> list[Trajectory]:
        rubric = group[0].env.rubric
        assert rubric is not None
        trajs = [o.trajectory for o in sorted(group, key=lambda o: o.trajectory.sample_index)]
        scorable = [t for t in trajs if t.status != "failed"]
        try:
            scores = await rubric.score_group(scorable, self._executor)
        except Exception as exc:
            for t in scorable:
                t.status, t.error = "failed", f"group reward failed: {type(exc).__name__}: {exc}"
            return trajs
        for t, s in zip(scorable, scores, strict=True):
            rewards = {**t.rewards, **s}
            try:
                t.rewards, t.reward = _finite(rewards, rubric.combine(rewards))
            except ValueError as exc:
                t.status, t.error = "failed", f"group reward failed: {exc}"
        return trajs

    # -- one episode -------------------------------------------------------------------------


__all__ = ["RolloutConfig", "RolloutEngine", "StopReport", "TrajectoryBuilder", "episode_seed"]
