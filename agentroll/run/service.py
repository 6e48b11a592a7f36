"""The recipe-driven rollout worker: episodes on a fleet, groups to a served trajectory stream.

Invariants: a group is published only whole; nothing finished is dropped at a stop, and the
next start continues it; an episode whose checkpoint is refused as corrupt restarts from its
task under its id while the others continue; every sync, counter and busy/idle interval is
written to ``<run_dir>/<component>.jsonl`` (``agentroll.run.metrics``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from agentroll.errors import ConfigError
from agentroll.rollout.admission import AdmissionController
from agentroll.rollout.buffer import BufferConfig
from agentroll.rollout.checkpoint import (
    JOB_FILE,
    EpisodeCheckpoint,
    EpisodeJob,
    load_finished,
    load_jobs,
    save_finished,
    save_jobs,
    scan_checkpoints,
)
from agentroll.rollout.engine import RolloutEngine, StopReport
from agentroll.run.build import (
    build_backend,
    build_environment,
    cycle_tasks,
    local_weight_layout,
    resume_policy,
    rollout_config,
)
from agentroll.run.metrics import MetricsWriter
from agentroll.run.recipe import Bound, Recipe
from agentroll.run.worker import drive
from agentroll.stream.api import serve_stream
from agentroll.stream.auth import TOKEN_FILE, check_token, ensure_token
from agentroll.stream.server import StreamConfig, TrajectoryStream
from agentroll.stream.spool_config import SpoolConfig
from agentroll.types import Task, Trajectory
from agentroll.weights.apply import check_base
from agentroll.weights.transport import UpdateHeader
from agentroll.weights.update import WeightUpdate

logger = logging.getLogger("agentroll.run.service")
FINISHED = "finished.msgpack"  # finished members of unfinished groups, saved at a stop
UNSTARTED = "unstarted.msgpack"  # samples of started groups with no episode, saved at a stop


class _NotingStream(TrajectoryStream):
    """A stream that tells the service each trainer version it hears of, when it hears it."""

    def __init__(self, *args: Any, service: RolloutService, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.service = service

    async def lease(
        self, max_trajectories: int, *, wait: float = 0.0, trainer_version: int | None = None
    ) -> Any:
        # a version the worker's weights never had is refused before admission hears of it
        self.check_trainer_version(trainer_version)
        if trainer_version is not None:
            self.service.note_trainer_version(trainer_version)
        return await super().lease(max_trajectories, wait=wait, trainer_version=trainer_version)

    async def apply_weights(self, update: WeightUpdate, *, policy: str | None = None) -> None:
        await super().apply_weights(update, policy=policy)
        self.service.note_trainer_version(update.version)


class RolloutService:
    """``await RolloutService(recipe, model_dir=..., run_dir=...).serve(stop)`` runs until
    ``stop`` is set; ``ready(url)`` is called once the stream is served.

    ``checkpoint_dir``: where a stop checkpoints in-flight episodes (default
    ``<run_dir>/checkpoints``) and where a start looks for them.  ``token``: the stream's
    bearer token (default: the recipe's ``stream.token_env`` variable, else the one in
    ``<run_dir>/stream.token``, else a new one); it is written to ``<run_dir>/stream.token``
    (mode 0600) at start, where trainers find it (``agentroll.stream.auth.load_token``).

    At a stop, in-flight episodes are checkpointed; finished members of groups not yet
    whole, and finished episodes the engine still held because the producer was busy
    publishing, are saved beside them (``FINISHED``), and so are the samples of started
    groups that have no episode yet (``UNSTARTED``).  The next start continues all three,
    so every group it began is published whole, keeps the saved files until those groups
    are durable in the spool, and skips what a killed run published of them.  An episode
    whose checkpoint is refused as corrupt restarts from its task under its id (counted in
    ``checkpoints_corrupt``).  Every sync, counter and busy/idle interval is written to
    ``<run_dir>/<component>.jsonl`` (``agentroll.run.metrics``).

    The service builds the recipe's environment and replicas, runs episodes forever (tasks
    cycled in seeded epochs) under admission control, publishes every finished group to a
    ``TrajectoryStream`` (spool first, then the buffer) served over HTTP, and applies the
    weights a trainer pushes with the recipe's sync strategy and resume policy, while episodes
    go on.
    """

    def __init__(
        self,
        recipe: Recipe,
        *,
        model_dir: str | Path,
        run_dir: str | Path,
        checkpoint_dir: str | Path | None = None,
        port: int | None = None,
        component: str = "worker",
        token: str | None = None,
    ) -> None:
        self.recipe = recipe
        self.model_dir = Path(model_dir)
        self.run_dir = Path(run_dir)
        self.checkpoint_dir = (
            Path(checkpoint_dir) if checkpoint_dir else self.run_dir / "checkpoints"
        )
        self.port = recipe.stream.port if port is None else port
        self.token = token if token is not None else os.environ.get(recipe.stream.token_env)
        if self.token is not None:  # an empty one is refused now, not at start
            check_token(self.token, f"the stream token (${recipe.stream.token_env} or token=)")
        self.metrics = MetricsWriter(self.run_dir, component)
        self.spool_dir = Path(recipe.stream.spool_dir or self.run_dir / "spool")
        spt = recipe.rollout.samples_per_task
        self.admission = AdmissionController(
            max_staleness=recipe.buffer.max_staleness,
            batch_size=recipe.trainer.batch_size,
            group_size=spt,
        )
        self.stream_config = StreamConfig(
            buffer=BufferConfig(
                capacity=recipe.buffer.capacity,
                max_staleness=recipe.buffer.max_staleness,
                on_stale=recipe.buffer.on_stale,
                group_size=spt,
                lease_ttl=recipe.buffer.lease_ttl,
            ),
            # stale drops are kept on disk for inspection up to these limits
            spool=SpoolConfig(
                dropped_max_records=recipe.stream.dropped_max_records,
                dropped_max_bytes=recipe.stream.dropped_max_bytes,
            ),
        )
        self.backend: Any = None
        self.stream: TrajectoryStream | None = None
        self._admitted = 0
        self._known_version = 0
        self._consumed_at_known = 0
        self._restored = 0
        self._continued: set[str] = set()  # episodes continued from a checkpoint directory
        # groups with members in FINISHED / UNSTARTED: the files stay until all are published
        self._stop_groups: set[str] = set()
        self.engine: RolloutEngine | None = None
        self.counters = {
            "syncs": 0,
            "syncs_mid_generation": 0,
            "admission_wait_seconds": 0.0,
            "checkpoints_corrupt": 0,  # refused at the start; their episodes restart
        }

    # -- admission ---------------------------------------------------------------------------

    def _consumed(self) -> int:
        assert self.stream is not None
        return int(self.stream.counters["acked"] + self.stream.counters["dropped_stale"])

    def note_trainer_version(self, version: int) -> None:
        """The trainer said it is at ``version`` (a lease or a weight push)."""
        if version > self._known_version:
            self._known_version = version
            self._consumed_at_known = self._consumed()

    def _trainer_version(self) -> int:
        """The trainer's version as admission must assume it: the last one it told, plus one
        per batch it consumed since (it may have stepped before it says so, e.g. between its
        ack and its next weight push)."""
        batches = (self._consumed() - self._consumed_at_known) // self.recipe.trainer.batch_size
        return self._known_version + max(0, batches)

    def _rollout_version(self) -> int:
        """The oldest weights a new episode may sample its first token with (during a rolling
        update some replicas are still at the previous version)."""
        fleet = self.backend
        versions = fleet.router.versions(("active", "draining", "updating"))
        return min(versions) if versions else int(fleet.policy_version)

    def outstanding(self) -> int:
        """Trajectories started (or restored) and not yet consumed by the trainer."""
        assert self.stream is not None
        c = self.stream.counters
        return self._admitted + self._restored - c["acked"] - c["dropped_stale"]

    async def _admit(self, n: int) -> None:
        waited = await self.admission.wait(
            policy_version=self._rollout_version,
            trainer_version=self._trainer_version,
            outstanding=self.outstanding,
        )
        self._admitted += n
        self.counters["admission_wait_seconds"] += waited

    # -- weights -----------------------------------------------------------------------------

    def _weights_check(self) -> Callable[[UpdateHeader], None]:
        """The check of a weight upload's header, before its payloads are read: its base is
        the fleet's version and, where the engines run here, its tensors are the model's
        (which bounds its size by the model's).  Call it once the backend has started."""
        fleet, layout = self.backend, local_weight_layout(self.backend)

        def check(header: UpdateHeader) -> None:
            check_base(header, fleet.policy_version, holder="this worker")
            if layout is not None:
                layout.check(header)

        return check

    async def _on_weights(self, update: WeightUpdate, *, policy: str | None = None) -> None:
        fleet, engine = self.backend, self.engine
        assert engine is not None  # the engine starts before the stream is served
        inflight = await fleet.inflight_calls()
        before = msgspec.structs.replace(fleet.stats)
        t0 = time.time()
        # the pusher's resume policy (checked by the route), else the recipe's
        chosen = policy or resume_policy(self.recipe.sync)
        report = await engine.sync(update, policy=chosen)  # type: ignore[arg-type]
        t1 = time.time()
        after = fleet.stats
        self.counters["syncs"] += 1
        self.counters["syncs_mid_generation"] += bool(inflight)
        self.metrics.span_at("sync", t0, t1, version=update.version)
        # The fleet reports how long each replica was paused, not when: the pauses are drawn
        # at the end of the sync window they belong to.
        for ms in report.pause_ms:
            self.metrics.span_at("pause", max(t0, t1 - ms / 1000), t1, version=update.version)
        self.metrics.event(
            "sync",
            version=update.version,
            strategy=report.strategy,
            policy=chosen,
            seconds=report.seconds,
            pause_ms=list(report.pause_ms),
            mid_generation=len(inflight),
            episodes_restarted=after.episodes_restarted - before.episodes_restarted,
            tokens_discarded=after.tokens_discarded - before.tokens_discarded,
            migrated=report.migrated,
            bytes=update.payload_bytes,
            failed=dict(report.failed),
        )
        self.admission.observe_trainer_version(update.version)
        self._write_counters()

    # -- bookkeeping -------------------------------------------------------------------------

    def _write_counters(self) -> None:
        fleet_stats = self.backend.stats if self.backend is not None else None
        for name, value in self.episode_counters().items():
            self.metrics.counter(name, value)
        if fleet_stats is not None:
            self.metrics.counter("episodes_restarted", fleet_stats.episodes_restarted)
            self.metrics.counter("tokens_discarded", fleet_stats.tokens_discarded)
        if self.stream is not None:
            c = self.stream.counters
            for name in ("published", "acked", "dropped_stale", "delivered"):
                self.metrics.counter(name, c[name])
            stats = self.stream.buffer.statistics()
            self.metrics.counter("kept_stale", stats.kept_stale)

    def episode_counters(self) -> dict[str, float]:
        """The service's counters and its rollout engine's episode counts."""
        stats = self.engine.stats if self.engine is not None else {}
        return {
            "episodes": stats.get("episodes", 0),
            "episodes_failed": stats.get("failed", 0),
            **self.counters,
        }

    async def _sample_busy(self, interval: float = 0.5) -> None:
        """Every ``interval``: each replica's generating share of the window, as a busy span
        followed by an idle span (the split within one window is not known)."""
        fleet = self.backend
        names = list(fleet.replicas)
        last = await fleet.replica_seconds(names)
        t_last = time.time()
        while True:
            await asyncio.sleep(interval)
            now_busy = await fleet.replica_seconds(names)
            now = time.time()
            for name in names:
                busy = min(now - t_last, max(0.0, now_busy.get(name, 0.0) - last.get(name, 0.0)))
                self.metrics.span_at("rollout.busy", t_last, t_last + busy, component=name)
                self.metrics.span_at("rollout.idle", t_last + busy, now, component=name)
            last, t_last = now_busy, now

    async def _publish(self, group: list[Trajectory]) -> None:
        """Publish a whole group (the engine assembled it) and retire what it continued."""
        assert self.stream is not None
        for traj in group:
            if traj.finished_at > traj.started_at:
                self.admission.observe_episode(traj.finished_at - traj.started_at)
        await self.stream.publish(group)
        done = [t.id for t in group if t.id in self._continued]
        if done:  # a continued episode's checkpoint is done with once it is durable
            self._continued.difference_update(done)
            # shielded: a stop that cancels this publisher leaves no published episode's
            # checkpoint behind (the next start would continue it a second time)
            await asyncio.shield(asyncio.to_thread(self._remove_checkpoints, done))
        group_id = group[0].group_id
        if group_id in self._stop_groups:
            self._stop_groups.discard(group_id)
            if not self._stop_groups:  # every group the last stop saved is durable
                await asyncio.shield(asyncio.to_thread(self._remove_stop_files))

    def _remove_checkpoints(self, episode_ids: list[str]) -> None:
        for episode_id in episode_ids:
            shutil.rmtree(self.checkpoint_dir / episode_id, ignore_errors=True)

    def _remove_stop_files(self) -> None:
        for name in (FINISHED, UNSTARTED):
            (self.checkpoint_dir / name).unlink(missing_ok=True)

    def _load_stopped(
        self,
    ) -> tuple[list[EpisodeCheckpoint], list[Trajectory], list[EpisodeJob]]:
        """Checkpoints, finished episodes (members of unfinished groups, and episodes the
        engine had not handed over yet) and unstarted samples of started groups, left by the
        last stop: ``run(finished=...)`` delivers the finished ones again (or scores them
        with the rest of their group), ``run(unstarted=...)`` starts the unstarted ones.
        The files stay until every group they hold is published (a kill before then finds
        them again); ``_skip_published`` then drops what a killed run had published.  An
        episode checkpoint refused as corrupt becomes an unstarted sample that restarts the
        episode under its id (its directory goes once its group is published)."""
        finished = self.checkpoint_dir / FINISHED
        unstarted = self.checkpoint_dir / UNSTARTED
        try:
            checkpoints, corrupt = scan_checkpoints(self.checkpoint_dir)
            stopped = load_finished(finished) if finished.is_file() else []
            jobs = load_jobs(unstarted) if unstarted.is_file() else []
        except ValueError as exc:  # damaged: refuse to start rather than drop episodes
            raise ConfigError(
                f"cannot continue the stopped run: {exc}; move what is damaged out of "
                f"{self.checkpoint_dir} and start again (what it held is then lost)"
            ) from exc
        queued = {(j.group_id, j.sample_index) for j in jobs}
        for bad in corrupt:
            if bad.job is None and self.recipe.rollout.samples_per_task == 1:
                # its task is unknown, but it is a group of its own: no group waits for it
                logger.warning("%s; its task is unknown too: the episode is dropped", bad.error)
                shutil.rmtree(bad.path, ignore_errors=True)
                continue
            if bad.job is None:  # the sample is unknown: its group could never complete
                raise ConfigError(
                    f"cannot continue the stopped run: {bad.error}, and its task is unknown "
                    f"({JOB_FILE} is damaged too); move {bad.path} out of {self.checkpoint_dir} "
                    "and start again (the rest of its group then waits for it forever)"
                ) from bad.error
            logger.warning("%s; restarting episode %s from its task", bad.error, bad.path.name)
            # a restart a stop saved as unstarted before it ran is in UNSTARTED already
            if (bad.job.group_id, bad.job.sample_index) not in queued:
                jobs.append(bad.job)
        self.counters["checkpoints_corrupt"] = len(corrupt)
        self._track_stopped(checkpoints, stopped, jobs)
        return checkpoints, stopped, jobs

    def _track_stopped(
        self,
        checkpoints: list[EpisodeCheckpoint],
        stopped: list[Trajectory],
        jobs: list[EpisodeJob],
    ) -> None:
        """What the service derives from the stopped run it continues: the count admission
        treats as outstanding, the checkpoints to remove once published, the groups that
        keep the stop's files."""
        self._restored = len(checkpoints) + len(stopped) + len(jobs)
        # a restarted episode keeps its id: its refused checkpoint goes when it is published
        self._continued = {cp.episode_id for cp in checkpoints}
        self._continued |= {j.episode_id for j in jobs if j.episode_id}
        self._stop_groups = {t.group_id for t in stopped} | {j.group_id for j in jobs}

    def _skip_published(
        self,
        checkpoints: list[EpisodeCheckpoint],
        stopped: list[Trajectory],
        jobs: list[EpisodeJob],
    ) -> tuple[list[EpisodeCheckpoint], list[Trajectory], list[EpisodeJob]]:
        """With the spool restored: the groups a killed run published (a member is pending
        in the spool) before it removed what the last stop saved of them are neither run
        nor delivered again; their leftover checkpoints are removed.  (A group the trainer
        had also acknowledged by then is not in the spool any more and is delivered again:
        the window is the removal right after its publish.)"""
        assert self.stream is not None
        spool = self.stream.spool
        done = {cp.group_id for cp in checkpoints if cp.episode_id in spool}
        done |= {t.group_id for t in stopped if t.id in spool}
        done |= {j.group_id for j in jobs if j.episode_id and j.episode_id in spool}
        if not done:
            return checkpoints, stopped, jobs
        self._remove_checkpoints([cp.episode_id for cp in checkpoints if cp.group_id in done])
        self._remove_checkpoints(
            [j.episode_id for j in jobs if j.episode_id and j.group_id in done]
        )
        keep_cps = [cp for cp in checkpoints if cp.group_id not in done]
        keep_stopped = [t for t in stopped if t.group_id not in done]
        keep_jobs = [j for j in jobs if j.group_id not in done]
        self._track_stopped(keep_cps, keep_stopped, keep_jobs)
        if not self._stop_groups:
            self._remove_stop_files()
        logger.info("skipping %d groups the last run published before it was killed", len(done))
        return keep_cps, keep_stopped, keep_jobs

    # -- the Sink of ``drive``: groups to the stream, a stop's leftovers beside the checkpoints

    async def deliver(self, group: list[Trajectory]) -> None:
        await self._publish(group)

    async def leave(self, consumer: asyncio.Task[None]) -> None:
        consumer.cancel()  # a group being published when cancelled is in the spool already
        await asyncio.gather(consumer, return_exceptions=True)

    async def save(self, saved: StopReport) -> None:
        """Finished episodes not published (members of groups not yet whole, and ones the
        engine held because the producer was busy publishing) to ``FINISHED``; samples of
        started groups with no episode to ``UNSTARTED``.  What the last stop saved and is
        not published yet is among these again (the engine held it): the files are
        replaced."""
        await asyncio.to_thread(self._save_stopped, saved.undelivered, saved.unstarted)

    def _save_stopped(self, pending: list[Trajectory], jobs: list[EpisodeJob]) -> None:
        """Write (or remove) UNSTARTED and FINISHED, each replaced atomically."""
        path = self.checkpoint_dir / UNSTARTED
        if jobs:
            save_jobs(path, jobs)
        else:
            path.unlink(missing_ok=True)
        path = self.checkpoint_dir / FINISHED
        if pending:
            save_finished(path, pending)
        else:
            path.unlink(missing_ok=True)

    # -- the loop ----------------------------------------------------------------------------

    async def serve(
        self, stop: asyncio.Event, *, ready: Any = None, tasks: list[Task] | None = None
    ) -> dict[str, Any]:
        """Run until ``stop`` is set; then checkpoint what is in flight and return a summary."""
        recipe = self.recipe
        env = build_environment(recipe)
        if tasks is None:
            tasks = list(env.tasks())
            if recipe.environment.num_tasks is not None:
                tasks = tasks[: recipe.environment.num_tasks]
        self.backend = build_backend(recipe, self.model_dir)
        checkpoints, stopped, unstarted = await asyncio.to_thread(self._load_stopped)
        self.metrics.event("run", event="start", component=self.metrics.component)
        await self.backend.start()
        checkpointed = 0
        try:
            token = self.token = await asyncio.to_thread(ensure_token, self.run_dir, self.token)
            self.stream = _NotingStream(
                self.spool_dir,
                self.stream_config,
                on_weights=self._on_weights,
                check_weights=self._weights_check(),
                # a lease may report up to the weights the fleet serves (checked per lease)
                policy_version=max(0, int(self.backend.policy_version)),
                service=self,
            )
            async with (
                self.stream,
                # before the stream is served: a weight push syncs through the engine
                RolloutEngine(self.backend, env, rollout_config(recipe)) as engine,
                serve_stream(
                    self.stream, host=recipe.stream.host, port=self.port, token=token
                ) as url,
            ):
                self.engine = engine
                checkpoints, stopped, unstarted = self._skip_published(
                    checkpoints, stopped, unstarted
                )
                self._restored += self.stream.counters["restored"]
                if ready is not None:
                    ready(url)
                sampler = asyncio.create_task(self._sample_busy())

                try:
                    saved = await drive(
                        engine,
                        self,
                        stop,
                        cycle_tasks(tasks, recipe.run.seed),
                        checkpoint_dir=self.checkpoint_dir,
                        checkpoints=checkpoints,
                        finished=stopped,
                        unstarted=unstarted,
                        admit=self._admit,
                    )
                    checkpointed = len(saved.checkpoints) if saved is not None else 0
                finally:
                    sampler.cancel()
                    await asyncio.gather(sampler, return_exceptions=True)
                    self._write_counters()
        finally:
            await self.backend.close()
            self.metrics.event("run", event="end", component=self.metrics.component)
            self.metrics.close()
        published = self.stream.counters["published"] if self.stream is not None else 0
        return {"published": published, "checkpointed": checkpointed, **self.episode_counters()}


def write_ready_file(path: Path, url: str, token_file: Path | None = None) -> None:
    """Tell a parent process where the stream is served and where its token is (written
    atomically)."""
    tmp = path.with_suffix(".tmp")
    info: dict[str, Any] = {"url": url, "pid": os.getpid()}
    if token_file is not None:
        info["token_file"] = str(token_file)
    tmp.write_text(json.dumps(info))
    tmp.replace(path)


def load_served_recipe(
    recipe_path: str | Path,
    *,
    run_dir: str | Path | None,
    model: str | None,
    port: int | None,
    port_bound: Bound,
) -> tuple[Recipe, Path, str]:
    """What a served recipe needs first: the recipe, its run directory (default: the
    recipe's folder) and its model (default: the recipe's, else the tiny one, made if
    missing); ``port`` is checked against ``port_bound`` (the port bound of its section).
    Raises ``ConfigError``."""
    from agentroll.run.recipe import load_recipe

    try:
        port_bound.check("--port", port if port is not None else 0)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    recipe = load_recipe(recipe_path)
    out = Path(run_dir) if run_dir else Path(recipe_path).resolve().parent
    if model is None:
        from agentroll.model.tiny import ensure_tiny_model

        model = recipe.model.path or str(ensure_tiny_model(None))
    return recipe, out, model


def main_service(
    recipe_path: str | Path,
    *,
    model: str | None = None,
    run_dir: str | Path | None = None,
    checkpoint_dir: str | Path | None = None,
    port: int | None = None,
    ready_file: str | Path | None = None,
) -> dict[str, Any]:
    """``agentroll worker --recipe R.toml``: serve until SIGTERM / SIGINT, then checkpoint
    the episodes in flight and exit.  ``model`` defaults to the recipe's (or the tiny one)."""
    import signal

    from agentroll.run.recipe import StreamSection
    from agentroll.run.worker import stop_on_signals

    recipe, out, model = load_served_recipe(
        recipe_path,
        run_dir=run_dir,
        model=model,
        port=port,
        port_bound=StreamSection.bounds["port"],
    )

    async def main() -> dict[str, Any]:
        stop = asyncio.Event()

        def ready(url: str) -> None:
            token_file = out / TOKEN_FILE
            logger.info("serving trajectories at %s (bearer token in %s)", url, token_file)
            if ready_file is not None:
                write_ready_file(Path(ready_file), url, token_file)

        service = RolloutService(
            recipe, model_dir=model, run_dir=out, checkpoint_dir=checkpoint_dir, port=port
        )
        # a stop the event loop cannot take up (it is blocked) ends the process at once
        with stop_on_signals(stop, (signal.SIGTERM, signal.SIGINT)):
            return await service.serve(stop, ready=ready)

    return asyncio.run(main())
