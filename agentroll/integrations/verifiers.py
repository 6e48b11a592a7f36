"""verifiers environments run by agentroll: their own rollout logic against the gateway.

Invariants: each episode is one gateway session, in which the verifiers environment's own
``rollout`` talks to the model through an OpenAI client (so its tokens are captured exactly)
and its rubric scores the result; the rubric's reward and each function's score by name
land on the trajectory; a rollout or reward function that raises, or a rollout whose state
records an error, fails that episode as data; ``verifiers`` is imported only when used.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib
import inspect
import math
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from concurrent.futures import Executor
from typing import Any, Literal, Self, TypeVar

from agentroll.env import EpisodeState, Rubric
from agentroll.errors import ConfigError, EnvError, MissingDependencyError
from agentroll.gateway.agent import AgentEnvironment
from agentroll.gateway.config import GatewayConfig
from agentroll.types import Status, Task, Trajectory, unicode_safe

_T = TypeVar("_T")
SUPPORTED = ">=0.3,<0.4"  # the [verifiers] extra; the classic (``vf.Environment``) API

# Where the reward-function failures of the scoring in progress are collected.  verifiers'
# Rubric logs a raising reward function and scores it 0, which would train on a made-up
# reward; the wrapped functions note the failure here so that the episode fails instead.
_FAILURES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "agentroll_verifiers_failures", default=None
)
_WRAPPED = "__agentroll_reports_failures__"


def _verifiers() -> Any:
    """The ``verifiers`` package, or ``MissingDependencyError`` with the pip command."""
    try:
        return importlib.import_module("verifiers")
    except ImportError as exc:
        raise MissingDependencyError("verifiers", "verifiers") from exc


@contextlib.contextmanager
def _translated(stage: str) -> Iterator[None]:
    """The one place foreign errors become agentroll's: ``EnvError`` naming the stage and
    the whole cause chain.  Cancellation passes through untouched."""
    try:
        yield
    except EnvError:
        raise
    except Exception as exc:
        raise EnvError(f"verifiers {stage} raised {_describe(exc)}") from exc


def _describe(error: Any) -> str:
    """``Type: message`` of an exception and of each of its causes (verifiers wraps client
    failures, e.g. ``ModelError`` around the HTTP error, often with an empty message)."""
    if not isinstance(error, BaseException):
        return unicode_safe(str(error))  # an error recorded as data (ErrorData)
    parts, seen = [], set()
    exc: BaseException | None = error
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        parts.append(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
        exc = exc.__cause__ or exc.__context__
    return unicode_safe(" <- ".join(parts))


# -- reward functions that report failures ---------------------------------------------------


def _reporting(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with the same signature and name that notes an exception in ``_FAILURES``
    (when agentroll is scoring) before re-raising it; verifiers then does what it always
    does.  Signature inspection follows ``__wrapped__``, so verifiers still tells group
    functions from per-rollout ones and passes the same arguments."""
    if getattr(func, _WRAPPED, False):
        return func
    name = getattr(func, "__name__", repr(func))

    def note(exc: Exception) -> None:
        failures = _FAILURES.get()
        if failures is not None:
            failures.append(f"reward function {name} raised {_describe(exc)}")

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return await func(*args, **kwargs)
            except Exception as exc:
                note(exc)
                raise

    else:

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                result = func(*args, **kwargs)
            except Exception as exc:
                note(exc)
                raise
            if inspect.isawaitable(result):  # a callable object with an async __call__

                async def awaited() -> Any:
                    try:
                        return await result
                    except Exception as exc:
                        note(exc)
                        raise

                return awaited()
            return result

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _report_failures(rubric: Any) -> None:
    """Wrap every reward function of ``rubric`` and of the rubrics it groups, in place."""
    funcs = getattr(rubric, "funcs", None)
    if isinstance(funcs, list):
        funcs[:] = [_reporting(f) for f in funcs]
    for inner in getattr(rubric, "rubrics", None) or ():
        _report_failures(inner)


@contextlib.asynccontextmanager
async def _scoring() -> Any:
    """Collect reward-function failures while the body scores; ``EnvError`` naming them."""
    failures: list[str] = []
    token = _FAILURES.set(failures)
    try:
        with _translated("rubric"):
            yield
    finally:
        _FAILURES.reset(token)
    if failures:
        raise EnvError("; ".join(failures))


