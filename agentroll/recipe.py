"""TOML recipes and run directories: what a run is, written down so it can be repeated.

A recipe names the environment, model, backend, sampling, sandbox, sync strategy and
interval, staleness bound and trainer settings.  Invariants: a recipe is validated as a
whole by msgspec before anything starts, and every error names the offending field
(``sync.strategy: ...``); unknown fields are refused (a typo is never silently ignored);
``resolved()`` is self-contained (relative paths made absolute, defaults filled in), so the
copy written into a run directory repeats the run.
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
from typing import Any, Literal

import msgspec

from agentroll.errors import ConfigError

Strategy = Literal["pause", "rolling", "drain", "background"]
ResumeName = Literal["keep", "recompute", "restart"]


class RunSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    name: str = "run"
    seed: int = 0
    out_dir: str = "runs"  # the run directory is <out_dir>/<name>-<timestamp>
    steps: int = 20  # trainer steps of the RL phase
    timeout: float = 1800.0  # seconds the whole run may take


class ModelSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    path: str = ""  # a Hugging Face style checkpoint directory; empty: create the tiny model
    layers: int = 2  # only for the tiny model
    hidden: int = 128


class EnvironmentSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    name: str = "calculator"
    kwargs: dict[str, Any] = {}
    num_tasks: int | None = None  # cap on the task list (cycled through in epochs)


class WarmupSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """Supervised warm-up on demonstrations before RL (0 steps: none)."""

    steps: int = 0
    expert: str = ""  # "module:function" taking a GenerationRequest, returning the reply text
    tasks: int = 256  # demonstration episodes
    batch_size: int = 16
    lr: float = 3e-3


class BackendSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    # torch: the built-in engine; vllm: vLLM in each replica's process; http: one running
    # vLLM OpenAI server per replica at ``urls`` (started on the recipe's model)
    kind: Literal["torch", "mock", "vllm", "http"] = "torch"
    replicas: int = 1
    urls: list[str] = []
    dtype: str = "float32"
    kv_cache_mb: int = 128
    max_num_seqs: int = 64
    prefill_budget: int = 1024  # tokens of prefill per engine step (bounds pause latency)
    # vllm: how updates reach the engine (reload: a verified checkpoint; nccl / sparse_nccl:
    # vLLM's NCCL transfer from transfer_devices[i], a CUDA device per replica, not vLLM's)
    weight_transfer: Literal["reload", "nccl", "sparse_nccl"] = "reload"
    transfer_devices: list[str] = []
    # vllm / http: after an update, compare vLLM's digests of what it serves (None: for
    # checkpoints under 4 GiB) and rescore this many fixed tokens (0: no probe)
    verify_served: bool | None = None
    probe_tokens: int = 32

    def __post_init__(self) -> None:
        if self.weight_transfer != "reload" and (
            self.kind != "vllm" or len(self.transfer_devices) != self.replicas
        ):
            raise ValueError(
                f"weight_transfer={self.weight_transfer!r} needs kind='vllm' and one of "
                f"transfer_devices per replica ({self.replicas}), e.g. ['cuda:1']"
            )


class SamplingSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128


class RolloutSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    concurrency: int = 32
    samples_per_task: int = 4
    tool_timeout: float = 30.0
    episode_timeout: float = 600.0


class SandboxSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    backend: Literal["local", "docker"] = "local"
    timeout: float | None = None  # None: the environment's own
    image: str | None = None  # docker: default agentroll/base:host (host runtime mounted)
    memory_mb: int | None = None  # None: the environment's own
    options: dict[str, Any] = {}  # docker only: DockerOptions fields (docker_host, cpus, ...)

    def __post_init__(self) -> None:
        if self.memory_mb is not None and self.memory_mb < 16:
            raise ValueError("sandbox.memory_mb must be >= 16")
        if self.options and self.backend != "docker":
            raise ValueError("sandbox.options apply to backend = 'docker' only")
        if self.options:
            from agentroll.sandbox.docker import DockerOptions

            try:
                msgspec.convert(self.options, DockerOptions)
            except msgspec.ValidationError as exc:
                raise ValueError(f"sandbox.options: {exc}".replace("`$.", "`")) from None


class SyncSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    strategy: Strategy = "rolling"
    policy: ResumeName = "keep"
    interval: int = 1  # trainer steps between weight syncs
    encoding: Literal["delta", "full"] = "delta"


class BufferSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    max_staleness: int | None = 1  # None (written "none" in TOML): no bound, fully async
    on_stale: Literal["drop", "keep"] = "drop"
    capacity: int = 1024
    lease_ttl: float = 120.0


class StreamSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    token_env: str = "AGENTROLL_STREAM_TOKEN"  # the bearer token is read from this variable
    spool_dir: str = ""  # empty: <run dir>/spool


class TrainerSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    batch_size: int = 32  # trajectories per step (a multiple of rollout.samples_per_task)
    lr: float = 1e-4
    clip_eps: float = 0.2
    is_cap: float = 5.0
    kv_lag: Literal["weight", "cap", "mask"] = "weight"
    kv_lag_weight: float = 0.5
    max_grad_norm: float = 1.0
    entropy_coef: float = 0.0  # entropy bonus (keeps a small policy from collapsing)
    threads: int | None = None  # torch intra-op threads of the trainer (None: torch's default)


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

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str]] = [
            (self.run.steps >= 1, "run.steps must be >= 1"),
            (self.run.timeout > 0, "run.timeout must be > 0 seconds"),
            (self.backend.replicas >= 1, "backend.replicas must be >= 1"),
            (
                self.backend.kind != "http" or len(self.backend.urls) == self.backend.replicas,
                "backend.urls must name one server per replica when backend.kind = 'http'",
            ),
            (self.rollout.samples_per_task >= 1, "rollout.samples_per_task must be >= 1"),
            (self.rollout.concurrency >= 1, "rollout.concurrency must be >= 1"),
            (self.sampling.temperature > 0, "sampling.temperature must be > 0"),
            (0 < self.sampling.top_p <= 1, "sampling.top_p must be in (0, 1]"),
            (self.sampling.max_tokens >= 1, "sampling.max_tokens must be >= 1"),
            (self.sync.interval >= 1, "sync.interval must be >= 1 trainer step"),
            (
                self.buffer.max_staleness is None or self.buffer.max_staleness >= 0,
                "buffer.max_staleness must be >= 0 (or absent for no bound)",
            ),
            (self.buffer.capacity >= 1, "buffer.capacity must be >= 1"),
            (
                self.trainer.batch_size >= 1
                and self.rollout.samples_per_task >= 1  # (the list is built before checking)
                and self.trainer.batch_size % self.rollout.samples_per_task == 0,
                "trainer.batch_size must be a positive multiple of rollout.samples_per_task "
                f"({self.rollout.samples_per_task}), so whole groups make a batch",
            ),
            (self.trainer.lr > 0, "trainer.lr must be > 0"),
            (self.warmup.steps >= 0, "warmup.steps must be >= 0"),
            (
                self.warmup.steps == 0 or ":" in self.warmup.expert,
                "warmup.expert must name the demonstration policy as 'module:function' "
                "when warmup.steps > 0",
            ),
            (
                self.buffer.capacity >= self.trainer.batch_size,
                "buffer.capacity must hold at least one batch (trainer.batch_size)",
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
        # msgspec says "... - at `$.sync.strategy`"; turn the path into the TOML field name
        message = str(exc).replace("`$.", "`").replace("$.", "")
        raise ConfigError(f"{source}: {message}") from exc
    except ValueError as exc:  # __post_init__ checks
        raise ConfigError(f"{source}: {exc}") from exc


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
