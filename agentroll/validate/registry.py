"""Every optimisation a recipe can turn on, with the risk it carries and the check it needs.

Risk classes: ``unit`` (bit-exact by construction, unit-tested), ``token_parity`` (must
not change a token or logprob when the weights are unchanged), ``distribution`` (changes
samples, must not change their distribution beyond a tolerance), ``end_to_end`` (only
learning can judge it).  Invariant: every recipe field is either owned by an entry here or
listed in ``NOT_OPTIMISATIONS`` with the reason, so nothing new ships unclassified (a test
enforces it).  Pure data and predicates: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from agentroll.errors import ConfigError

if TYPE_CHECKING:
    from agentroll.run.recipe import Recipe

RiskClass = Literal["unit", "token_parity", "distribution", "end_to_end"]
RISK_CLASSES: tuple[RiskClass, ...] = ("unit", "token_parity", "distribution", "end_to_end")


@dataclass(frozen=True)
class Optimisation:
    """``name``; ``risk``; ``fields``: the recipe fields (``section.field``) that select or
    tune it; ``enabled(recipe)``: whether the recipe turns it on; ``check``: the name of the
    check its class requires (``agentroll.validate.recipe`` runs it); ``what``: one line."""

    name: str
    risk: RiskClass
    fields: tuple[str, ...]
    enabled: Callable[[Recipe], bool]
    check: str
    what: str


def _torch(r: Recipe) -> bool:
    return r.backend.kind == "torch"


OPTIMISATIONS: tuple[Optimisation, ...] = (
    Optimisation(
        "delta_sync",
        "unit",
        ("sync.encoding",),
        lambda r: r.sync.encoding == "delta",
        "unit:delta_roundtrip",
        "weight updates carry only the changed values, checksummed, applied bit-exact",
    ),
    Optimisation(
        "checksummed_apply",
        "unit",
        ("backend.verify_served", "backend.probe_tokens"),
        lambda r: True,
        "unit:delta_roundtrip",
        "every update is verified by checksum and digest before it serves",
    ),
    Optimisation(
        "layout_conversion",
        "unit",
        ("placement.sleep_level",),
        lambda r: r.placement.mode == "colocated" and r.placement.sleep_level == 2,
        "unit:layout_roundtrip",
        "trainer weights converted to the serving layout at each colocated switch",
    ),
    Optimisation(
        "prefix_caching",
        "token_parity",
        ("backend.kv_cache_mb",),
        _torch,
        "token_parity:prefix_cache",
        "a turn reuses the KV of the episode's earlier turns",
    ),
    Optimisation(
        "chunked_prefill",
        "token_parity",
        ("backend.prefill_budget", "backend.max_num_seqs"),
        _torch,
        "token_parity:chunked_prefill",
        "long prompts prefill in chunks batched with decode steps",
    ),
    Optimisation(
        "group_prefill_sharing",
        "token_parity",
        ("backend.share_group_prefill",),
        lambda r: _torch(r) and r.backend.share_group_prefill and r.rollout.samples_per_task > 1,
        "token_parity:group_prefill",
        "the samples of a group that meet in one prefill fork its KV and logits",
    ),
    Optimisation(
        "cpu_kernels",
        "token_parity",
        ("backend.kind",),
        _torch,
        "token_parity:reference",
        "the built-in engine's C++ CPU kernels instead of torch ops",
    ),
    Optimisation(
        "pause_keep",
        "token_parity",
        ("sync.policy", "sync.max_kv_lag", "sync.after"),
        lambda r: r.sync.policy in ("keep", "staleness"),
        "token_parity:pause_resume",
        "a generation paused for a sync continues from its KV",
    ),
    Optimisation(
        "migration",
        "token_parity",
        ("backend.replicas",),
        lambda r: r.backend.replicas > 1,
        "token_parity:migrate",
        "calls move between replicas with their KV",
    ),
    Optimisation(
        "episode_checkpoint",
        "token_parity",
        ("stream.spool_dir",),
        lambda r: r.placement.mode == "separate" and not r.placement.autoscale,
        "token_parity:checkpoint",
        "episodes in flight are checkpointed at a stop and resume in another process",
    ),
    Optimisation(
        "sandbox_prewarm",
        "token_parity",
        ("rollout.prewarm_sandboxes", "rollout.prewarm_groups"),
        lambda r: r.rollout.prewarm_sandboxes,
        "token_parity:prewarm",
        "the next groups' sandboxes start ahead of their episodes",
    ),
    Optimisation(
        "keep_kv_under_new_weights",
        "distribution",
        ("sync.policy",),
        lambda r: r.sync.policy in ("keep", "staleness"),
        "distribution:resume_policy",
        "a resumed generation attends to KV computed by the previous weights",
    ),
    Optimisation(
        "bounded_staleness",
        "distribution",
        ("buffer.max_staleness", "buffer.on_stale", "sync.interval"),
        lambda r: r.buffer.max_staleness != 0 or r.sync.interval > 1,
        "distribution:staleness",
        "the trainer learns from trajectories sampled by older weights",
    ),
    Optimisation(
        "admission_control",
        "distribution",
        ("buffer.capacity", "rollout.concurrency"),
        lambda r: True,
        "distribution:admission",
        "episodes start only while the buffer has room",
    ),
    Optimisation(
        "rolling_updates",
        "distribution",
        ("sync.strategy",),
        lambda r: r.sync.strategy in ("rolling", "background") and r.backend.replicas > 1,
        "distribution:rolling",
        "replicas update in turn: episodes run on mixed versions",
    ),
    Optimisation(
        "bf16_serving",
        "distribution",
        ("backend.dtype",),
        lambda r: r.backend.dtype in ("bfloat16", "float16"),
        "distribution:dtype",
        "the engine serves in 16 bits while the trainer holds fp32",
    ),
    Optimisation(
        "tool_cache",
        "distribution",
        ("rollout.tool_cache", "rollout.tool_cache_verify"),
        lambda r: r.rollout.tool_cache,
        "distribution:tool_cache",
        "a pure tool's call with the same arguments and files returns the cached result",
    ),
    Optimisation(
        "early_group_cutoff",
        "distribution",
        ("rollout.group_cutoff",),
        lambda r: r.rollout.group_cutoff > 0,
        "distribution:group_cutoff",
        "a group's stragglers stop once its reward is decided, and take that reward",
    ),
    Optimisation(
        "partial_rollouts",
        "distribution",
        ("placement.partial_rollouts",),
        lambda r: r.placement.mode == "colocated" and r.placement.partial_rollouts,
        "distribution:partial_rollouts",
        "stragglers parked across a colocated switch finish under the next weights",
    ),
    Optimisation(
        "autoscale",
        "distribution",
        (
            "placement.autoscale",
            "placement.autoscale_band",
            "placement.window_steps",
            "placement.max_replicas",
            "placement.cores",
        ),
        lambda r: r.placement.autoscale,
        "distribution:autoscale",
        "replicas join and leave during the run; the trainer's threads change",
    ),
    Optimisation(
        "async_off_policy",
        "end_to_end",
        ("placement.mode", "stream.dropped_max_records", "stream.dropped_max_bytes"),
        lambda r: r.placement.mode == "separate",
        "end_to_end:async_off_policy",
        "rollout and training overlap: the trainer steps on data of earlier versions",
    ),
    Optimisation(
        "kv_lag_treatment",
        "end_to_end",
        ("trainer.kv_lag", "trainer.kv_lag_weight"),
        lambda r: r.sync.policy in ("keep", "staleness"),
        "end_to_end:kv_lag",
        "tokens sampled on lagged KV are weighted, capped or masked in the loss",
    ),
    Optimisation(
        "importance_cap",
        "end_to_end",
        ("trainer.is_cap", "trainer.clip_eps"),
        lambda r: True,
        "end_to_end:importance_cap",
        "importance weights of off-policy tokens are capped",
    ),
    Optimisation(
        "colocated",
        "end_to_end",
        ("placement.wake_timeout",),
        lambda r: r.placement.mode == "colocated",
        "end_to_end:colocated",
        "rollout and training take turns on the same cores (sleep and wake)",
    ),
)

#: recipe fields that select no optimisation, with why
NOT_OPTIMISATIONS: dict[str, str] = {
    **{f"run.{f}": "run bookkeeping" for f in ("name", "seed", "out_dir", "steps", "timeout")},
    **{f"model.{f}": "what is trained, not how" for f in ("path", "layers", "hidden")},
    **{f"environment.{f}": "the task" for f in ("name", "kwargs", "num_tasks")},
    **{
        f"warmup.{f}": "supervised warm-up before RL, on demonstrations"
        for f in ("steps", "expert", "tasks", "batch_size", "lr")
    },
    "backend.urls": "where the servers are",
    "backend.weight_transfer": "transport of updates (verified like any update)",
    "backend.transfer_devices": "transport of updates",
    **{
        f"sampling.{f}": "the policy's sampling distribution itself"
        for f in ("temperature", "top_p", "top_k", "max_tokens")
    },
    "rollout.samples_per_task": "the algorithm's group size",
    "rollout.tool_timeout": "a failure bound",
    "rollout.episode_timeout": "a failure bound",
    "rollout.tool_parser": "the model's tool-call format",
    **{
        f"sandbox.{f}": "isolation of tool code"
        for f in ("backend", "timeout", "image", "memory_mb", "options")
    },
    "buffer.lease_ttl": "delivery bookkeeping (exactly-once)",
    **{f"stream.{f}": "transport" for f in ("host", "port", "token_env")},
    "trainer.batch_size": "the algorithm's batch",
    "trainer.lr": "the algorithm's hyperparameter",
    "trainer.max_grad_norm": "the algorithm's hyperparameter",
    "trainer.entropy_coef": "the algorithm's hyperparameter",
    "trainer.algorithm": "the algorithm itself",
    "trainer.threads": "compute placement of the trainer (results do not depend on it)",
    **{
        f"gateway.{f}": "the gateway's service settings"
        for f in ("host", "port", "tool_parser", "idle_timeout", "fork_policy", "max_tokens")
    },
    "gateway.model": "a name",
}


def by_name(name: str) -> Optimisation:
    """The entry called ``name``; ``ConfigError`` naming the known ones otherwise."""
    for o in OPTIMISATIONS:
        if o.name == name:
            return o
    known = ", ".join(o.name for o in OPTIMISATIONS)
    raise ConfigError(f"unknown optimisation {name!r}; known: {known}")


def enabled(
    recipe: Recipe, *, only: str | None = None, risk: str | None = None
) -> list[Optimisation]:
    """The optimisations ``recipe`` turns on, in registry order; ``only`` (a name) and
    ``risk`` (a class) select.  Raises ``ConfigError`` for an unknown name or class, or
    an ``only`` the recipe does not turn on."""
    if risk is not None and risk not in RISK_CLASSES:
        raise ConfigError(f"unknown risk class {risk!r}; use one of {', '.join(RISK_CLASSES)}")
    chosen = [o for o in OPTIMISATIONS if o.enabled(recipe)]
    if only is not None:
        wanted = by_name(only)
        if wanted not in chosen:
            raise ConfigError(f"the recipe does not turn {only!r} on; nothing to validate")
        chosen = [wanted]
    if risk is not None:
        chosen = [o for o in chosen if o.risk == risk]
    return chosen


__all__ = [
    "NOT_OPTIMISATIONS",
    "OPTIMISATIONS",
    "RISK_CLASSES",
    "Optimisation",
    "RiskClass",
    "by_name",
    "enabled",
]