def _scores(vf_state: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
    """The reward and each function's score by name that verifiers put on ``vf_state``."""
    metrics = vf_state.get("metrics") or {}
    try:
        named = {str(k): float(v) for k, v in metrics.items()}
        reward = float(vf_state.get("reward") or 0.0)
    except (TypeError, ValueError) as exc:
        raise EnvError(f"verifiers rubric gave a reward that is not a number: {exc}") from exc
    bad = {k: v for k, v in {**named, "reward": reward}.items() if not math.isfinite(v)}
    if bad:
        raise EnvError(f"verifiers rubric gave rewards that are not finite: {bad}")
    return reward, named


# -- the verifiers event loop ----------------------------------------------------------------


class _Loop:
    """An event loop on a thread of its own for the verifiers environment's code.

    verifiers calls sync tools and reward functions inline on its loop; on the engine's
    loop one slow or hung tool would stall every episode and the gateway itself.  Here it
    stalls only verifiers, and the engine's timeouts still fire: cancelling ``run``
    cancels the coroutine on this loop.  A thread stuck in user code cannot be killed; at
    ``close`` it is abandoned (a daemon), as the engine abandons hung tool threads."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="agentroll-verifiers", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Await ``coro`` run on this loop; cancellation reaches it there."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def close(self, timeout: float = 5.0) -> None:
        """Cancel what still runs here, stop the loop and join its thread (or abandon it
        after ``timeout`` seconds when user code blocks it)."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.run(cancel_all()), timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join, timeout)
        if not self._thread.is_alive():
            self._loop.close()


# -- the environment --------------------------------------------------------------------------


class VerifiersEnvironment(AgentEnvironment):
    """A verifiers environment (``vf.load_environment(...)`` or a constructed
    ``vf.Environment``) as an agentroll environment.

    Tasks are the rows of its dataset (``split="eval"``: its eval dataset): ``Task.data``
    is the row (prompt, answer, info, task, example_id), ``Task.answer`` its answer.  Each
    episode calls the environment's own ``rollout`` with a verifiers OpenAI client on the
    episode's gateway session, then scores it with the environment's rubric: the
    trajectory's ``reward`` is verifiers' reward, ``rewards`` its metrics by name.  When
    the rubric has group reward functions, the engine scores each group once all its
    samples finished (``samples_per_task`` samples of a row form a group).

    ``sampling_args`` are merged over the environment's own, as verifiers' ``generate``
    does; ``model`` is the name sent (default: the gateway's); ``request_timeout`` bounds
    each HTTP call (the engine's ``episode_timeout`` bounds the whole episode).

    The verifiers code (rollout, tools, scoring) runs on an event loop of its own
    (``_Loop``), opened and closed with the engine.  Constructing it wraps the rubric's
    reward functions in place so that one that raises fails its episode (verifiers alone
    would log it and score 0); outside agentroll's scoring they behave exactly as before.
    """

    name = "verifiers"

    def __init__(
        self,
        vf_env: Any,
        *,
        split: Literal["train", "eval"] = "train",
        num_examples: int = -1,
        sampling_args: Mapping[str, Any] | None = None,
        model: str | None = None,
        request_timeout: float | None = 600.0,
        config: GatewayConfig | None = None,
        name: str | None = None,
        host: str = "127.0.0.1",
        token: str | None = None,
    ) -> None:
        vf = _verifiers()
        if not isinstance(vf_env, vf.Environment):
            raise ConfigError(
                f"VerifiersEnvironment needs a verifiers Environment (vf.load_environment(...) "
                f"or a vf.Environment subclass), got {type(vf_env).__name__}; verifiers "
                f"{SUPPORTED} is supported"
            )
        if split not in ("train", "eval"):
            raise ConfigError(f"split={split!r}; use 'train' or 'eval'")
        if request_timeout is not None and not request_timeout > 0:
            raise ConfigError("request_timeout must be > 0 seconds (or None for no limit)")
        env_id = getattr(vf_env, "env_id", "") or ""
        super().__init__(
            self._rollout,  # the per-episode agent; drive_episode runs it on the verifiers loop
            config=config,
            name=name or (f"verifiers:{env_id}" if env_id else "verifiers"),
            host=host,
            token=token,
        )
        self.vf_env = vf_env
        self.split, self.num_examples = split, num_examples
        self.model = model or self.gateway_config.model
        self.request_timeout = request_timeout
        # as verifiers' generate(): the call's arguments over the environment's defaults
        merged: dict[str, Any] = dict(getattr(vf_env, "sampling_args", None) or {})
        extra = dict(merged.get("extra_body") or {})
        for key, value in (sampling_args or {}).items():
            if key == "extra_body":
                extra.update(value or {})
            else:
                merged[key] = value
        merged["extra_body"] = extra
        self.sampling_args = merged
        _report_failures(vf_env.rubric)
        self.group_scoring = bool(getattr(vf_env.rubric, "has_group_rewards", False))
        # group rewards are computed by the engine once a group is whole: its rubric hook
        self.rubric = _GroupRubric(self) if self.group_scoring else None
        # rolled-out, unscored states of groups in flight, by (group id, sample index)
        self._unscored: dict[tuple[str, int], Any] = {}
        self._loop: _Loop | None = None

    @classmethod
    def load(cls, env_id: str, env_args: Mapping[str, Any] | None = None, **kwargs: Any) -> Self:
        """``vf.load_environment(env_id, **env_args)`` (the environment's installed package)
        as a ``VerifiersEnvironment``; ``kwargs`` go to the constructor.  ``ConfigError``
        when verifiers cannot load it."""
        vf = _verifiers()
        try:
            vf_env = vf.load_environment(env_id, **dict(env_args or {}))
        except Exception as exc:
            raise ConfigError(
                f"verifiers could not load environment {env_id!r}: {_describe(exc)}; install "
                f"its package (e.g. `prime env install {env_id}` or pip) and check env_args"
            ) from exc
        return cls(vf_env, **kwargs)

    def tasks(self) -> Iterable[Task]:
        with _translated("dataset"):
            if self.split == "eval":
                dataset = self.vf_env.get_eval_dataset(n=self.num_examples)
            else:
                dataset = self.vf_env.get_dataset(n=self.num_examples)
            rows = dataset.to_list()
        return [_task(row, i) for i, row in enumerate(rows)]

    async def open_driver(self, backend: Any, tokenizer: Any) -> None:
        _report_failures(self.vf_env.rubric)  # rubrics added since construction too
        await super().open_driver(backend, tokenizer)
        self._loop = _Loop()

    async def close_driver(self) -> None:
        self._unscored.clear()  # groups a stop left incomplete are not scored here
        loop, self._loop = self._loop, None
        try:
            if loop is not None:
                await loop.close()
        finally:
            await super().close_driver()

    async def in_verifiers(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` (verifiers code) on the verifiers loop."""
        if self._loop is None:
            coro.close()
            raise RuntimeError("VerifiersEnvironment is not open; run it inside a RolloutEngine")
        return await self._loop.run(coro)

    # -- one episode ---------------------------------------------------------------------

    async def _rollout(self, task: Task, base_url: str, api_key: str) -> Any:
        """The environment's own rollout of ``task`` against ``base_url``, scored unless its
        rubric scores groups: verifiers' state.  Runs on the verifiers loop."""
        openai = importlib.import_module("openai")
        clients = importlib.import_module("verifiers.clients")
        # no retries: a retried call would be a second sample of the same turn
        client = clients.OpenAIChatCompletionsClient(
            openai.AsyncOpenAI(
                base_url=base_url, api_key=api_key, max_retries=0, timeout=self.request_timeout
            )
        )
        try:
            with _translated("rollout"):
                vf_state = await self.vf_env.rollout(
                    dict(task.data), client, self.model, dict(self.sampling_args)
                )
        finally:
            await client.close()
        # verifiers keeps its own errors (model, tool, parse) in the state, not raised
        if vf_state.get("error") is not None:
            raise EnvError(f"verifiers rollout recorded an error: {_describe(vf_state['error'])}")
        if not self.group_scoring:
            await self._score([vf_state])
        return vf_state

    async def _score(self, states: list[Any]) -> None:
        """Score ``states`` with the rubric (as one group when it has group functions), as
        verifiers' own run does; ``EnvError`` if a reward function raised."""
        vf_env = self.vf_env
        rubric = vf_env.rubric
        async with _scoring():
            if self.group_scoring:
                await (rubric.score_group if vf_env.score_rollouts else rubric.dummy_score_group)(
                    states
                )
            else:
                for s in states:
                    score = (
                        rubric.score_rollout
                        if vf_env.score_rollouts
                        else rubric.dummy_score_rollout
                    )
                    await score(s)
            for s in states:
                await rubric.cleanup(s)

    async def drive_episode(
        self, task: Task, state: EpisodeState, group_id: str
    ) -> list[Trajectory]:
        gw = self.gateway
        if gw is None:
            raise RuntimeError("VerifiersEnvironment is not open; run it inside a RolloutEngine")
        session = gw.open_session(task=task, seed=state.seed)
        error: str | None = "CancelledError: the episode was cancelled"  # until it returns
        status: Status = "failed"
        reason = "verifiers_error"
        vf_state: Any = None
        try:
            try:
                base_url = f"{self.url}/sessions/{session.id}/v1"
                vf_state = await self.in_verifiers(self._rollout(task, base_url, session.id))
                if not self.group_scoring:
                    session.set_reward(*_scores(vf_state))
            except Exception as exc:  # a failed verifiers episode is data
                error = unicode_safe(f"{type(exc).__name__}: {exc}")
            else:
                error = None
                truncated = bool(vf_state.get("is_truncated") or vf_state.get("timed_out"))
                status = "truncated" if truncated else "ok"
                reason = str(vf_state.get("stop_condition") or "")
        finally:
            samples = await gw.end(session, status=status, reason=reason)
        if not samples:  # no model call: no trajectory to carry the reason, so raise it
            raise EnvError(error or "the verifiers rollout made no model call")
        for t in samples:
            t.error = error
            if vf_state is not None:
                t.metrics["verifiers_turns"] = float(len(vf_state.get("trajectory") or ()))
        if error is None and self.group_scoring:
            self._unscored[group_id, state.sample_index] = vf_state
        return samples


def _task(row: Mapping[str, Any], index: int) -> Task:
    """A dataset row as a task: the row is the rollout's input, its answer the task's."""
    data = dict(row)
    example = data.get("example_id", index)
    return Task(id=str(example), data=data, answer=data.get("answer"))


class _GroupRubric(Rubric):
    """The engine's group hook for a verifiers rubric with group reward functions: the
    group's rolled-out states are scored together by verifiers; a score per function name
    comes back, and ``combine`` is verifiers' weighted sum of them."""

    def __init__(self, owner: VerifiersEnvironment) -> None:
        super().__init__(group_funcs=[self.verifiers])
        self.owner = owner

    async def verifiers(self, trajectories: list[Trajectory]) -> list[float]:
        """The verifiers reward of each sample of a whole group."""
        return [self.combine(named) for named in await self._named(trajectories)]

    async def score_group(
        self, trajectories: list[Trajectory], executor: Executor | None
    ) -> list[dict[str, float]]:
        """Each sample's verifiers scores by function name (``combine`` sums them)."""
        return await self._named(trajectories)

    async def _named(self, trajectories: list[Trajectory]) -> list[dict[str, float]]:
        owner = self.owner
        keys = [(t.group_id, t.sample_index) for t in trajectories]
        states = [owner._unscored.pop(k, None) for k in keys]
        if any(s is None for s in states):
            raise EnvError("a sample of this group has no verifiers state to score")
        await owner.in_verifiers(owner._score(states))
        out = []
        for s in states:
            reward, named = _scores(s)
            # the engine's reward is combine(named): it must be verifiers' own
            if not math.isclose(self.combine(named), reward, rel_tol=1e-9, abs_tol=1e-9):
                raise EnvError(
                    f"verifiers rubric's reward {reward} is not the weighted sum of its "
                    f"metrics {named}; a rubric that combines scores its own way is not "
                    "supported with group rewards"
                )
            out.append(named)
        return out

    def combine(self, scores: dict[str, float]) -> float:
        rubric = self.owner.vf_env.rubric
        weights = dict(
            zip(rubric._get_reward_func_names(), rubric._get_reward_weights(), strict=False)
        )
        return float(sum(weights.get(k, 0.0) * v for k, v in scores.items()))


__all__ = ["SUPPORTED", "VerifiersEnvironment"]
