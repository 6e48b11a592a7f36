"""How one episode runs: prompt, model turns, tool calls, scoring, its token arrays.

``EpisodeLoop`` is the part of ``RolloutEngine`` that drives a single episode; the engine
adds scheduling, pauses and checkpoints.  Invariants: every sampled token enters the
builder with the chunk's versions; a turn cut by a restart is dropped and regenerated.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import msgspec

from agentroll.backends.base import (
    Backend,
    GenerationRequest,
    SupportsSnapshot,
)
from agentroll.chat import ChatTokenizer, ParsedOutput
from agentroll.env import DrivesEpisodes, Environment, EpisodeState, call_hook
from agentroll.errors import (
    BackendError,
    ChatTemplateError,
    ConfigError,
    EnvError,
    GenerationTimeout,
)
from agentroll.rollout.builder import TrajectoryBuilder, common_prefix
from agentroll.rollout.checkpoint import EpisodeCheckpoint, EpisodeRun
from agentroll.rollout.pause import PauseController
from agentroll.rollout.prewarm import WarmPool, close_shielded, run_shielded
from agentroll.rollout.tool_cache import CACHEABLE_ERRORS, ToolCache, for_call
from agentroll.sandbox import open_sandbox
from agentroll.tool import call_tool
from agentroll.types import (
    FinishReason,
    Fork,
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
    from agentroll.chat import ToolParser
    from agentroll.rollout.engine import RolloutConfig


# the engine's logger: episode failures are logged where users look for them
logger = logging.getLogger("agentroll.rollout.engine")
_LONG_TEXT = 64 * 1024  # render/tokenize texts longer than this off the event loop


def episode_seed(base: int, task_id: str, sample_index: int) -> int:
    """Deterministic 63-bit seed of one episode."""
    digest = hashlib.blake2b(f"{base}:{task_id}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _Outcome:
    """A finished episode waiting for its group (group rewards need all samples).
    ``earlier``: the episode's samples before ``trajectory`` (it forked away from them)."""

    __slots__ = ("earlier", "env", "trajectory")

    def __init__(
        self, trajectory: Trajectory, env: Environment, earlier: list[Trajectory] | None = None
    ) -> None:
        self.trajectory = trajectory
        self.env = env
        self.earlier = earlier or []

    @property
    def all(self) -> list[Trajectory]:
        return [*self.earlier, self.trajectory]


