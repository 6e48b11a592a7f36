"""TOML recipes and run directories: what a run is, written down so it can be repeated.

Invariants: a recipe is validated whole by msgspec before anything starts; every number has
a finite ``Bound``; every error names the field as written in the TOML (for a number, its
value and range); unknown fields are refused; ``resolved()`` is self-contained (absolute
paths, defaults filled in), so the copy written into a run directory repeats the run.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

import msgspec

from agentroll.errors import ConfigError
from agentroll.plugins import BACKENDS, SANDBOXES, TOOL_PARSERS, TRAINERS
from agentroll.sandbox.base import SandboxConfig
from agentroll.types import ResumePolicy, Strategy


def _num(x: float) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else repr(x)


class Bound(NamedTuple):
    """The allowed range of a numeric recipe field: finite, both ends a real run could need.
    ``none``: for a field that may be None, how to write that (and what it means)."""

    low: float
    high: float
    unit: str = ""
    low_open: bool = False  # ``low`` itself is refused (e.g. a learning rate > 0)
    high_open: bool = False
    none: str = ""

    def holds(self, value: object) -> bool:
        # a bool is an int to Python but never a number here; NaN fails both comparisons
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.low_open or self.high_open:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"{left}{_num(self.low)}, {_num(self.high)}{right}"
        else:
            text = f"{_num(self.low)}..{_num(self.high)}"
        text = f"{text} {self.unit}".rstrip()
        return f"{text}, or {self.none}" if self.none else text

    def check(self, path: str, value: object) -> None:
        """Raise ValueError naming ``path``, ``value`` and the range unless it holds."""
        if value is None and self.none:
            return
        if not self.holds(value):
            raise ValueError(f"{path} = {value!r} is out of range; use {self}")


SECONDS = Bound(0.001, 86400.0, "seconds")  # one tool call, one exec, one lease


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """A recipe section; ``bounds`` holds every numeric field, checked at construction."""

    name_in_toml: ClassVar[str] = ""
    bounds: ClassVar[dict[str, Bound]] = {}

    def __post_init__(self) -> None:
        for field, bound in self.bounds.items():
            bound.check(f"{self.name_in_toml}.{field}", getattr(self, field))


class RunSection(_Section, frozen=True):
    name_in_toml = "run"
    bounds = {
        "seed": Bound(0, 2**63 - 1),
        "steps": Bound(1, 10_000_000, "trainer steps"),
        "timeout": Bound(1.0, 31_536_000.0, "seconds"),  # up to a year
    }

    name: str = "run"
    seed: int = 0
    out_dir: str = "runs"  # the run directory is <out_dir>/<name>-<timestamp>
    steps: int = 20  # trainer steps of the RL phase
    timeout: float = 1800.0  # seconds the whole run may take


class ModelSection(_Section, frozen=True):
    name_in_toml = "model"
    bounds = {"layers": Bound(1, 256), "hidden": Bound(64, 16384)}

    path: str = ""  # a Hugging Face style checkpoint directory; empty: create the tiny model
    layers: int = 2  # only for the tiny model
    hidden: int = 128  # heads of 64 dimensions each

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden % 64:
            raise ValueError(
                f"model.hidden = {self.hidden} is not a multiple of 64 (heads have 64 "
                f"dimensions); use {max(64, self.hidden // 64 * 64)}"
            )


class EnvironmentSection(_Section, frozen=True):
    name_in_toml = "environment"
    bounds = {"num_tasks": Bound(1, 100_000_000, "tasks", none="leave it out for every task")}

    name: str = "calculator"
    kwargs: dict[str, Any] = {}
    num_tasks: int | None = None  # cap on the task list (cycled through in epochs)


class WarmupSection(_Section, frozen=True):
    """Supervised warm-up on demonstrations before RL (0 steps: none)."""

    name_in_toml = "warmup"
    bounds = {
        "steps": Bound(0, 1_000_000, "steps"),
        "tasks": Bound(1, 1_000_000, "episodes"),
        "batch_size": Bound(1, 65536, "trajectories"),
        "lr": Bound(0.0, 1.0, low_open=True),
    }

    steps: int = 0
    expert: str = ""  # "module:function" taking a GenerationRequest, returning the reply text
    tasks: int = 256  # demonstration episodes
    batch_size: int = 16
    lr: float = 3e-3


class BackendSection(_Section, frozen=True):
    name_in_toml = "backend"
    bounds = {
        "replicas": Bound(1, 1024),
        "kv_cache_mb": Bound(1, 1 << 20, "MiB per replica"),
        "max_num_seqs": Bound(1, 65536, "sequences"),
        "prefill_budget": Bound(1, 1 << 20, "tokens"),
        "probe_tokens": Bound(0, 65536, "tokens (0: no probe)"),
    }

    # torch: the built-in engine; vllm: vLLM in each replica's process; http: one running
    # vLLM OpenAI server per replica at ``urls`` (started on the recipe's model); or a
    # backend registered in entry point group agentroll.backends
    kind: str = "torch"
    replicas: int = 1
    urls: list[str] = []
    dtype: str = "float32"
    kv_cache_mb: int = 128
    max_num_seqs: int = 64
    prefill_budget: int = 1024  # tokens of prefill per engine step (bounds pause latency)
    # torch: the samples of a group that meet in one prefill share it (one prefill per
    # group; in batch-invariant mode their tokens are those they would sample alone)
    share_group_prefill: bool = True
    # vllm: how updates reach the engine (reload: a verified checkpoint; nccl / sparse_nccl:
    # vLLM's NCCL transfer from transfer_devices[i], a CUDA device per replica, not vLLM's)
    weight_transfer: Literal["reload", "nccl", "sparse_nccl"] = "reload"
    transfer_devices: list[str] = []
    # vllm / http: after an update, compare vLLM's digests of what it serves (None: for
    # checkpoints under 4 GiB) and rescore this many fixed tokens (0: no probe)
    verify_served: bool | None = None
    probe_tokens: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        BACKENDS.check(self.kind, field="backend.kind")
        if self.weight_transfer != "reload" and (
            self.kind != "vllm" or len(self.transfer_devices) != self.replicas
        ):
            raise ValueError(
                f"weight_transfer={self.weight_transfer!r} needs kind='vllm' and one of "
                f"transfer_devices per replica ({self.replicas}), e.g. ['cuda:1']"
            )


class SamplingSection(_Section, frozen=True):
    name_in_toml = "sampling"
    bounds = {
        # > 0: the trainer's logprobs are of logits / temperature
        "temperature": Bound(0.0, 100.0, low_open=True),
        "top_p": Bound(0.0, 1.0, low_open=True),
        "top_k": Bound(0, 1 << 20, "tokens (0: off)"),
        "max_tokens": Bound(1, 1 << 20, "tokens"),
    }

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128


class RolloutSection(_Section, frozen=True):
    name_in_toml = "rollout"
    bounds = {
        "concurrency": Bound(1, 65536, "episodes"),
        "samples_per_task": Bound(1, 4096, "samples"),
        "tool_timeout": SECONDS,
        "episode_timeout": Bound(0.001, 604_800.0, "seconds"),  # up to a week
        "tool_cache_verify": Bound(0.0, 1.0, "(a probability)"),
        "group_cutoff": Bound(0.0, 1.0, "(a share; 0: off)", high_open=True),
        "prewarm_groups": Bound(1, 64, "groups"),
    }

    concurrency: int = 32
    samples_per_task: int = 4
    tool_timeout: float = 30.0
    episode_timeout: float = 600.0
    # how assistant text becomes tool calls: hermes (<tool_call>{json}</tool_call>), or a
    # parser registered in entry point group agentroll.tool_parsers
    tool_parser: str = "hermes"
    # cache the results of tools declared pure (@tool(pure=True)); a hit runs again with
    # chance tool_cache_verify, and a tool whose result differs is no longer cached
    tool_cache: bool = False
    tool_cache_verify: float = 0.05
    # early group cut-off: once this share of a group finished with one reward (none
    # failed), its stragglers stop and take that reward, untrained (0: off)
    group_cutoff: float = 0.0
    # keep the sandboxes of the next prewarm_groups groups' samples started ahead of their
    # episodes (a replacement starts as each is taken)
    prewarm_sandboxes: bool = False
    prewarm_groups: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        TOOL_PARSERS.check(self.tool_parser, field="rollout.tool_parser")


# sandbox.options: DockerOptions' numbers
_DOCKER_BOUNDS = {
    "ttl": Bound(1.0, 604_800.0, "seconds"),
    "command_uid": Bound(1, 65534, "(0 is the agent's)"),
    "pool_size": Bound(0, 1024, "containers"),
    "create_rate": Bound(0.0, 10_000.0, "per second", low_open=True),
    "create_burst": Bound(1, 10_000, "containers"),
    "max_connections": Bound(1, 1024, "connections"),
    "start_timeout": Bound(0.001, 3600.0, "seconds"),
}


class SandboxSection(_Section, frozen=True):
    name_in_toml = "sandbox"  # timeout and memory_mb: SandboxConfig's bounds

    # local: a process tree under bubblewrap; docker: a container per episode; or a
    # sandbox registered in entry point group agentroll.sandboxes
    backend: str = "local"
    timeout: float | None = None  # None: the environment's own
    image: str | None = None  # docker: default agentroll/base:host (host runtime mounted)
    memory_mb: int | None = None  # None: the environment's own
    # docker: DockerOptions fields (docker_host, ttl, ...); a plugin sandbox: its own
    options: dict[str, Any] = {}

    def __post_init__(self) -> None:
        super().__post_init__()
        SANDBOXES.check(self.backend, field="sandbox.backend")
        given: dict[str, Any] = {"timeout": self.timeout, "memory_mb": self.memory_mb}
        try:  # SandboxConfig owns a sandbox's limits: its checks, in its words
            SandboxConfig(backend=self.backend, **{k: v for k, v in given.items() if v is not None})
        except ValueError as exc:
            raise ValueError(_in_section("sandbox", str(exc))) from None
        if self.options and self.backend == "local":
            raise ValueError("sandbox.options apply to backend = 'docker' (or a plugin) only")
        if self.options and self.backend == "docker":
            from agentroll.sandbox.docker_options import DockerOptions

            try:
                opts = msgspec.convert(self.options, DockerOptions)
            except msgspec.ValidationError as exc:
                raise ValueError(_validation_message(exc, "sandbox.options")) from None
            for field, bound in _DOCKER_BOUNDS.items():
                if hasattr(opts, field):  # (a bound of a field DockerOptions dropped is moot)
                    bound.check(f"sandbox.options.{field}", getattr(opts, field))
            try:  # DockerOptions' own checks (workdir, ...), in its words
                DockerOptions.from_config(SandboxConfig(backend="docker", options=self.options))
            except ValueError as exc:
                raise ValueError(
                    _in_section("sandbox.options", str(exc).removeprefix("sandbox options: "))
                ) from None


class SyncSection(_Section, frozen=True):
    name_in_toml = "sync"
    bounds = {
        "interval": Bound(1, 1_000_000, "trainer steps"),
        "max_kv_lag": Bound(0, 1_000_000, "versions"),
    }

    strategy: Strategy = "rolling"
    # how a generation in flight resumes: keep, recompute, restart, or staleness (keep
    # while its KV is at most max_kv_lag versions behind the new weights, else after)
    policy: ResumePolicy | Literal["staleness"] = "keep"
    max_kv_lag: int = 1  # policy = "staleness": versions of KV lag that are kept
    after: ResumePolicy = "recompute"  # policy = "staleness": beyond max_kv_lag
    interval: int = 1  # trainer steps between weight syncs
    encoding: Literal["delta", "full"] = "delta"


class BufferSection(_Section, frozen=True):
    name_in_toml = "buffer"
    bounds = {
        "max_staleness": Bound(0, 1_000_000, "versions", none='"none" for no bound'),
        "capacity": Bound(1, 1 << 20, "trajectories"),
        # a lease shorter than a second expires before a trainer can ack it
        "lease_ttl": Bound(1.0, 86400.0, "seconds"),
    }

    max_staleness: int | None = 1  # None (written "none" in TOML): no bound, fully async
    on_stale: Literal["drop", "keep"] = "drop"
    capacity: int = 1024
    lease_ttl: float = 120.0


class StreamSection(_Section, frozen=True):
    name_in_toml = "stream"
    bounds = {
        "port": Bound(0, 65535, "(0: any free port)"),
        "dropped_max_records": Bound(0, 100_000_000, "records"),
        "dropped_max_bytes": Bound(0, 1 << 40, "bytes"),
    }

    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    # the bearer token every route requires: this variable, else <run dir>/stream.token,
    # else generated into that file (mode 0600)
    token_env: str = "AGENTROLL_STREAM_TOKEN"
    spool_dir: str = ""  # empty: <run dir>/spool
    # stale-dropped trajectories kept in <spool>/dropped/ at most (the oldest go first)
    dropped_max_records: int = 10_000
    dropped_max_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dropped_max_records < 0 or self.dropped_max_bytes < 0:
            raise ValueError(
                "stream.dropped_max_records and stream.dropped_max_bytes must be >= 0 "
                "(0 keeps no dropped trajectory, only counts them)"
            )
        if not self.token_env or "=" in self.token_env or "\0" in self.token_env:
            raise ValueError(
                f"stream.token_env={self.token_env!r}; name an environment variable "
                "(e.g. AGENTROLL_STREAM_TOKEN)"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"stream.port={self.port}; use 0 (any free port) to 65535")


class GatewaySection(_Section, frozen=True):
    """``agentroll gateway``: the OpenAI-compatible endpoint outside agents call."""

    name_in_toml = "gateway"
    bounds = {
        "port": Bound(0, 65535, "(0: any free port)"),
        "idle_timeout": Bound(0, 86_400, "seconds", low_open=True),
        "max_tokens": Bound(1, 1 << 20, "tokens"),
    }

    host: str = "127.0.0.1"  # another address needs the stream's token (required then)
    port: int = 0  # 0: any free port
    tool_parser: str = "hermes"  # hermes, qwen3_coder, llama3_json, mistral, deepseek_v3
    idle_timeout: float = 600.0  # seconds without a call before a session ends abandoned
    fork_policy: Literal["fork", "refuse"] = "fork"  # a call that rewrites history
    max_tokens: int = 512  # a call's limit when it names none
    model: str = "agentroll"  # the model name /v1/models lists

    def __post_init__(self) -> None:
        super().__post_init__()
        TOOL_PARSERS.check(self.tool_parser, field="gateway.tool_parser")


class PlacementSection(_Section, frozen=True):
    """Where rollout and training run: ``separate`` (a worker process generates while this
    one trains) or ``colocated`` (one process alternates: the engine sleeps at ``sleep_level``
    while the trainer steps; ``partial_rollouts`` parks the stragglers at a switch instead of
    waiting for them; ``wake_timeout``: seconds to wait for the trainer's weights before the
    engine wakes on its last good ones)."""

    name_in_toml = "placement"
    bounds = {
        "sleep_level": Bound(1, 2, "(1: KV cache, 2: KV cache and weights)"),
        "wake_timeout": Bound(0.0, 86_400.0, "seconds", low_open=True),
        "autoscale_band": Bound(0.0, 1.0, "(idle fraction)", high_open=True),
        "window_steps": Bound(1, 100_000, "steps"),
        "max_replicas": Bound(1, 1024, "replicas", none="leave it out for one per core"),
        "cores": Bound(1, 65536, "threads", none="leave it out for this machine's count"),
    }

    mode: Literal["separate", "colocated"] = "separate"
    partial_rollouts: bool = True
    sleep_level: int = 1
    wake_timeout: float = 600.0
    # separate only: rollout replicas and trainer threads in this process, moved with
    # hysteresis when |trainer idle - rollout idle| averaged over two windows of
    # window_steps steps exceeds autoscale_band; max_replicas and cores bound what it runs
    autoscale: bool = False
    autoscale_band: float = 0.15
    window_steps: int = 2
    max_replicas: int | None = None
    cores: int | None = None


class TrainerSection(_Section, frozen=True):
    name_in_toml = "trainer"
    bounds = {  # as GRPOConfig's, plus upper ends
        "batch_size": Bound(1, 65536, "trajectories"),
        "lr": Bound(0.0, 1.0, low_open=True),
        "clip_eps": Bound(0.0, 1.0, low_open=True, high_open=True),
        "is_cap": Bound(1.0, 1e6),  # on-policy tokens have weight 1
        "kv_lag_weight": Bound(0.0, 1.0, "per version of lag", low_open=True),
        "max_grad_norm": Bound(0.0, 1e6, low_open=True),
        "entropy_coef": Bound(0.0, 1.0, high_open=True),
        "threads": Bound(1, 1024, "threads", none="leave it out for torch's default"),
    }

    batch_size: int = 32  # trajectories per step (a multiple of rollout.samples_per_task)
    lr: float = 1e-4
    clip_eps: float = 0.2
    is_cap: float = 5.0
    kv_lag: Literal["weight", "cap", "mask"] = "weight"
    kv_lag_weight: float = 0.5
    max_grad_norm: float = 1.0
    entropy_coef: float = 0.0  # entropy bonus (keeps a small policy from collapsing)
    threads: int | None = None  # torch intra-op threads of the trainer (None: torch's default)
    # advantages and objective of the reference trainer: grpo, or an algorithm registered
    # in entry point group agentroll.trainers
    algorithm: str = "grpo"

    def __post_init__(self) -> None:
        super().__post_init__()
        TRAINERS.check(self.algorithm, field="trainer.algorithm")


class Recipe(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    environment: EnvironmentSection = EnvironmentSection()
    warmup: WarmupSection = WarmupSection()
    backend: BackendSection = BackendSection()
    sampling: SamplingSection = SamplingSection()
    rollout: RolloutSection = RolloutSection()
    sandbox: SandboxSection = SandboxSection()
    sync: SyncSection = SyncSection()
    buffer: BufferSection = BufferSection()
    stream: StreamSection = StreamSection()
    trainer: TrainerSection = TrainerSection()
    gateway: GatewaySection = GatewaySection()
    placement: PlacementSection = PlacementSection()

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str]] = [
            (
                self.backend.kind != "http" or len(self.backend.urls) == self.backend.replicas,
                "backend.urls must name one server per replica when backend.kind = 'http'",
            ),
            (
                self.trainer.batch_size % self.rollout.samples_per_task == 0,
                "trainer.batch_size must be a positive multiple of rollout.samples_per_task "
                f"({self.rollout.samples_per_task}), so whole groups make a batch",
            ),
            (
                self.warmup.steps == 0 or ":" in self.warmup.expert,
                "warmup.expert must name the demonstration policy as 'module:function' "
                "when warmup.steps > 0",
            ),
            (
                self.buffer.capacity >= self.trainer.batch_size,
                "buffer.capacity must hold at least one batch (trainer.batch_size)",
            ),
            (
                not self.placement.autoscale or self.placement.mode == "separate",
                "placement.autoscale moves capacity between a rollout and a trainer that run "
                "at once: use it with placement.mode = 'separate'",
            ),
            (
                not self.placement.autoscale or self.backend.kind == "torch",
                "placement.autoscale starts and stops built-in engines in this process: "
                "use it with backend.kind = 'torch'",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def resolved(self, base: Path) -> Recipe:
        """This recipe with relative paths resolved against ``base`` (the recipe's folder)."""

        def absolute(p: str) -> str:
            return str((base / p).resolve()) if p and not Path(p).is_absolute() else p

        kwargs = dict(self.environment.kwargs)
        for key in ("traces",):
            if isinstance(kwargs.get(key), str):
                kwargs[key] = absolute(kwargs[key])
        return msgspec.structs.replace(
            self,
            run=msgspec.structs.replace(self.run, out_dir=absolute(self.run.out_dir)),
            model=msgspec.structs.replace(self.model, path=absolute(self.model.path)),
            environment=msgspec.structs.replace(self.environment, kwargs=kwargs),
            stream=msgspec.structs.replace(self.stream, spool_dir=absolute(self.stream.spool_dir)),
        )


def parse_recipe(text: str | bytes, *, source: str = "recipe") -> Recipe:
    """Validate TOML ``text`` as a Recipe; ConfigError names the file and the field."""
    try:
        raw = tomllib.loads(text.decode() if isinstance(text, bytes) else text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    buffer = raw.get("buffer")
    if isinstance(buffer, dict) and buffer.get("max_staleness") == "none":
        buffer["max_staleness"] = None  # TOML has no null
    try:
        return msgspec.convert(raw, Recipe)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_validation_message(exc)}") from exc
    except ValueError as exc:  # __post_init__ checks of the whole recipe
        raise ConfigError(f"{source}: {exc}") from exc


def _validation_message(exc: msgspec.ValidationError, prefix: str = "") -> str:
    """msgspec's "... - at `$.sync.strategy`" led by the TOML field name instead."""
    message, _, at = str(exc).rpartition(" - at `$")
    if not message:
        return f"{prefix}: {exc}" if prefix else str(exc)
    path = f"{prefix}{at.rstrip('`')}".strip(".")
    return _in_section(path, message) if path else message


def _in_section(path: str, message: str) -> str:
    """``message`` led by the dotted field ``path`` unless it already names a field in it."""
    if message.startswith((f"{path}.", f"{path} ", f"{path}:", f"{path}=")):
        return message
    return f"{path}: {message}"


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate the recipe at ``path``, relative paths resolved against its folder."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read recipe {p}: {exc.strerror or exc}") from exc
    return parse_recipe(text, source=str(p)).resolved(p.resolve().parent)


