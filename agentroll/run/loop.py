"""``agentroll run RECIPE``: the whole loop in one command, with a run directory to show for it.

Role: make the model, warm it up when asked, start a recipe worker process and train on its
stream with the reference trainer, pushing weights every ``sync.interval`` steps; then stop
the worker, count what was lost and write the report.  Invariants: the trainer sees data only
through ``StreamClient``; a batch is acked after its step; the worker never outlives the run.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from agentroll.errors import ConfigError
from agentroll.progress import Progress, ProgressMode
from agentroll.run.metrics import MetricsWriter
from agentroll.run.recipe import Recipe, create_run_dir
from agentroll.run.replay import TrainedLog
from agentroll.types import Trajectory

if TYPE_CHECKING:
    from agentroll.trainer.algorithm import Algorithm
    from agentroll.trainer.grpo import GRPOTrainer

logger = logging.getLogger("agentroll.run.loop")


def prepare_model(recipe: Recipe, run_dir: Path) -> Path:
    """The recipe's checkpoint directory, or the tiny model created in the run directory."""
    if recipe.model.path:
        return Path(recipe.model.path)
    from agentroll.model.tiny import create_tiny

    return create_tiny(
        run_dir / "model-base",
        seed=recipe.run.seed,
        layers=recipe.model.layers,
        hidden=recipe.model.hidden,
    )


def load_expert(spec: str) -> Callable[[str, int], str]:
    """``module:function`` -> the function (its reply to a rendered prompt and turn index)."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"warmup.expert {spec!r} cannot be imported: {exc}") from exc
    if not callable(fn):
        raise ConfigError(f"warmup.expert {spec!r} is not a function")
    return fn


async def demonstrations(recipe: Recipe, model_dir: Path) -> list[Trajectory]:
    """Episodes of the expert policy on the recipe's environment (tasks of another seed than
    the RL run's, so the warm-up does not rehearse the RL tasks)."""
    from agentroll.backends.base import GenerationRequest
    from agentroll.backends.mock import MockBackend
    from agentroll.chat import ChatTokenizer
    from agentroll.rollout.engine import RolloutConfig, RolloutEngine
    from agentroll.run.build import build_environment

    expert = load_expert(recipe.warmup.expert)
    tok = ChatTokenizer.from_pretrained(model_dir)
    seed = int(recipe.environment.kwargs.get("seed", 0)) + 7919
    env = build_environment(recipe, seed=seed, num_tasks=recipe.warmup.tasks)

    def script(request: GenerationRequest) -> str:
        text = tok.decode(request.prompt_ids, skip_special_tokens=False)
        return expert(text, request.turn_index)

    backend = MockBackend(script, tokenizer=tok)
    config = RolloutConfig(concurrency=16, progress="auto", seed=recipe.run.seed)
    async with RolloutEngine(backend, env, config, tokenizer=tok) as engine:
        demos = [t async for t in engine.run()]
    # completion order depends on timing: sort, so the warm-up sees the same batches each run
    good = sorted(
        (t for t in demos if t.status == "ok" and t.reward > 0),
        key=lambda t: (t.task_id, t.sample_index),
    )
    if not good:
        raise ConfigError(
            f"warmup.expert {recipe.warmup.expert!r} solved none of {len(demos)} tasks; "
            "check that it fits the environment"
        )
    return good


def warmup(recipe: Recipe, model_dir: Path, run_dir: Path, demos: list[Trajectory]) -> Path:
    """Supervised steps on ``demos``; returns the warmed checkpoint directory."""
    from agentroll.trainer.batch import collate
    from agentroll.trainer.grpo import GRPOConfig, GRPOTrainer

    w = recipe.warmup
    trainer = GRPOTrainer(model_dir, GRPOConfig(lr=w.lr, seed=recipe.run.seed))
    rng = random.Random(recipe.run.seed)
    progress = Progress("warm-up steps", w.steps)
    metrics = MetricsWriter(run_dir, "warmup")
    try:
        for step in range(w.steps):
            batch = collate(rng.sample(demos, min(w.batch_size, len(demos))))
            stats = trainer.sft_step(batch)
            metrics.event("warmup", step=step, loss=stats.loss, seconds=stats.seconds)
            progress.advance()
    finally:
        progress.close()
        metrics.close()
    out = trainer.save_pretrained(run_dir / "model")
    return Path(out)


