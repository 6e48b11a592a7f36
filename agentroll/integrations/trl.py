"""TRL's ``GRPOTrainer`` over agentroll episodes: ``rollout_func`` and ``environment_factory``.

``AgentrollRollout`` is a ``rollout_func``: TRL's prompts become agentroll episodes
(multi-turn, tools, sandboxes, a group of ``num_generations`` per prompt) on an agentroll
backend.  Invariants: TRL trains on exactly the ids the backend sampled (prompt = the first
rendered prompt, completion = every later token, ``env_mask`` = the loss mask), and before
each rollout the trainer's weights reach the backend as a checksummed delta whose live
digest must equal the trainer's, else ``WeightSyncError`` stops training.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import numpy as np
import xxhash

from agentroll.env import Environment, EpisodeState, call_hook
from agentroll.errors import ConfigError, MissingDependencyError, WeightSyncError
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.rollout.prewarm import close_shielded
from agentroll.sandbox import open_sandbox
from agentroll.tool import call_tool
from agentroll.types import Message, Task, ToolCall, Trajectory, new_id

if TYPE_CHECKING:
    import torch

    from agentroll.backends.base import Backend
    from agentroll.sandbox.base import Sandbox
    from agentroll.weights.exporter import WeightExporter
    from agentroll.weights.update import WeightUpdate

__all__ = [
    "SUPPORTED_TRL",
    "AgentrollRollout",
    "SyncRecord",
    "agentroll_reward",
    "check_trl",
    "environment_factory",
    "trl_dataset",
]

#: the TRL releases whose ``rollout_func`` / ``environment_factory`` contracts this adapter
#: follows (``GRPOTrainer(rollout_func=f)``, ``f(prompts, trainer) -> {prompt_ids, ...}``)
SUPPORTED_TRL = ">=1.14,<2"
_LOW, _HIGH = (1, 14), (2, 0)

T = TypeVar("T")


def check_trl() -> str:
    """The installed TRL's version; raises ``MissingDependencyError`` when TRL is absent and
    ``ConfigError`` naming ``SUPPORTED_TRL`` when its ``GRPOTrainer`` contract differs."""
    try:
        import trl
        from trl import GRPOTrainer
    except ImportError as exc:
        raise MissingDependencyError("trl", "trl") from exc
    version = str(trl.__version__)
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    params = inspect.signature(GRPOTrainer.__init__).parameters
    if not (_LOW <= parts < _HIGH) or not {"rollout_func", "environment_factory"} <= set(params):
        raise ConfigError(
            f"trl {version} is installed; agentroll's TRL adapter supports trl{SUPPORTED_TRL} "
            f"(GRPOTrainer with rollout_func and environment_factory): "
            f"pip install 'trl{SUPPORTED_TRL}'"
        )
    return version


class _LoopThread:
    """An event loop on its own thread: the backend, its engine and the sandboxes live there
    while TRL's synchronous trainer calls in.  ``close()`` joins the thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for it (at most ``timeout`` seconds: then it is
        cancelled and ``TimeoutError`` raised)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def _prompt_key(prompt: Any) -> str:
    """A stable key of a TRL prompt (a string or a list of message dicts)."""
    return json.dumps(prompt, sort_keys=True, default=str, ensure_ascii=False)


def _as_prompt(value: Any) -> list[dict[str, Any]]:
    """A task's ``data['prompt']`` as TRL's conversational prompt."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return [msgspec.to_builtins(m) if isinstance(m, Message) else dict(m) for m in value]


def trl_dataset(tasks: Iterable[Task]) -> Any:
    """A ``datasets.Dataset`` TRL can train on: ``prompt`` (conversational, from each task's
    ``data['prompt']``) and ``task_id``; ``AgentrollRollout(tasks=...)`` finds each row's
    task again by its prompt, so the environment scores with the task's own data."""
    try:
        from datasets import Dataset
    except ImportError as exc:
        raise MissingDependencyError("datasets", "trl") from exc
    rows = {"prompt": [], "task_id": []}  # type: dict[str, list[Any]]
    for task in tasks:
        if "prompt" not in task.data:
            raise ConfigError(f"task {task.id!r} has no data['prompt'] to train on")
        rows["prompt"].append(_as_prompt(task.data["prompt"]))
        rows["task_id"].append(task.id)
    return Dataset.from_dict(rows)


class SyncRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One weight sync before a rollout: the trainer step it carried, the version the
    backend holds after it, the update's kind and encoded size, and both digests (equal)."""

    step: int
    version: int
    kind: str
    payload_bytes: int
    trainer_digest: str
    backend_digest: str


class AgentrollRollout:
    """``GRPOTrainer(rollout_func=AgentrollRollout(env, backend, tasks=...))``.

    Each call runs ``num_generations`` episodes per distinct prompt (TRL repeats each prompt
    that many times in a row) on ``backend`` with ``env`` and returns, per prompt entry in
    order: ``prompt_ids``, ``completion_ids``, ``logprobs`` (the sampled tokens'; 0 on
    environment tokens, which ``env_mask`` excludes), ``env_mask`` and, for reward
    functions, ``agentroll_reward``, ``agentroll_status``, ``agentroll_min_policy_version``
    and ``agentroll_trajectory_id``.  ``backend``: a ``Backend`` (not started) or a model
    directory for the built-in engine.  ``sync_weights``: push the trainer's weights to the
    backend before each rollout (a delta against the last push, paused with
    ``resume_policy``; the digests are compared, ``syncs`` records each).  ``timeout``:
    seconds one call may take.  A failed episode is returned like any other (reward 0 unless
    its environment scored it); ``close()`` (or ``with``) stops the backend and its thread.
    """

    def __init__(
        self,
        env: Environment,
        backend: Backend | str | Path,
        *,
        tasks: Iterable[Task] = (),
        config: RolloutConfig | None = None,
        sync_weights: bool = True,
        resume_policy: str = "keep",
        timeout: float | None = 3600.0,
    ) -> None:
        check_trl()
        if resume_policy not in ("keep", "recompute", "restart"):
            raise ConfigError(
                f"resume_policy={resume_policy!r}: use 'keep', 'recompute' or 'restart'"
            )
        if isinstance(backend, str | Path):
            from agentroll.backends.torch import TorchBackend

            backend = TorchBackend(str(backend))
        self.env, self.backend = env, backend
        self.config = config or RolloutConfig(progress="off")
        self.sync_weights, self.resume_policy, self.timeout = sync_weights, resume_policy, timeout
        self._tasks = {_prompt_key(_as_prompt(t.data["prompt"])): t for t in tasks}
        self.syncs: list[SyncRecord] = []
        self.trajectories: list[Trajectory] = []  # the last call's, in TRL's order
        self.calls = 0
        self._exporter: WeightExporter | None = None
        self._served: set[str] = set()
        self._synced_step: int | None = None
        self._loop = _LoopThread("agentroll-trl")
        try:
            self._loop.run(self.backend.start())
        except BaseException:
            self._loop.close()
            raise

    def __enter__(self) -> AgentrollRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the backend and the loop thread (idempotent)."""
        if self._loop.loop.is_closed():
            return
        try:
            self._loop.run(self.backend.close(), timeout=120)
        finally:
            self._loop.close()

    # -- the rollout --------------------------------------------------------------------

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        n = int(trainer.num_generations if trainer.model.training else trainer.num_generations_eval)
        if n < 1 or len(prompts) % n:
            raise ConfigError(
                f"TRL handed over {len(prompts)} prompts, not a multiple of num_generations={n}"
            )
        tasks: list[Task] = []
        seen: dict[str, int] = {}
        for g in range(0, len(prompts), n):
            group = prompts[g : g + n]
            if any(_prompt_key(p) != _prompt_key(group[0]) for p in group):
                raise ConfigError(
                    f"prompts {g}..{g + n - 1} are not one prompt repeated num_generations={n} "
                    "times (TRL's RepeatSampler order); use GRPOTrainer's own sampler"
                )
            tasks.append(self._task(group[0], seen))
        if self.sync_weights:
            self._sync(trainer)
        step = int(trainer.state.global_step)
        # a fresh seed base per call: a step's samples differ from the last step's
        seed = int(
            xxhash.xxh3_64_intdigest(f"{self.config.seed}:{step}:{self.calls}".encode()) >> 1
        )
        config = msgspec.structs.replace(self.config, samples_per_task=n, seed=seed)
        self.calls += 1
        trajs = self._loop.run(self._episodes(tasks, config), timeout=self.timeout)
        by_key = {(t.task_id, t.sample_index): t for t in trajs if t.stop_reason != "forked"}
        ordered = [by_key[task.id, i] for task in tasks for i in range(n)]
        self.trajectories = ordered
        return _trl_fields(ordered)

    def _task(self, prompt: Any, seen: dict[str, int]) -> Task:
        """The agentroll task of a TRL prompt: the dataset's own (``tasks=``) or one built from
        the prompt; a prompt twice in one batch gets a second id (its own seeds)."""
        key = _prompt_key(prompt)
        task = self._tasks.get(key)
        if task is None:
            digest = xxhash.xxh3_64_hexdigest(key.encode())
            task = Task(id=f"trl-{digest}", data={"prompt": prompt})
        repeat = seen.get(task.id, 0)
        seen[task.id] = repeat + 1
        return task if repeat == 0 else msgspec.structs.replace(task, id=f"{task.id}#{repeat}")

    async def _episodes(self, tasks: list[Task], config: RolloutConfig) -> list[Trajectory]:
        async with RolloutEngine(self.backend, self.env, config) as engine:
            return [t async for t in engine.run(tasks)]

    # -- weight sync --------------------------------------------------------------------

    def _trainer_state(self, trainer: Any) -> dict[str, torch.Tensor]:
        model = trainer.accelerator.unwrap_model(trainer.model)
        state = {k: v for k, v in model.state_dict().items() if k in self._served}
        missing = sorted(self._served - set(state))
        if missing:
            raise ConfigError(
                f"the trainer's model has no tensor {missing[0]!r} the backend serves: train "
                "the checkpoint the backend loaded (same architecture and names)"
            )
        return state

    def _sync(self, trainer: Any) -> None:
        """Bring the backend to the trainer's weights (once per trainer step) and compare
        the backend's live digest with the trainer's."""
        from agentroll.weights.exporter import WeightExporter
        from agentroll.weights.update import model_digest, state_checksums

        step = int(trainer.state.global_step)
        if self._synced_step == step:
            return
        # the trainer's digest is the one of the exporter's snapshot, taken from the live
        # weights at this call (export() checksums every tensor anyway: not hashed twice)
        update: WeightUpdate | None
        if self._exporter is None:
            self._served = set(self._loop.run(self._backend_state_names()))
            exporter = WeightExporter(lambda: self._trainer_state(trainer))
            exporter.version = self.backend.policy_version
            self._exporter = exporter
            trainer_digest = model_digest(state_checksums(exporter.base))
            backend_digest = self._loop.run(self._backend_digest())
            # the first push is a full update unless the backend loaded the same bytes
            update = None if backend_digest == trainer_digest else exporter.full()
        else:
            update = self._exporter.export()
            trainer_digest = update.digest
        if update is not None:
            self._loop.run(self._apply(update), timeout=self.timeout)
            backend_digest = self._loop.run(self._backend_digest())
        if backend_digest != trainer_digest:
            raise WeightSyncError(
                f"after the sync of step {step} the backend's weights digest {backend_digest} "
                f"differs from the trainer's {trainer_digest}: the backend serves other weights "
                "than TRL trains (check the serving dtype and the checkpoint)"
            )
        self._synced_step = step
        self.syncs.append(
            SyncRecord(
                step=step,
                version=self.backend.policy_version,
                kind="none" if update is None else update.kind,
                payload_bytes=0 if update is None else sum(len(t.payload) for t in update.tensors),
                trainer_digest=trainer_digest,
                backend_digest=backend_digest,
            )
        )

    async def _apply(self, update: WeightUpdate) -> None:
        await self.backend.pause(self.resume_policy)  # type: ignore[arg-type]
        try:
            await self.backend.apply(update)
        finally:
            await self.backend.resume()

    def _live_state(self) -> Mapping[str, torch.Tensor]:
        engine = getattr(self.backend, "engine", None)
        if engine is None:
            raise ConfigError(
                f"weight sync needs a backend whose weights agentroll can read (the built-in "
                f"torch engine); {type(self.backend).__name__} is not: pass sync_weights=False "
                "and sync it yourself"
            )
        state: Mapping[str, torch.Tensor] = engine.runner.state_dict()
        return state

    async def _backend_state_names(self) -> list[str]:
        return list(self._live_state())

    async def _backend_digest(self) -> str:
        from agentroll.weights.update import model_digest, state_checksums

        await self.backend.pause(self.resume_policy)  # type: ignore[arg-type]
        try:  # paused: no step writes the weights while they are read
            return model_digest(state_checksums(self._live_state()))
        finally:
            await self.backend.resume()


def _trl_fields(trajs: Sequence[Trajectory]) -> dict[str, list[Any]]:
    """What TRL's rollout_func returns, from trajectories in TRL's order."""
    out: dict[str, list[Any]] = {
        k: []
        for k in (
            "prompt_ids",
            "completion_ids",
            "logprobs",
            "env_mask",
            "agentroll_reward",
            "agentroll_status",
            "agentroll_min_policy_version",
            "agentroll_trajectory_id",
        )
    }
    for t in trajs:
        cut = t.prompt_len
        mask = t.loss_mask[cut:]
        logprobs = np.where(mask == 1, np.nan_to_num(t.logprobs[cut:], nan=0.0), 0.0)
        sampled = t.policy_version[t.loss_mask == 1]
        out["prompt_ids"].append(t.token_ids[:cut].tolist())
        out["completion_ids"].append(t.token_ids[cut:].tolist())
        out["logprobs"].append(logprobs.astype(float).tolist())
        out["env_mask"].append(mask.astype(int).tolist())
        out["agentroll_reward"].append(float(t.reward))
        out["agentroll_status"].append(t.status)
        out["agentroll_min_policy_version"].append(int(sampled.min()) if len(sampled) else -1)
        out["agentroll_trajectory_id"].append(t.id)
    return out


def agentroll_reward(
    completions: list[Any], agentroll_reward: list[float], **_: Any
) -> list[float]:
    """A TRL reward function: the reward agentroll's environment gave each episode (pass it
    in ``reward_funcs`` beside ``AgentrollRollout``)."""
    if len(agentroll_reward) != len(completions):
        raise ConfigError("agentroll_reward needs AgentrollRollout as the rollout_func")
    return [float(r) for r in agentroll_reward]


# -- an agentroll environment under TRL's own tool loop ----------------------------------


def environment_factory(
    env: Environment, *, tasks: Iterable[Task] = (), tool_timeout: float | None = None
) -> tuple[type[Any], Callable[..., list[float]], Callable[[], None]]:
    """``(EnvClass, reward_func, close)`` for ``GRPOTrainer(environment_factory=EnvClass,
    reward_funcs=[reward_func])``: TRL's own loop calls the environment's tools.

    ``EnvClass()`` is one rollout's environment: ``reset(**row)`` starts the episode for the
    dataset row (the task of ``tasks`` its ``task_id`` names, else one built from its fields,
    ``answer`` as the answer; a sandbox when the environment has one; the previous episode's
    is closed) and returns None; each ``@tool`` of ``env``
    is a method with its signature and docstring, run in the episode's state and sandbox,
    returning the tool's text (an error is text the model sees, as in agentroll).
    ``reward_func`` scores each rollout as the rollout engine does (the rubric, else
    ``env.reward``) on its prompt and completion messages.
    ``close()`` closes every open sandbox and the adapter's loop thread (after training; the
    class has no public method but ``reset`` and the tools, since TRL shows each as a tool).
    """
    check_trl()
    loop = _LoopThread(f"agentroll-trl-{env.name}")
    timeout = tool_timeout or env.tool_timeout or 60.0
    max_chars = RolloutConfig().max_tool_output_chars
    live: list[Any] = []
    by_id = {t.id: t for t in tasks}

    class AgentrollEnv:
        __doc__ = f"agentroll environment {env.name!r} (version {env.version}) for TRL"

        def __init__(self) -> None:
            self._env = env.spawn()
            self._state: EpisodeState | None = None
            self._sandbox: Sandbox | None = None
            self._task: Task | None = None
            live.append(self)

        def reset(self, **row: Any) -> None:
            loop.run(self._reset(row), timeout=timeout)

        async def _reset(self, row: dict[str, Any]) -> None:
            await self._close()
            task = by_id.get(str(row.get("task_id")))
            if task is None:
                data = {k: v for k, v in row.items() if k not in ("task_id", "answer")}
                task = Task(id=str(row.get("task_id") or new_id()), data=data)
                task.answer = row.get("answer")
            self._task = task
            self._env = env.spawn()
            if env.sandbox_config is not None:
                sandbox = open_sandbox(env.sandbox_config, episode_id=self._task.id)
                await sandbox.start()
                self._sandbox = sandbox
            self._state = EpisodeState(self._task, seed=0, episode_id=new_id())
            self._state.sandbox = self._sandbox
            self._state.messages = await self._env.reset(self._task, seed=0)

        async def _close(self) -> None:
            sandbox, self._sandbox = self._sandbox, None
            if sandbox is not None:
                await close_shielded(sandbox)

        def _call(self, name: str, arguments: dict[str, Any]) -> str:
            if self._state is None:
                raise RuntimeError("call reset() before a tool")
            call = ToolCall(id=new_id(), name=name, arguments=arguments)
            result = loop.run(
                call_tool(env.tools, self._env, call, self._state, (timeout, max_chars)),
                timeout=timeout + 5,
            )
            return result.content

        async def _score(self, messages: list[Message]) -> float:
            if self._state is None or self._task is None:
                return 0.0
            traj = Trajectory(id=new_id(), task_id=self._task.id, group_id="", messages=messages)
            if self._env.rubric is not None:
                scores = await self._env.rubric.score(self._env, traj, self._state, None)
                return float(self._env.rubric.combine(scores))
            value = await call_hook(self._env.reward, traj, self._state)
            if isinstance(value, dict):
                return float(sum(value.values()))
            return float(value)

    for tool_name, t in env.tools.items():
        setattr(AgentrollEnv, tool_name, _tool_method(tool_name, t))

    def close() -> None:
        for e in live:
            with contextlib.suppress(Exception):
                loop.run(e._close(), timeout=60)
        live.clear()
        loop.close()

    AgentrollEnv.__name__ = AgentrollEnv.__qualname__ = _class_name(env.name)

    def reward_func(
        prompts: list[Any], completions: list[Any], environments: list[Any], **_: Any
    ) -> list[float]:
        """The environment's reward of each rollout (prompt + completion messages)."""
        out = []
        for prompt, completion, e in zip(prompts, completions, environments, strict=True):
            messages = [
                msgspec.convert(_message_fields(m), Message)
                for m in [*_as_prompt(prompt), *_as_prompt(completion)]
            ]
            out.append(loop.run(e._score(messages), timeout=timeout))
        return out

    reward_func.__name__ = f"{env.name}_reward"
    return AgentrollEnv, reward_func, close