def dump_recipe(recipe: Recipe) -> str:
    """The recipe as TOML (every field, defaults included)."""
    lines: list[str] = []
    for section, values in msgspec.to_builtins(recipe).items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None and (section, key) == ("buffer", "max_staleness"):
                value = "none"  # no bound; the default is 1
            if value is None:
                continue  # TOML has no null: an absent key means the default None
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise ConfigError(f"cannot write {value!r} into a TOML recipe")


def package_versions() -> dict[str, str]:
    """Versions of the packages a run's results depend on."""
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in ("agentroll", "torch", "numpy", "msgspec", "tokenizers", "httpx", "vllm"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def create_run_dir(recipe: Recipe, *, run_dir: str | Path | None = None) -> Path:
    """Make the run directory and write ``recipe.toml`` (resolved), ``versions.json`` and
    ``seeds.json`` into it.  Refuses a directory that already holds a run."""
    if run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path(recipe.run.out_dir) / f"{recipe.run.name}-{stamp}-{os.getpid()}"
    out = Path(run_dir)
    if (out / "recipe.toml").exists():
        raise ConfigError(f"{out} already holds a run; pick another run directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.toml").write_text(dump_recipe(recipe))
    (out / "versions.json").write_text(json.dumps(package_versions(), indent=2) + "\n")
    seeds = {"run": recipe.run.seed, "model": recipe.run.seed, "rollout": recipe.run.seed}
    (out / "seeds.json").write_text(json.dumps(seeds, indent=2) + "\n")
    return out
