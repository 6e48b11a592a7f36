"""The asyncio episode engine: many multi-turn, tool-using episodes at once.

Invariants (DESIGN.md 1-3, 6, 8): the prompt is rendered once and every later request's
prompt is the trajectory so far (sampled ids appended verbatim, environment replies rendered
incrementally); the tokens end on the last sampled turn, ``messages`` also holds the reply the
episode ended on; ``loss_mask`` is 1 exactly on sampled tokens; a failing episode becomes a
``failed`` trajectory and never cancels its siblings; cancellation propagates and sandboxes
are closed shielded from it; every worker task belongs to the engine's task group.
``pause`` / ``resume`` (agentroll.rollout.pause) are invisible to environment code: a turn waits at
the gate, a generation waits in the backend, deadlines exclude paused time; ``checkpoint``
writes every in-flight episode at a quiescent point so another process can finish it, and
``take_undelivered`` hands back every episode that finished but that ``run`` had not yielded
(its consumer was busy, or the episode waited for its group) and ``take_unstarted`` every
sample of a started group that has neither finished nor a checkpoint, so a stop loses none
and leaves no group waiting forever for a member nobody runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from agentroll.backends.base import (
    Backend,
    GenerationRequest,
    ReportsInflight,
    ResumePolicy,
    SamplingParams,
    SupportsSnapshot,
)
from agentroll.chat import ChatTokenizer, ParsedOutput, get_tool_parser
from agentroll.env import Environment, EpisodeState, call_hook
from agentroll.errors import BackendError, ConfigError, GenerationTimeout
from agentroll.progress import Progress, ProgressMode
from agentroll.rollout.builder import TrajectoryBuilder
from agentroll.rollout.checkpoint import EpisodeCheckpoint, EpisodeJob, EpisodeRun, make_checkpoint
from agentroll.rollout.pause import EpisodeView, PauseController, PolicyFn
from agentroll.sandbox import open_sandbox
from agentroll.sandbox.base import Sandbox
from agentroll.tool import call_tool
from agentroll.types import (
    FinishReason,
    Message,
    Status,
    Task,
    ToolCall,
    ToolResult,
    Trajectory,
    Turn,
    new_id,
    now,
    unicode_safe,
)

if TYPE_CHECKING:
    from agentroll.weights.update import WeightUpdate

logger = logging.getLogger("agentroll.rollout.engine")
_LONG_TEXT = 64 * 1024  # render/tokenize texts longer than this off the event loop
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

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigError("concurrency must be >= 1")
        if self.samples_per_task < 1:
            raise ConfigError("samples_per_task must be >= 1")
        if self.tool_threads < 1:
            raise ConfigError("tool_threads must be >= 1")
        for name in ("generation_timeout", "tool_timeout", "episode_timeout"):
            val = getattr(self, name)
            if val is not None and not val > 0:  # NaN too
                raise ConfigError(f"{name} must be > 0 seconds (or None for no limit)")


def episode_seed(base: int, task_id: str, sample_index: int) -> int:
    """Deterministic 63-bit seed of one episode."""
    digest = hashlib.blake2b(f"{base}:{task_id}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


async def close_shielded(sandbox: Sandbox) -> None:
    """Close ``sandbox`` to completion even if the caller is being cancelled."""
    task = asyncio.ensure_future(sandbox.close())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise
    except Exception:
        logger.exception("sandbox close failed")


class _Outcome:
    """A finished episode waiting for its group (group rewards need all samples)."""

    __slots__ = ("env", "trajectory")

    def __init__(self, trajectory: Trajectory, env: Environment) -> None:
        self.trajectory = trajectory
        self.env = env


class RolloutEngine:
    """Runs episodes of ``env`` against ``backend``.

    ``async with RolloutEngine(backend, env, config, tokenizer=tok) as engine:`` then
    ``async for traj in engine.run(tasks): ...``.  The engine owns its worker tasks and the
    thread pool for sync hooks and tools; leaving the block cancels what still runs.
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
        self.stats = {"episodes": 0, "failed": 0, "turns": 0, "restarted_turns": 0}

    async def __aenter__(self) -> RolloutEngine:
        self._executor = ThreadPoolExecutor(
            self.config.tool_threads, thread_name_prefix="agentroll-hook"
        )
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
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
        self, update: WeightUpdate, *, policy: ResumePolicy | PolicyFn = "keep"
    ) -> float:
        """Pause, apply a ``WeightUpdate`` to the backend, resume; returns the pause length.
        A refused update raises ``WeightSyncError`` after resuming on the old weights."""
        await self.pause(policy)
        try:
            await self.backend.apply(update)
        finally:
            paused_for = await self.resume()
        return paused_for

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

    def take_undelivered(self) -> list[Trajectory]:
        """The episodes that finished but that ``run`` has not yielded (its consumer was busy
        or left: they waited in its queue, or for the rest of their group), oldest first;
        they are forgotten here.  Call it once the loop over ``run`` is left (after
        ``pause`` + ``checkpoint`` at a stop), so that none of them is yielded as well; hand
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
                    )
                    traj = outcome.trajectory
                    undelivered[traj.id] = traj
                    owed.pop((traj.group_id, traj.sample_index), None)
                    await results.put(outcome)
            except asyncio.CancelledError:
                raise  # the consumer is gone or leaving: nobody waits for a sentinel
            except Exception as exc:  # an engine bug: surface it to the consumer
                await results.put(exc)
                return
            await results.put(None)

        spawn()
        pending: dict[str, list[_Outcome]] = {}
        stopped = 0  # workers that found no job left
        progress = Progress("episodes", total, mode=self.config.progress)
        try:
            for traj in finished:
                progress.advance(failed=traj.status == "failed")
                if self._has_group_reward:  # scored with the rest of its group
                    pending.setdefault(traj.group_id, []).append(_Outcome(traj, self.env))
                else:
                    undelivered.pop(traj.id, None)
                    yield traj
            while stopped < len(workers):  # a worker starts the next before it can stop
                item = await results.get()
                if item is None:
                    stopped += 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                progress.advance(failed=item.trajectory.status == "failed")
                if not self._has_group_reward:
                    undelivered.pop(item.trajectory.id, None)
                    yield item.trajectory
                    continue
                group = pending.setdefault(item.trajectory.group_id, [])
                group.append(item)
                if len(group) == self.config.samples_per_task:
                    del pending[item.trajectory.group_id]
                    for traj in await self._score_group(group):
                        undelivered.pop(traj.id, None)
                        yield traj
        finally:
            progress.close()
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            self._workers.difference_update(workers)

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

    async def run_episode(
        self,
        task: Task,
        *,
        sample_index: int = 0,
        group_id: str | None = None,
        checkpoint: EpisodeCheckpoint | None = None,
        restart_of: str = "",
    ) -> _Outcome:
        """Run one episode to completion (or continue ``checkpoint``).  ``restart_of``: the
        id of an episode whose checkpoint was refused; this run restarts it from its task
        under that id and counts the restart in ``restarted_turns``.  Never raises for
        episode failures (they are on the trajectory); raises only ``CancelledError``."""
        cfg = self.config
        env = self.env.spawn()
        if checkpoint is not None:
            cp = checkpoint
            env.load_state_dict(cp.env_state)
            state = EpisodeState(
                cp.task, seed=cp.seed, episode_id=cp.episode_id, sample_index=cp.sample_index
            )
            state.data = dict(cp.state_data)
            run = EpisodeRun(env, state, cp.group_id, cp.started_at)
        else:
            episode_id = restart_of or new_id()
            seed = episode_seed(cfg.seed, task.id, sample_index)
            state = EpisodeState(task, seed=seed, episode_id=episode_id, sample_index=sample_index)
            run = EpisodeRun(env, state, group_id or episode_id, now())
            if restart_of:  # what it had done is lost with its checkpoint: one restart
                run.restarted_turns = 1
                self.stats["restarted_turns"] += 1
        self._live[state.episode_id] = run
        traj: Trajectory | None = None
        error: str | None = None
        timer = asyncio.timeout(cfg.episode_timeout)
        try:
            async with timer:
                self.pauses.track(timer)
                if env.sandbox_config is not None:
                    run.sandbox = open_sandbox(env.sandbox_config, episode_id=state.episode_id)
                    await run.sandbox.start()
                    state.sandbox = run.sandbox
                if checkpoint is not None:
                    await self._restore_run(run, checkpoint)
                else:
                    reset = await call_hook(
                        env.reset, task, seed=state.seed, executor=self._executor
                    )
                    run.messages.extend(_env_messages(reset, env, "reset"))
                    state.messages = run.messages
                    prompt = await self._prompt_ids(run.messages)
                    run.builder.add_context(prompt)
                    run.prompt_len = len(prompt)
                run.status, run.stop_reason = await self._turns(run)
                run.phase = "scoring"
                traj = self._build(run)
                await self._score(env, state, traj)
        except TimeoutError as exc:
            run.stop_reason = "timeout"
            error = (
                f"EpisodeTimeout: episode exceeded {cfg.episode_timeout}s"
                if timer.expired()
                else f"{type(exc).__name__}: {exc}"
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            run.stop_reason = run.stop_reason or "error"
            error = f"{type(exc).__name__}: {exc}"
            logger.debug("episode %s failed", state.episode_id, exc_info=True)
        finally:
            # live (and not quiescent) until its sandbox is closed: a stop's checkpoint waits
            # for it, so that it is handed back finished rather than cancelled in the close
            run.phase = "done"
            self.pauses.untrack(timer)
            self.backend.end_episode(state.episode_id)
            try:
                if run.sandbox is not None:
                    await close_shielded(run.sandbox)
            finally:
                self._live.pop(state.episode_id, None)
        if traj is None:
            traj = self._build(run)
        if error is not None:  # an exception's text may quote a file name with lone surrogates
            traj.status, traj.error = "failed", unicode_safe(error)
            traj.stop_reason = run.stop_reason
        traj.finished_at = now()
        if not cfg.keep_messages:
            traj.messages = []
        self.stats["episodes"] += 1
        self.stats["failed"] += error is not None
        self.stats["turns"] += len(run.turns)
        return _Outcome(traj, env)

    def _build(self, run: EpisodeRun) -> Trajectory:
        st, turns = run.state, run.turns
        return run.builder.fill(
            Trajectory(
                id=st.episode_id,
                task_id=st.task.id,
                group_id=run.group_id,
                sample_index=st.sample_index,
                seed=st.seed,
                env_name=run.env.name,
                env_version=run.env.version,
                backend=self.backend.name,
                status=run.status,
                stop_reason=run.stop_reason,
                prompt_len=run.prompt_len,
                turns=turns,
                messages=run.messages,
                started_at=run.started,
                metrics={
                    "gen_seconds": sum(t.gen_seconds for t in turns),
                    "tool_seconds": sum(t.tool_seconds for t in turns),
                    "env_seconds": sum(t.env_seconds for t in turns),
                    "restarted_turns": float(run.restarted_turns),
                },
            )
        )

    async def _restore_run(self, run: EpisodeRun, cp: EpisodeCheckpoint) -> None:
        """Load a checkpoint's trajectory, sandbox and pending generation into ``run``."""
        if cp.env_name != run.env.name:
            raise ConfigError(
                f"checkpoint of episode {cp.episode_id} is for environment {cp.env_name!r}, "
                f"not {run.env.name!r}; load it with the environment that wrote it"
            )
        if cp.sandbox is not None:
            if run.sandbox is None:
                raise ConfigError(
                    f"checkpoint of episode {cp.episode_id} has a sandbox snapshot but the "
                    "environment has no sandbox_config"
                )
            await run.sandbox.restore(cp.sandbox)
        run.builder = cp.builder()
        run.turns = list(cp.turns)
        run.messages = list(cp.messages)
        run.state.messages = run.messages
        run.prompt_len = cp.prompt_len
        run.format_errors = cp.format_errors
        run.next_turn = cp.next_turn
        run.restarted_turns = cp.restarted_turns
        if cp.dropped_generation:  # the turn in flight was dropped at the checkpoint: redo it
            run.restarted_turns += 1
            self.stats["restarted_turns"] += 1
        if cp.phase == "generating":
            run.request_id, run.gen_start, run.sampling = cp.request_id, cp.gen_start, cp.sampling
            run.pending = cp.pending

    async def _prompt_ids(self, messages: list[Message]) -> list[int]:
        # prompt_text + encode_rendered (= prompt_ids), not encode(render_prompt(...)): a
        # special token's text in a task's content must be encoded as text
        tok = self.tokenizer
        text, literals = tok.prompt_text(messages, tools=self._tool_specs)
        if len(text) > _LONG_TEXT:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor, tok.encode_rendered, text, literals
            )
        return tok.encode_rendered(text, literals)

    async def _turns(self, run: EpisodeRun) -> tuple[Status, str]:
        """The turn loop, from ``run.next_turn``; returns (status, stop_reason)."""
        cfg = self.config
        env, state, builder = run.env, run.state, run.builder
        gate = self.pauses.gate
        for index in range(run.next_turn, env.max_turns):
            state.turn = run.next_turn = index
            run.phase = "turn"
            if not gate.is_open:
                await gate.wait()
            budget_bound = False
            if run.pending is not None:  # continuing a checkpoint taken mid-generation
                gen_start = run.gen_start
                sampling = run.sampling or cfg.sampling
                request_id = run.request_id
                if env.max_total_tokens is not None:  # as it was when the turn started
                    budget_bound = env.max_total_tokens - gen_start < cfg.sampling.max_tokens
            else:
                max_tokens = cfg.sampling.max_tokens
                if env.max_total_tokens is not None:
                    remaining = env.max_total_tokens - len(builder)
                    if remaining <= 0:
                        return "truncated", "token_budget"
                    budget_bound = remaining < max_tokens
                    max_tokens = min(max_tokens, remaining)
                sampling = msgspec.structs.replace(
                    cfg.sampling,
                    seed=(state.seed + index) & 0x7FFF_FFFF_FFFF_FFFF,
                    max_tokens=max_tokens,
                )
                gen_start = len(builder)
                request_id = f"{state.episode_id}-{index}"
            request = GenerationRequest(
                request_id=request_id,
                prompt_ids=builder.token_ids[:gen_start],  # a copy: the backend may keep it
                sampling=sampling,
                episode_id=state.episode_id,
                turn_index=index,
            )
            t0 = time.perf_counter()
            finish = await self._generate(request, run)
            ended = await self._after_generation(
                run, index, gen_start, finish, time.perf_counter() - t0, budget_bound
            )
            if ended is not None:
                return ended
        return "truncated", "max_turns"  # max_turns == 0

    async def _after_generation(
        self,
        run: EpisodeRun,
        index: int,
        gen_start: int,
        finish: FinishReason,
        gen_seconds: float,
        budget_bound: bool,
    ) -> tuple[Status, str] | None:
        """Parse the turn, run its tools or the environment's reply and append the reply;
        returns (status, stop_reason) when the episode ends here."""
        tok = self.tokenizer
        env, state, builder, messages = run.env, run.state, run.builder, run.messages
        run.phase = "tools"
        t1 = time.perf_counter()
        sampled = builder.token_ids[gen_start:]
        ended_eot = bool(sampled) and sampled[-1] == tok.eot_id
        text = tok.decode(sampled[:-1] if ended_eot else sampled)
        parsed = self.parser.parse(text, call_id_prefix=f"call_{index}")
        # With a malformed call the message keeps the raw text: that is what the model saw.
        content = text if parsed.errors else parsed.content
        messages.append(Message(role="assistant", content=content, tool_calls=parsed.tool_calls))
        turn = Turn(
            index=index,
            gen_start=gen_start,
            gen_end=len(builder),
            env_end=len(builder),
            finish_reason=finish,
            text=parsed.content,
            tool_calls=parsed.tool_calls,
            gen_seconds=gen_seconds,
        )
        run.turns.append(turn)
        if finish == "length":
            return "truncated", "token_budget" if budget_bound else "length"
        if finish == "abort":
            return "failed", "abort"
        if parsed.tool_calls or parsed.errors:
            results = await self._run_tools(env, parsed, state)
            turn.tool_results = results
            turn.tool_seconds = time.perf_counter() - t1
            bad = parsed.errors or any(
                r.error in ("unknown_tool", "bad_arguments") for r in results
            )
            if bad:
                turn.format_error = "; ".join(
                    r.content
                    for r in results
                    if r.error in ("parse", "unknown_tool", "bad_arguments")
                )
            run.format_errors = run.format_errors + 1 if bad else 0
            new = [
                Message(role="tool", content=r.content, tool_call_id=r.call_id, name=r.name)
                for r in results
            ]
            if run.format_errors >= env.max_format_errors:
                messages.extend(new)
                return "ok", "format_errors"
        else:
            run.format_errors = 0
            reply = await call_hook(env.env_response, messages, state, executor=self._executor)
            turn.env_seconds = time.perf_counter() - t1
            if reply is None:
                return "ok", "no_tool_call"
            new = _env_messages(reply, env, "env_response")
        # The reply joins the conversation even when the episode ends on it: the tokens stop at
        # the last sampled turn (the model never saw it), but reward functions read it here.
        messages.extend(new)
        if env.is_done(state):
            return "ok", "env_done"
        if index == env.max_turns - 1:
            return "truncated", "max_turns"
        cont = tok.continuation_ids(new, ended_with_eot=ended_eot)
        if env.max_total_tokens is not None and len(builder) + len(cont) >= env.max_total_tokens:
            return "truncated", "token_budget"  # no room left to generate after the reply
        builder.add_context(cont)
        turn.env_end = len(builder)
        run.next_turn = index + 1
        return None

    def _stream(self, request: GenerationRequest, run: EpisodeRun) -> AsyncIterator[Any]:
        """The backend stream of ``request``: continued from ``run.pending`` when the episode
        was checkpointed mid-generation and the backend can restore it, else from the start
        of the turn (the partial turn is dropped and regenerated)."""
        pending, run.pending = run.pending, None
        if pending is not None:
            if isinstance(self.backend, SupportsSnapshot):
                return self.backend.restore(pending)
            run.builder.truncate(run.gen_start)
            run.restarted_turns += 1
            self.stats["restarted_turns"] += 1
        return self.backend.generate(request)

    async def _generate(self, request: GenerationRequest, run: EpisodeRun) -> FinishReason:
        builder = run.builder
        run.request_id, run.gen_start, run.sampling = (
            request.request_id,
            len(request.prompt_ids),
            request.sampling,
        )
        run.phase = "generating"
        finish: FinishReason | None = None
        timeout = self.config.generation_timeout
        cm = asyncio.timeout(timeout) if timeout is not None else contextlib.nullcontext()
        try:
            async with cm:
                if isinstance(cm, asyncio.Timeout):
                    self.pauses.track(cm)
                async for chunk in self._stream(request, run):
                    if chunk.rollback:
                        keep = len(builder) - chunk.rollback
                        if keep < len(request.prompt_ids):
                            raise BackendError(
                                f"backend rolled back {chunk.rollback} tokens, more than it sampled"
                            )
                        builder.truncate(keep)
                    builder.add_sampled(
                        chunk.token_ids, chunk.logprobs, chunk.policy_version, chunk.kv_version
                    )
                    if chunk.finish_reason is not None:
                        finish = chunk.finish_reason
        except TimeoutError as exc:
            if isinstance(cm, asyncio.Timeout) and cm.expired():
                raise GenerationTimeout(f"generation exceeded {timeout}s") from exc
            raise
        finally:
            if isinstance(cm, asyncio.Timeout):
                self.pauses.untrack(cm)
        if finish is None:
            raise GenerationTimeout("backend stream ended without a finish_reason")
        return finish

    async def _run_tools(
        self, env: Environment, parsed: ParsedOutput, state: EpisodeState
    ) -> list[ToolResult]:
        results = [
            ToolResult(
                call_id=f"{state.turn}_parse_{i}", name="", content=f"Error: {msg}", error="parse"
            )
            for i, msg in enumerate(parsed.errors)
        ]
        calls = parsed.tool_calls
        limits = (env.tool_timeout or self.config.tool_timeout, self.config.max_tool_output_chars)

        def run(call: ToolCall) -> Awaitable[ToolResult]:
            return call_tool(self._tools, env, call, state, limits, self._executor)

        if len(calls) == 1:
            results.append(await run(calls[0]))
        elif calls:
            results.extend(await asyncio.gather(*(run(c) for c in calls)))
        return results

    async def _score(self, env: Environment, state: EpisodeState, traj: Trajectory) -> None:
        """Set ``traj.rewards`` and ``traj.reward`` from the rubric or ``env.reward``."""
        if env.rubric is not None:
            rewards = await env.rubric.score(env, traj, state, self._executor)
            traj.rewards, traj.reward = _finite(rewards, env.rubric.combine(rewards))
            return
        value = await call_hook(env.reward, traj, state, executor=self._executor)
        if isinstance(value, dict):
            keys = [k for k in value if not isinstance(k, str) or unicode_safe(k) != k]
            if keys:  # a trajectory holding them would be refused by the trainer's decoder
                raise TypeError(
                    f"{type(env).__name__}.reward() returned a dict with keys {keys[:3]!r}; "
                    "name each reward with a string (of valid Unicode)"
                )
            rewards = {k: float(v) for k, v in value.items()}
            traj.rewards, traj.reward = _finite(rewards, float(sum(rewards.values())))
        else:
            traj.rewards, traj.reward = _finite({"reward": float(value)}, float(value))