class EpisodeLoop:
    """The episode half of ``RolloutEngine`` (which sets every attribute below)."""

    backend: Backend
    env: Environment
    config: RolloutConfig
    tokenizer: ChatTokenizer
    parser: ToolParser
    pauses: PauseController
    stats: dict[str, int]
    _tools: dict[str, Any]
    _tool_specs: Any
    tool_cache: ToolCache | None
    _tool_inflight: dict[str, asyncio.Future[ToolResult]]
    _warm: WarmPool | None  # sandboxes started ahead of their episodes (pre-warm)
    _executor: ThreadPoolExecutor | None
    _live: dict[str, EpisodeRun]

    async def run_episode(
        self,
        task: Task,
        *,
        sample_index: int = 0,
        group_id: str | None = None,
        checkpoint: EpisodeCheckpoint | None = None,
        restart_of: str = "",
        cut: bool = False,
    ) -> _Outcome:
        """Run one episode to completion (or continue ``checkpoint``).  ``restart_of``: the
        id of an episode whose checkpoint was refused; this run restarts it from its task
        under that id and counts the restart in ``restarted_turns``.  ``cut``: its group
        was decided before it started (it ends at once, status ``cut``).  Never raises for
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
        earlier: list[Trajectory] = []
        error: str | None = None
        timer = asyncio.timeout(cfg.episode_timeout)
        run.cut_timer = cut_timer = asyncio.timeout(None)
        try:
            async with timer, cut_timer:
                self.pauses.track(timer)
                if cut:  # decided before it started: it does nothing
                    raise TimeoutError("its group was decided")
                if env.sandbox_config is not None:
                    warm = self._warm if checkpoint is None else None
                    run.sandbox = await warm.take() if warm is not None else None
                    self.stats["prewarmed_sandboxes"] += run.sandbox is not None
                    if run.sandbox is None:
                        run.sandbox = open_sandbox(env.sandbox_config, episode_id=state.episode_id)
                        await run.sandbox.start()
                    state.sandbox = run.sandbox
                if isinstance(env, DrivesEpisodes) and checkpoint is None:
                    samples = await env.drive_episode(task, state, run.group_id)
                    traj, earlier = self._driven(run, samples)
                elif checkpoint is not None:
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
                if traj is None:
                    run.status, run.stop_reason = await self._turns(run)
                    run.phase = "scoring"
                    traj = self._build(run)
                    await self._score(env, state, traj)
                    for t in run.earlier:  # one episode, one reward: every sample has it
                        t.reward, t.rewards = traj.reward, dict(traj.rewards)
        except TimeoutError as exc:
            was_cut = cut or cut_timer.expired()
            if was_cut:  # a straggler of a decided group: data, not a failure
                run.status, run.stop_reason = "cut", "group_cutoff"
            else:
                run.stop_reason = "timeout"
            error = (
                None
                if was_cut
                else (
                    f"EpisodeTimeout: episode exceeded {cfg.episode_timeout}s"
                    if timer.expired()
                    else f"{type(exc).__name__}: {exc}"
                )
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
                try:
                    await _end_shielded(env, state)
                finally:  # also when a cancellation arrived during end_episode
                    if run.sandbox is not None:
                        await close_shielded(run.sandbox)
            finally:
                self._live.pop(state.episode_id, None)
        if traj is None:
            traj = self._build(run)
        if run.status == "cut":
            traj.status = "cut"
            traj.loss_mask[:] = 0  # its reward is the group's decided one: never trained on
        if not earlier:
            earlier = run.earlier
        if error is not None:  # an exception's text may quote a file name with lone surrogates
            traj.status, traj.error = "failed", unicode_safe(error)
            traj.stop_reason = run.stop_reason
            for t in earlier:
                t.status, t.error = "failed", traj.error
        traj.finished_at = now()
        if not cfg.keep_messages:
            traj.messages = []
        self.stats["episodes"] += 1
        self.stats["failed"] += error is not None
        self.stats["turns"] += len(run.turns)
        return _Outcome(traj, env, earlier)

    def _driven(
        self, run: EpisodeRun, samples: list[Trajectory]
    ) -> tuple[Trajectory, list[Trajectory]]:
        """A self-driven episode's samples under this episode's identity: the last is the
        episode's trajectory, the earlier ones are delivered with it.  Raises ``EnvError``
        when there is none (no model call was made)."""
        st = run.state
        for k, t in enumerate(samples):
            last = k == len(samples) - 1
            t.id = st.episode_id if last else f"{st.episode_id}-s{k}"
            t.group_id, t.sample_index, t.seed = run.group_id, st.sample_index, st.seed
            t.env_name, t.env_version = run.env.name, run.env.version
        if not samples:  # nothing to build a trajectory from: a failed episode, with why
            run.stop_reason = "no_calls"
            raise EnvError(
                f"{type(run.env).__name__}.drive_episode made no model call; the episode "
                "has no tokens to train on"
            )
        return samples[-1], samples[:-1]

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
                forks=list(run.forks),
                started_at=run.started,
                metrics={
                    "gen_seconds": sum(t.gen_seconds for t in turns),
                    "tool_seconds": sum(t.tool_seconds for t in turns),
                    "env_seconds": sum(t.env_seconds for t in turns),
                    "restarted_turns": float(run.restarted_turns),
                    "forks": float(len(run.earlier)),
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
        run.earlier, run.forks = list(cp.earlier), list(cp.forks)
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
        env, state = run.env, run.state
        gate = self.pauses.gate
        for index in range(run.next_turn, env.max_turns):
            builder = run.builder  # a new one after a fork
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
                group_id=run.group_id,
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
        try:
            cont = tok.continuation_ids(new, ended_with_eot=ended_eot)
        except ChatTemplateError:
            # the template renders the history differently once more is added: the episode
            # goes on in a new sample rendered whole, never in re-tokenised drift
            cont = None
        if cont is None:
            prompt = await self._fork(run, index)
            if env.max_total_tokens is not None and len(prompt) >= env.max_total_tokens:
                return "truncated", "token_budget"
        else:
            if env.max_total_tokens is not None and (
                len(builder) + len(cont) >= env.max_total_tokens
            ):
                return "truncated", "token_budget"  # no room left to generate after the reply
            builder.add_context(cont)
            turn.env_end = len(builder)
        run.next_turn = index + 1
        return None

    async def _fork(self, run: EpisodeRun, index: int) -> list[int]:
        """End the current sample (``stop_reason="forked"``) and start the next one from the
        whole conversation rendered afresh; returns its prompt."""
        done = self._build(run)
        done.id = f"{run.episode_id}-s{len(run.earlier)}"
        done.stop_reason = "forked"
        done.messages = list(run.messages)
        prompt = await self._prompt_ids(run.messages)
        old = done.token_ids
        common = common_prefix(old, prompt)
        run.forks = [
            Fork(
                from_sample=len(run.earlier),
                at_call=index + 1,
                reason="template_rewrites",
                common_tokens=common,
                mismatched_tokens=len(old) - common,
            )
        ]
        run.earlier.append(done)
        run.builder = TrajectoryBuilder()
        run.builder.add_context(prompt)
        run.prompt_len = len(prompt)
        run.turns = []
        self.stats["forks"] += 1
        return prompt

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
            tool = self._tools.get(call.name)
            if self.tool_cache is not None and tool is not None and tool.pure:
                return self._cached_call(tool, env, call, state, limits)
            return call_tool(self._tools, env, call, state, limits, self._executor)

        if len(calls) == 1:
            results.append(await run(calls[0]))
        elif calls:
            results.extend(await asyncio.gather(*(run(c) for c in calls)))
        return results

    async def _cached_call(
        self,
        tool: Any,
        env: Environment,
        call: ToolCall,
        state: EpisodeState,
        limits: tuple[float, int],
    ) -> ToolResult:
        """A pure tool's call through the cache: a hit answers without running it, unless
        it is sampled for verification; a miss whose key is already running (the samples
        of a group make the same first call together) waits for that run and shares its
        result; what runs is stored (and compared)."""
        cache = self.tool_cache
        assert cache is not None
        try:
            arguments = tool.validate(call.arguments)
        except ValueError:  # call_tool says what is wrong with them
            arguments = None
        if arguments is None or not cache.enabled(tool.name):
            return await call_tool(self._tools, env, call, state, limits, self._executor)
        sandbox = None
        if "sandbox" in tool.injected and state.sandbox is not None:
            sandbox = await state.sandbox.state_digest()
        task_id = state.task.id if "state" in tool.injected else None
        key = cache.key(tool.name, arguments, task_id=task_id, sandbox=sandbox)
        hit, verify = cache.lookup(tool.name, key)
        if hit is not None and not verify:
            return for_call(hit, call.id)
        running = self._tool_inflight.get(key) if hit is None else None
        if running is not None:
            await asyncio.wait({running})  # its failure is not ours: then this call runs
            if not running.cancelled() and running.exception() is None:
                shared = running.result()
                if shared.error in CACHEABLE_ERRORS and cache.enabled(tool.name):
                    cache.joined()
                    return for_call(msgspec.structs.replace(shared, cached=True), call.id)
        mine: asyncio.Future[ToolResult] | None = None
        if hit is None and key not in self._tool_inflight:
            mine = self._tool_inflight[key] = asyncio.get_running_loop().create_future()
        try:
            fresh = await call_tool(self._tools, env, call, state, limits, self._executor)
        except BaseException:
            if mine is not None:
                mine.cancel()
            raise
        finally:
            if mine is not None:
                self._tool_inflight.pop(key, None)
        if mine is not None:
            mine.set_result(fresh)
        cache.store(tool.name, key, fresh)
        return fresh

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


async def _end_shielded(env: Environment, state: EpisodeState) -> None:
    """``env.end_episode(state)`` to completion even if the episode is being cancelled; its
    failure is logged (the episode's outcome is already decided).  An environment that does
    not override the hook costs nothing here (no task per episode)."""
    if type(env).end_episode is Environment.end_episode:
        return
    await run_shielded(call_hook(env.end_episode, state), f"{type(env).__name__}.end_episode")


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