def _message_fields(m: Mapping[str, Any]) -> dict[str, Any]:
    """A TRL/transformers message as agentroll Message fields (content as text)."""
    content = m.get("content")
    if isinstance(content, list):  # typed content blocks: keep the text ones
        content = "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return {"role": m.get("role", "assistant"), "content": content or ""}


def _class_name(name: str) -> str:
    return "".join(p.capitalize() for p in name.split("_")) + "Env"


def _tool_method(name: str, t: Any) -> Callable[..., str]:
    """A method that runs agentroll tool ``t``, with the tool's visible signature and a
    Google-style docstring (TRL builds the model's tool schema from them)."""
    spec = t.spec
    params = spec.parameters.get("properties", {}) if isinstance(spec.parameters, dict) else {}
    required = (
        set(spec.parameters.get("required", ())) if isinstance(spec.parameters, dict) else set()
    )
    py_types = {
        "integer": int,
        "number": float,
        "string": str,
        "boolean": bool,
        "array": list,
        "object": dict,
    }
    sig_params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {"return": str}
    for pname, schema in params.items():
        annotation = py_types.get(schema.get("type", "string"), str)
        default = inspect.Parameter.empty if pname in required else schema.get("default")
        sig_params.append(
            inspect.Parameter(
                pname, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
            )
        )
        annotations[pname] = annotation

    def method(self: Any, **arguments: Any) -> str:
        result: str = self._call(name, arguments)
        return result

    lines = [spec.description or name, "", "Args:"]
    lines += [f"    {p}: {s.get('description', p)}" for p, s in params.items()]
    lines += ["", "Returns:", "    The tool's result."]
    method.__name__ = method.__qualname__ = name
    method.__doc__ = "\n".join(lines) if params else "\n".join([lines[0], "", *lines[-3:]])
    method.__signature__ = inspect.Signature(sig_params, return_annotation=str)  # type: ignore[attr-defined]
    method.__annotations__ = annotations
    return method
