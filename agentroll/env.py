"""Environments: how users define tasks, tools, multi-turn feedback and rewards.

Invariants: each episode runs on its own shallow copy of the environment (``spawn()``), so
per-episode attributes set in ``reset()`` never leak between episodes while data loaded in
``__init__`` is shared; the parameters ``sandbox`` and ``state`` are injected by the engine
and hidden from the model (see ``agentroll.tool``).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import importlib
import importlib.metadata
import inspect
import pkgutil
import re
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgspec

from agentroll.errors import ConfigError
from agentroll.sandbox.base import Sandbox, SandboxConfig
from agentroll.tool import INJECTED, Tool, format_tool_output, tool
from agentroll.types import Message, Task, ToolSpec, Trajectory


class EpisodeState:
    """Per-episode scratch state handed to tools (``state`` parameter) and hooks."""

    __slots__ = (
        "data",
        "episode_id",
        "messages",
        "sample_index",
        "sandbox",
        "seed",
        "task",
        "turn",
    )

    def __init__(self, task: Task, *, seed: int, episode_id: str, sample_index: int = 0) -> None:
        self.task = task
        self.seed = seed
        self.episode_id = episode_id
        self.sample_index = sample_index
        self.turn = 0
        self.messages: list[Message] = []
        self.sandbox: Sandbox | None = None
        self.data: dict[str, Any] = {}


# -- calling user code --------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn)


async def call_hook(
    fn: Callable[..., Any], *args: Any, executor: Executor | None = None, **kwargs: Any
) -> Any:
    """Await ``fn(*args, **kwargs)``; a sync ``fn`` runs in ``executor`` (a bounded pool),
    never on the event loop."""
    target = getattr(fn, "__func__", fn)
    if _is_async(target):
        return await fn(*args, **kwargs)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, functools.partial(fn, *args, **kwargs))


@runtime_checkable
class DrivesEpisodes(Protocol):
    """An environment whose episodes run themselves (an outside agent calling the model
    through the gateway): the engine opens it with its backend once, hands it each episode,
    and closes it when the engine closes.  ``drive_episode`` returns the episode's samples
    in order (the last is the episode's own; earlier ones were forked away from), scored;
    it raises only for a broken environment (the episode then fails)."""

    async def open_driver(self, backend: Any, tokenizer: Any) -> None: ...

    async def drive_episode(
        self, task: Task, state: EpisodeState, group_id: str
    ) -> list[Trajectory]: ...

    async def close_driver(self) -> None: ...


# -- rewards --------------------------------------------------------------------------------


RewardFn = Callable[..., Any]
_REWARD_ARGS = frozenset({"trajectory", "task", "answer", "completion", "env", "state", "messages"})


def _reward_kwargs(fn: Callable[..., Any], available: dict[str, Any]) -> dict[str, Any]:
    names = inspect.signature(fn).parameters
    unknown = [n for n in names if n not in _REWARD_ARGS and n != "trajectories"]
    if unknown:
        raise ConfigError(
            f"reward function {fn.__name__} asks for {unknown}; it may take any of "
            f"{sorted(_REWARD_ARGS)} (or 'trajectories' for a group reward)"
        )
    return {n: available[n] for n in names if n in available}


class Rubric:
    """Weighted reward functions.  ``funcs`` score one trajectory and may take any of the
    arguments ``trajectory, task, answer, completion, env, state, messages``; ``group_funcs``
    take ``trajectories`` (all samples of one task) and return one score per sample.  The
    trajectory's ``reward`` is the weighted sum; each score is kept in ``rewards``.  Group
    functions run after every sample of the group has finished and its sandbox is closed:
    what they need from a sandbox, a per-episode function must put on the trajectory."""

    def __init__(
        self,
        funcs: Sequence[RewardFn] = (),
        weights: Sequence[float] | None = None,
        *,
        group_funcs: Sequence[RewardFn] = (),
        group_weights: Sequence[float] | None = None,
    ) -> None:
        self.funcs = list(funcs)
        self.weights = list(weights) if weights is not None else [1.0] * len(self.funcs)
        self.group_funcs = list(group_funcs)
        self.group_weights = (
            list(group_weights) if group_weights is not None else [1.0] * len(self.group_funcs)
        )
        if len(self.weights) != len(self.funcs) or len(self.group_weights) != len(self.group_funcs):
            raise ConfigError("Rubric: give exactly one weight per reward function")

    async def score(
        self,
        env: Environment,
        trajectory: Trajectory,
        state: EpisodeState,
        executor: Executor | None,
    ) -> dict[str, float]:
        completion = next(
            (m.content for m in reversed(trajectory.messages) if m.role == "assistant"), ""
        )
        available = {
            "trajectory": trajectory,
            "task": state.task,
            "answer": state.task.answer,
            "completion": completion,
            "env": env,
            "state": state,
            "messages": trajectory.messages,
        }
        out: dict[str, float] = {}
        for fn in self.funcs:
            out[fn.__name__] = float(
                await call_hook(fn, executor=executor, **_reward_kwargs(fn, available))
            )
        return out

    async def score_group(
        self, trajectories: list[Trajectory], executor: Executor | None
    ) -> list[dict[str, float]]:
        out: list[dict[str, float]] = [{} for _ in trajectories]
        for fn in self.group_funcs:
            scores = await call_hook(fn, trajectories, executor=executor)
            if len(scores) != len(trajectories):
                raise ValueError(
                    f"group reward {fn.__name__} returned {len(scores)} scores for {len(trajectories)} samples"
                )
            for d, s in zip(out, scores, strict=True):
                d[fn.__name__] = float(s)
        return out

    def combine(self, scores: dict[str, float]) -> float:
        w = {f.__name__: x for f, x in zip(self.funcs, self.weights, strict=True)}
        w.update({f.__name__: x for f, x in zip(self.group_funcs, self.group_weights, strict=True)})
        return float(sum(w.get(k, 1.0) * v for k, v in scores.items()))


# -- the environment ----------------------------------------------------------------------------


def _snake(name: str) -> str:
    return (
        re.sub(r"(?<!^)(?=[A-Z])", "_", name)
        .lower()
        .removesuffix("_env")
        .removesuffix("_environment")
    )


class Environment:
    """Base class of environments.  Override what you need; defaults are sensible.

    Class attributes: ``name``, ``version``, ``system_prompt``, ``max_turns``,
    ``max_total_tokens`` (token budget), ``max_format_errors`` (consecutive turns with a
    malformed, unknown or badly argued tool call),
    ``sandbox_config`` (a ``SandboxConfig``: one sandbox per episode, in ``state.sandbox``),
    ``tool_timeout``, ``extra_tools`` (free ``@tool`` functions, e.g. from ``agentroll.tools``),
    ``rubric``.

    A subclass is a short declarative class: ``tasks()``, ``reset()``, ``@tool`` methods,
    optional ``env_response()``, and a ``reward()`` or a ``Rubric``.  Tool argument schemas come
    from signatures and docstrings.
    """

    name: ClassVar[str] = ""
    version: ClassVar[str] = "0"
    system_prompt: ClassVar[str | None] = None
    max_turns: int = 8
    max_total_tokens: int | None = None
    max_format_errors: int = 3
    sandbox_config: ClassVar[SandboxConfig | None] = None
    tool_timeout: float | None = None
    extra_tools: ClassVar[Sequence[Tool]] = ()
    rubric: Rubric | None = None

    _tools: ClassVar[dict[str, Tool]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("name"):
            cls.name = _snake(cls.__name__)
        tools: dict[str, Tool] = {}
        for klass in reversed(cls.__mro__):
            for value in vars(klass).values():
                if isinstance(value, Tool):
                    tools[value.name] = value
        for t in cls.extra_tools:
            if t.is_method:
                raise ConfigError(
                    f"extra_tools entry {t.name!r} is a method; list free functions only"
                )
            tools[t.name] = t
        cls._tools = tools
        needs_sandbox = [t.name for t in tools.values() if "sandbox" in t.injected]
        if needs_sandbox and cls.sandbox_config is None:
            raise ConfigError(
                f"{cls.__name__}: tools {needs_sandbox} take a sandbox but sandbox_config is None; "
                "set sandbox_config = SandboxConfig() on the environment"
            )

    # -- what the engine reads --

    @property
    def tools(self) -> dict[str, Tool]:
        return self._tools

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return [t.spec for t in self._tools.values()]

    def spawn(self) -> Environment:
        """The per-episode copy (shallow): set per-episode attributes in ``reset``."""
        return copy.copy(self)

    # -- hooks --

    def tasks(self) -> Iterable[Task]:
        """The tasks of this environment (override, or pass tasks to ``engine.run``)."""
        raise NotImplementedError(
            f"{type(self).__name__} has no tasks(); pass tasks to engine.run()"
        )

    async def reset(self, task: Task, *, seed: int) -> list[Message]:
        """Initial messages of an episode.  Default: ``system_prompt`` + ``task.data['prompt']``."""
        prompt = task.data.get("prompt")
        if prompt is None:
            raise ConfigError(f"task {task.id!r} has no data['prompt']; override reset()")
        msgs = [Message(role="system", content=self.system_prompt)] if self.system_prompt else []
        if isinstance(prompt, str):
            msgs.append(Message(role="user", content=prompt))
        else:
            msgs.extend(msgspec.convert(prompt, list[Message]))
        return msgs

    async def env_response(
        self, messages: list[Message], state: EpisodeState
    ) -> list[Message] | None:
        """Feedback when the model made no tool call; ``None`` ends the episode."""
        return None

    def is_done(self, state: EpisodeState) -> bool:
        """Extra stop condition, checked after every turn."""
        return False

    async def reward(self, trajectory: Trajectory, state: EpisodeState) -> float | dict[str, float]:
        """Score a finished episode.  Default: the rubric, or 0."""
        return 0.0

    async def end_episode(self, state: EpisodeState) -> None:
        """Release what the episode holds outside its sandbox (a remote session, a lease).
        Called once per episode run, however it ended (finished, failed, cancelled or
        checkpointed by a stop), before its sandbox closes; shielded from cancellation; an
        exception is logged, not raised.  Default: nothing."""

    def state_dict(self) -> dict[str, Any]:
        """Per-episode state to checkpoint (msgspec-encodable).  Default: none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


# -- registry ---------------------------------------------------------------------------------


def _env_classes(module: Any) -> list[type[Environment]]:
    return [
        v
        for v in vars(module).values()
        if isinstance(v, type)
        and issubclass(v, Environment)
        and v is not Environment
        and v.__module__ == module.__name__
    ]


def environment_class(name: str) -> type[Environment]:
    """Find an environment class by name: ``pkg.module:Class``, an installed entry point in
    group ``agentroll.environments``, or a module of ``agentroll.environments``."""
    if ":" in name:
        mod_name, _, cls_name = name.partition(":")
        cls = getattr(importlib.import_module(mod_name), cls_name)
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ConfigError(f"{name} is not an Environment subclass")
        return cls
    for ep in importlib.metadata.entry_points(group="agentroll.environments"):
        if ep.name == name:
            return ep.load()
    # looked up by name: the built-in environments live outside this package's folder
    builtin = importlib.import_module("agentroll.environments")

    try:
        module = importlib.import_module(f"agentroll.environments.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"agentroll.environments.{name}":
            raise
        known = sorted(m.name for m in pkgutil.iter_modules(builtin.__path__))
        raise ConfigError(
            f"no environment named {name!r}; built-in: {known}; or give 'module:Class', or "
            "register an entry point in group 'agentroll.environments'"
        ) from None
    classes = _env_classes(module)
    if len(classes) != 1:
        raise ConfigError(
            f"agentroll.environments.{name} defines {len(classes)} environments; expected 1"
        )
    return classes[0]


def load_environment(name: str, **kwargs: Any) -> Environment:
    """Instantiate the environment called ``name`` with ``kwargs``."""
    return environment_class(name)(**kwargs)


__all__ = [
    "INJECTED",
    "DrivesEpisodes",
    "Environment",
    "EpisodeState",
    "Rubric",
    "Tool",
    "call_hook",
    "environment_class",
    "format_tool_output",
    "load_environment",
    "tool",
]
