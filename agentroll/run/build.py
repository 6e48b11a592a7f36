"""What a recipe builds: its environment, its backend (a fleet of replicas), its rollout config.

Invariant: pure construction from the recipe; nothing here starts a process or an engine.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from agentroll.backends.base import Backend, SamplingParams
from agentroll.env import Environment, load_environment
from agentroll.errors import ConfigError
from agentroll.plugins import BACKENDS
from agentroll.rollout.engine import RolloutConfig
from agentroll.rollout.pause import PolicyFn, staleness_policy
from agentroll.run.recipe import Recipe, SyncSection
from agentroll.sandbox.base import SandboxConfig
from agentroll.types import ResumePolicy, Task
from agentroll.weights.apply import WeightLayout


def build_environment(recipe: Recipe, **overrides: Any) -> Environment:
    """The recipe's environment (its ``kwargs`` updated by ``overrides``), with the recipe's
    sandbox settings applied."""
    kwargs = {**recipe.environment.kwargs, **overrides}
    env = load_environment(recipe.environment.name, **kwargs)
    sb = recipe.sandbox
    try:  # the recipe's values with the environment's own: SandboxConfig checks them together
        if env.sandbox_config is not None:
            changes: dict[str, Any] = {"backend": sb.backend}
            if sb.timeout is not None:
                changes["timeout"] = sb.timeout
            if sb.image is not None:
                changes["image"] = sb.image
            if sb.memory_mb is not None:
                changes["memory_mb"] = sb.memory_mb
            if sb.options:
                changes["options"] = dict(sb.options)
            config: SandboxConfig | None = msgspec.structs.replace(env.sandbox_config, **changes)
        elif sb.backend != "local" or sb.image is not None:
            config = SandboxConfig(
                backend=sb.backend,
                image=sb.image,
                memory_mb=sb.memory_mb or SandboxConfig().memory_mb,
                options=dict(sb.options),
            )
        else:
            return env
    except ValueError as exc:
        raise ConfigError(
            f"[sandbox] with environment {recipe.environment.name!r}'s own limits: {exc}"
        ) from exc
    # a per-instance override of the class-level default
    object.__setattr__(env, "sandbox_config", config)
    return env


def local_weight_layout(backend: Backend) -> WeightLayout | None:
    """The layout of the weights of a built-in engine in this process behind ``backend``
    (a fleet's replicas share one), or None when none is (vLLM, remote replicas)."""
    from agentroll.backends.torch import TorchBackend
    from agentroll.fleet.backend import FleetBackend
    from agentroll.fleet.replica import LocalReplica

    engines = [backend]
    if isinstance(backend, FleetBackend):
        engines = [r.backend for r in backend.replicas.values() if isinstance(r, LocalReplica)]
    for engine in engines:
        if isinstance(engine, TorchBackend) and engine.engine is not None:
            return engine.engine.weight_store().layout()
    return None


def torch_engine(recipe: Recipe, model_dir: str | Path) -> Backend:
    """One built-in engine with the recipe's ``[backend]`` settings (not started)."""
    from agentroll.backends.torch import TorchBackend

    b = recipe.backend
    return TorchBackend(
        str(model_dir),
        dtype=b.dtype,
        kv_cache_mb=b.kv_cache_mb,
        max_num_seqs=b.max_num_seqs,
        max_num_batched_tokens=b.prefill_budget,
        share_group_prefill=b.share_group_prefill,
    )


def build_backend(recipe: Recipe, model_dir: str | Path) -> Backend:
    """A ``FleetBackend`` of ``backend.replicas`` engines of ``backend.kind`` on
    ``model_dir`` (built-in engines, vLLM in-process, vLLM servers at ``backend.urls``, or
    a plugin's ``factory(recipe, model_dir, index)`` per replica: see ``agentroll.plugins``)."""
    from agentroll.fleet.backend import FleetBackend
    from agentroll.fleet.replica import LocalReplica

    b = recipe.backend
    engines: list[Backend]
    if b.kind == "torch":
        engines = [torch_engine(recipe, model_dir) for _ in range(b.replicas)]
    elif b.kind == "vllm":
        from agentroll.backends.vllm import VLLMBackend

        engines = [
            VLLMBackend(
                model_dir,
                dtype=b.dtype,
                max_num_seqs=b.max_num_seqs,
                kv_cache_gib=max(1.0, b.kv_cache_mb / 1024),
                seed=recipe.run.seed + i,
                transfer=b.weight_transfer,
                transfer_device=b.transfer_devices[i] if b.transfer_devices else "cuda:1",
                verify_served=b.verify_served,
                probe_tokens=b.probe_tokens,
            )
            for i in range(b.replicas)
        ]
    elif b.kind == "http":
        from agentroll.backends.vllm_server import VLLMServerBackend

        engines = [
            VLLMServerBackend(
                url,
                model_dir=model_dir,
                dtype=b.dtype,
                verify_served=b.verify_served,
                probe_tokens=b.probe_tokens,
            )
            for url in b.urls
        ]
    elif b.kind == "mock":
        raise ConfigError(
            f"backend.kind {b.kind!r} cannot serve a recipe worker; use torch, vllm or http"
        )
    else:
        factory = BACKENDS.load(b.kind, field="backend.kind")
        engines = [factory(recipe, model_dir, i) for i in range(b.replicas)]
        for engine in engines:
            if not isinstance(engine, Backend):
                raise ConfigError(
                    f"backend.kind {b.kind!r} made a {type(engine).__name__}, not a Backend; "
                    "its entry point must name a factory(recipe, model_dir, index) -> Backend"
                )
    replicas = [LocalReplica(e, name=f"replica-{i}") for i, e in enumerate(engines)]
    return FleetBackend(replicas, strategy=recipe.sync.strategy, capacity=b.max_num_seqs)


def rollout_config(recipe: Recipe, *, seed: int | None = None) -> RolloutConfig:
    s, r = recipe.sampling, recipe.rollout
    return RolloutConfig(
        concurrency=r.concurrency,
        samples_per_task=r.samples_per_task,
        sampling=SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens
        ),
        seed=recipe.run.seed if seed is None else seed,
        tool_timeout=r.tool_timeout,
        episode_timeout=r.episode_timeout,
        tool_parser=r.tool_parser,
        tool_cache=r.tool_cache,
        tool_cache_verify=r.tool_cache_verify,
        group_cutoff=r.group_cutoff,
        prewarm_sandboxes=r.prewarm_sandboxes,
        prewarm_groups=r.prewarm_groups,
        progress="off",
    )


def cycle_tasks(tasks: list[Task], seed: int) -> Iterator[Task]:
    """The tasks again and again, each epoch in its own seeded order."""
    if not tasks:
        raise ConfigError("the environment has no tasks")
    epoch = 0
    while True:
        order = list(tasks)
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        yield from order
        epoch += 1


def resume_policy(sync: SyncSection) -> ResumePolicy | PolicyFn:
    """The recipe's resume policy: a literal, or the staleness rule with its budget."""
    if sync.policy == "staleness":
        return staleness_policy(sync.max_kv_lag, after=sync.after)
    return sync.policy