def _env_messages(value: Any, env: Environment, hook: str) -> list[Message]:
    """What an environment's ``reset``/``env_response`` returned, as checked messages: a list
    (or tuple) of ``Message`` or dicts of its fields, each field of its type; every lone
    surrogate in a content becomes ``"?"`` (as in tool output).  Anything else raises
    ``TypeError`` naming the hook and the item (the episode fails with it; before, it failed
    later with an AttributeError from the chat template, or -- a role that is not a string --
    reached the trainer, whose decoder then refused the whole lease)."""
    where = f"{type(env).__name__}.{hook}()"
    if not isinstance(value, list | tuple):
        raise TypeError(f"{where} returned a {type(value).__name__}; return a list of Message")
    try:
        messages = msgspec.convert(msgspec.to_builtins(value), list[Message])
    except (TypeError, msgspec.ValidationError) as exc:
        raise TypeError(f"{where} returned a malformed message: {exc}") from None
    for m in messages:
        m.content = unicode_safe(m.content)
    try:
        msgspec.msgpack.encode(messages)
    except UnicodeEncodeError:
        raise TypeError(
            f"{where} returned a message whose role, name, ids or tool-call arguments are not "
            "valid Unicode (lone surrogates)"
        ) from None
    return messages


def _finite(rewards: dict[str, float], total: float) -> tuple[dict[str, float], float]:
    """``(rewards, total)`` if every value is finite; else ``ValueError`` naming the culprit
    (the episode fails: a NaN would make its whole group's advantages NaN in training)."""
    bad = {k: v for k, v in rewards.items() if not math.isfinite(v)}
    if bad or not math.isfinite(total):
        raise ValueError(f"rewards must be finite numbers, got {bad or {'total': total}}")
    return rewards, total


__all__ = ["RolloutConfig", "RolloutEngine", "TrajectoryBuilder", "episode_seed"]