def worker_command(recipe: Path, model_dir: Path, run_dir: Path, ready_file: Path) -> list[str]:
    """The command line of a recipe worker process (``agentroll worker --recipe``) that writes
    ``ready_file`` once it serves."""
    return [
        sys.executable,
        "-m",
        "agentroll.cli",
        "worker",
        "--recipe",
        str(recipe),
        "--model",
        str(model_dir),
        "--run-dir",
        str(run_dir),
        "--ready-file",
        str(ready_file),
    ]


class WorkerProcess:
    """``agentroll worker --recipe`` as a child process; ``url`` once it serves."""

    def __init__(
        self,
        recipe_path: Path,
        model_dir: Path,
        run_dir: Path,
        token: str,
        token_env: str = "AGENTROLL_STREAM_TOKEN",
    ) -> None:
        self.ready_file = run_dir / "worker.json"
        self.log_path = run_dir / "worker.log"
        self.ready_file.unlink(missing_ok=True)
        env = dict(os.environ)
        env[token_env] = token  # the variable the recipe's worker reads (stream.token_env)
        cmd = worker_command(recipe_path, model_dir, run_dir, self.ready_file)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    async def wait_ready(self, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the rollout worker exited with {self.proc.returncode} before serving; "
                    f"its log ({self.log_path}) ends with:\n{self.log_tail()}"
                )
            if self.ready_file.is_file():
                url: str = json.loads(self.ready_file.read_text())["url"]
                return url
            await asyncio.sleep(0.1)
        raise RuntimeError(f"the rollout worker did not serve within {timeout:.0f} s")

    async def stop(self, grace: float = 60.0) -> int:
        """SIGTERM (the worker checkpoints in-flight episodes), SIGKILL after ``grace``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.proc.wait, grace)
            except subprocess.TimeoutExpired:
                logger.warning("the rollout worker ignored SIGTERM for %.0f s; killing it", grace)
                self.proc.kill()
        code = await asyncio.to_thread(self.proc.wait)
        self._log.close()
        return code


def build_trainer(recipe: Recipe, model_dir: Path) -> tuple[GRPOTrainer, Algorithm]:
    """The reference trainer on ``model_dir`` with the recipe's settings, and the
    ``trainer.algorithm`` whose ``collate`` gives its batches their advantages (the
    trainer already uses the algorithm's objective)."""
    from agentroll.trainer.algorithm import trainer_algorithm
    from agentroll.trainer.grpo import GRPOConfig, GRPOTrainer

    t = recipe.trainer
    algorithm = trainer_algorithm(t.algorithm, field="trainer.algorithm")
    config = GRPOConfig(
        lr=t.lr,
        clip_eps=t.clip_eps,
        is_cap=t.is_cap,
        kv_lag=t.kv_lag,
        kv_lag_weight=t.kv_lag_weight,
        max_grad_norm=t.max_grad_norm,
        entropy_coef=t.entropy_coef,
        temperature=recipe.sampling.temperature,
        export=recipe.sync.encoding,
        seed=recipe.run.seed,
    )
    return GRPOTrainer(model_dir, config, objective=algorithm.objective), algorithm


def staleness_of(trajectories: list[Trajectory], trainer_version: int) -> dict[str, int]:
    hist: dict[str, int] = {}
    for t in trajectories:
        oldest = t.min_policy_version()
        if oldest >= 0:
            key = str(trainer_version - oldest)
            hist[key] = hist.get(key, 0) + 1
    return hist


def step_fields(step: int, stats: Any, batch: list[Trajectory], version: int) -> dict[str, Any]:
    """The fields of a ``step`` record: the trainer's ``stats`` of ``step`` on ``batch``,
    which the trainer took at ``version`` (the staleness is measured against it)."""
    return {
        "step": step,
        "version": stats.version,
        "reward_mean": stats.reward_mean,
        "reward_std": stats.reward_std,
        "trajectories": stats.trajectories,
        "tokens": stats.tokens,
        "loss": stats.loss,
        "clip_fraction": stats.clip_fraction,
        "kl": stats.kl,
        "staleness": staleness_of(batch, version),
        "kv_lagged_tokens": stats.kv_lagged_tokens,
        "seconds": stats.seconds,
        "failed": sum(t.status == "failed" for t in batch),
        "entropy": stats.extra.get("entropy", 0.0),
    }


async def train(
    recipe: Recipe,
    *,
    url: str,
    token: str,
    model_dir: Path,
    run_dir: Path,
    progress: ProgressMode = "auto",
) -> dict[str, Any]:
    """The RL phase: lease, step, ack, push weights; returns the worker's final status."""
    from agentroll.stream.client import StreamClient

    t = recipe.trainer
    trainer, algorithm = build_trainer(recipe, model_dir)
    metrics = MetricsWriter(run_dir, "trainer")
    trained = TrainedLog(run_dir)
    bar = Progress("training steps", recipe.run.steps, mode=progress)
    worker_version = 0
    try:
        # the trainer uses token arrays, rewards and ids: turns and messages are not decoded
        async with StreamClient(
            url, token=token, seen_path=run_dir / "trainer-acked.ids", conversation=False
        ) as client:
            for step in range(recipe.run.steps):
                with metrics.span("trainer.idle"):
                    # the version of the weights last pushed: what the worker's staleness
                    # bound is measured against (a version it never received is refused)
                    pending = await client.take(t.batch_size, trainer_version=worker_version)
                with metrics.span("trainer.busy", step=step):
                    version = trainer.version
                    batch = algorithm.collate(pending, pad_id=0)
                    stats = await asyncio.to_thread(trainer.step, batch)
                    await client.ack(x.id for x in pending)
                metrics.event("step", **step_fields(step, stats, pending, version))
                trained.write(step, pending)
                bar.advance()
                if (step + 1) % recipe.sync.interval == 0 or step + 1 == recipe.run.steps:
                    with metrics.span("trainer.busy", phase="export+push"):
                        update = await asyncio.to_thread(trainer.export, worker_version)
                        await client.push_weights(update)
                        worker_version = update.version
            status = await client.status()
    finally:
        bar.close()
        metrics.close()
        trained.close()
    return status


async def train_in_process(
    recipe: Recipe, *, model_dir: Path, run_dir: Path, progress: ProgressMode = "auto"
) -> dict[str, Any]:
    """Rollout and training in this process (``agentroll.run.placement``): ``[placement]
    mode = "colocated"`` alternates rollout phases and training steps on the same cores;
    ``mode = "separate"`` with ``autoscale`` runs both at once, its replicas and trainer
    threads moved by the autoscaler (each move an ``autoscale`` record).  Returns what it
    measured.  The trajectories go straight to the trainer (no spool: episodes still running
    at the end are cancelled, and counted, not lost after being made durable)."""
    import os

    from agentroll.fleet.backend import FleetBackend
    from agentroll.fleet.replica import LocalReplica
    from agentroll.rollout.engine import RolloutEngine
    from agentroll.rollout.pause import as_policy_fn
    from agentroll.run.autoscale import AutoscaleConfig, Autoscaler, Capacity
    from agentroll.run.build import (
        build_backend,
        build_environment,
        resume_policy,
        rollout_config,
        torch_engine,
    )
    from agentroll.run.capacity import CapacityMover, Move, ServingMeter
    from agentroll.run.placement import PlacementConfig, Switch, run_placement

    p = recipe.placement
    colocated = p.mode == "colocated"
    trainer, algorithm = build_trainer(recipe, model_dir)
    metrics = MetricsWriter(run_dir, "colocated" if colocated else "in-process")
    trained = TrainedLog(run_dir)
    bar = Progress("training steps", recipe.run.steps, mode=progress)
    offset = time.time() - time.perf_counter()  # switch and move times are perf_counter seconds
    last = {"woke": time.time(), "trained": time.time()}

    done = [0]  # steps trained

    def train_step(batch: list[Trajectory], base: int) -> Any:
        t0 = time.time()
        version, step = trainer.version, done[0]
        st = trainer.step(algorithm.collate(batch, pad_id=0))
        update = trainer.export(base)
        if not colocated:  # colocated: the switch spans say when it trained
            metrics.span_at("trainer.idle", last["trained"], t0)
            metrics.span_at("trainer.busy", t0, time.time(), step=step)
            last["trained"] = time.time()
        done[0] += 1
        metrics.event("step", **step_fields(step, st, batch, version))
        trained.write(step, batch)
        return update

    def on_step(step: int, batch: list[Trajectory], _: Any) -> None:
        bar.advance()

    def on_switch(s: Switch) -> None:
        slept, woke = s.slept_at + offset, s.woke_at + offset
        metrics.span_at("rollout.busy", last["woke"], slept)
        metrics.span_at("trainer.idle", last["woke"], slept)
        metrics.span_at("rollout.idle", slept, woke, phase="sleep")
        metrics.span_at("trainer.busy", slept, woke, step=s.step)
        metrics.event(
            "switch",
            step=s.step,
            version=s.version,
            freed_mb=s.freed_bytes / 2**20,
            rss_freed_mb=s.rss_freed_bytes / 2**20,
            wake_ms=s.wake_ms,
            parked=s.parked,
            fallback=s.fallback,
        )
        last["woke"] = woke

    def on_move(m: Move) -> None:
        fields = msgspec.structs.asdict(m)
        fields["t"] = fields.pop("at") + offset
        metrics.event("autoscale", **fields)

    def on_serving(replica: str, busy: bool, start: float, end: float) -> None:
        name = "rollout.busy" if busy else "rollout.idle"
        metrics.span_at(name, start, end, component=f"rollout-{replica}")

    config = PlacementConfig(
        mode=p.mode,
        partial_rollouts=p.partial_rollouts,
        sleep_level=p.sleep_level,
        wake_timeout=p.wake_timeout,
        max_staleness=recipe.buffer.max_staleness
        if recipe.buffer.max_staleness is not None
        else 1 << 30,
        window_steps=p.window_steps,
    )
    env = build_environment(recipe)
    batch_groups = recipe.trainer.batch_size // recipe.rollout.samples_per_task
    mover: CapacityMover | None = None
    meter: ServingMeter | None = None
    try:
        backend = build_backend(recipe, model_dir)
        if not colocated:
            assert isinstance(backend, FleetBackend)
            cores = p.cores or os.cpu_count() or 1
            threads = recipe.trainer.threads or max(1, cores - recipe.backend.replicas)
            controller = None
            if p.autoscale:
                controller = Autoscaler(
                    AutoscaleConfig(
                        band=p.autoscale_band,
                        cores=cores,
                        max_replicas=max(recipe.backend.replicas, p.max_replicas or cores),
                        max_trainer_threads=max(threads, cores),
                    ),
                    Capacity(recipe.backend.replicas, threads),
                )

            def make_replica(i: int) -> LocalReplica:
                return LocalReplica(torch_engine(recipe, model_dir), name=f"replica-{i}")

            mover = CapacityMover(
                backend,
                controller,
                make_replica,
                lambda: trainer.exporter.full(),
                trainer_threads=threads,
            )
            meter = ServingMeter(backend, on_serving)
        async with backend, RolloutEngine(backend, env, rollout_config(recipe)) as engine:
            if meter is not None:
                meter.start()
            try:
                stats = await run_placement(
                    engine,
                    train_step,
                    list(env.tasks()),
                    steps=recipe.run.steps,
                    batch_groups=batch_groups,
                    config=config,
                    policy=as_policy_fn(resume_policy(recipe.sync)),
                    on_step=on_step,
                    on_switch=on_switch,
                    capacity=mover,
                    on_move=on_move,
                )
            finally:
                if meter is not None:
                    await meter.stop()
        metrics.counter("episodes", stats.trained + stats.dropped_stale)
        metrics.counter("episodes_failed", stats.failed)
        metrics.counter("episodes_restarted", stats.restarted)
        metrics.counter("dropped_stale", stats.dropped_stale)
        metrics.counter("lost", 0)
    finally:
        bar.close()
        metrics.close()
        trained.close()
    out: dict[str, Any] = {
        "placement": p.mode,
        "partial_rollouts": p.partial_rollouts,
        "steps": stats.steps,
        "tail_wait_s": stats.tail_wait_s,
        "switches": len(stats.switches),
        "fallbacks": sum(s.fallback for s in stats.switches),
    }
    if mover is not None:
        out["autoscale"] = p.autoscale
        out["moves"] = sum(not m.error for m in stats.moves)
        out["replicas"] = len(mover.fleet.replicas)
        out["trainer_threads"] = mover.trainer_threads
    return out


def lost_count(status: dict[str, Any]) -> int:
    """Trajectories the worker made durable that neither reached the trainer (acked), were
    dropped as stale (counted), nor are still in its spool (queued or leased, or records it
    could not decode at start-up).  ``status`` is one consistent snapshot (see
    ``TrajectoryStream.status``): a commit in progress counts on neither side."""
    stream = status["stream"]
    published = int(stream["published"]) + int(stream["restored"])
    published += int(stream.get("undecodable", 0))
    pending = int(status["spool"]["records"])
    return published - int(stream["acked"]) - int(stream["dropped_stale"]) - pending


async def run_recipe_async(
    recipe: Recipe,
    recipe_path: Path | None = None,
    *,
    run_dir: Path | None = None,
    progress: ProgressMode = "auto",
) -> Path:
    """Run the recipe end to end; returns the run directory (with the report in it)."""
    out = create_run_dir(recipe, run_dir=run_dir)
    resolved_recipe = out / "recipe.toml"
    metrics = MetricsWriter(out, "run")
    metrics.event(
        "run",
        event="start",
        steps=recipe.run.steps,
        max_staleness=recipe.buffer.max_staleness,
        sync_interval=recipe.sync.interval,
        strategy=recipe.sync.strategy,
        policy=recipe.sync.policy,
        placement=recipe.placement.mode,
        autoscale=recipe.placement.autoscale,
    )
    print(f"run directory: {out}", file=sys.stderr)
    if recipe.trainer.threads is not None:
        import torch

        # the worker process has its own engines: on a small machine the trainer's threads
        # would only fight them (and each other) for the cores
        torch.set_num_threads(recipe.trainer.threads)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    model_dir = prepare_model(recipe, out)
    if recipe.warmup.steps:
        demos = await demonstrations(recipe, model_dir)
        model_dir = await asyncio.to_thread(warmup, recipe, model_dir, out, demos)
    if recipe.placement.mode == "colocated" or recipe.placement.autoscale:
        async with asyncio.timeout(recipe.run.timeout):
            status = await train_in_process(
                recipe, model_dir=model_dir, run_dir=out, progress=progress
            )
        metrics.event("run", event="end", worker_status=status, worker_exit_code=0)
        metrics.close()
        return out
    token = secrets.token_hex(16)
    worker = WorkerProcess(resolved_recipe, model_dir, out, token, recipe.stream.token_env)
    try:
        url = await worker.wait_ready()
        async with asyncio.timeout(recipe.run.timeout):
            status = await train(
                recipe, url=url, token=token, model_dir=model_dir, run_dir=out, progress=progress
            )
    finally:
        code = await worker.stop()
        if code != 0:
            logger.warning("the rollout worker exited with %d; see %s", code, worker.log_path)
    metrics.counter("lost", lost_count(status))
    metrics.event("run", event="end", worker_status=status, worker_exit_code=code)
    metrics.close()
    return out


def run_recipe(path: str | Path, *, run_dir: str | Path | None = None) -> int:
    """``agentroll run RECIPE``: run it, print the report; exit code 0 on success."""
    from agentroll.run.recipe import load_recipe
    from agentroll.run.report import main_report

    recipe = load_recipe(path)
    out = asyncio.run(
        run_recipe_async(recipe, Path(path), run_dir=Path(run_dir) if run_dir else None)
    )
    return main_report(out)
