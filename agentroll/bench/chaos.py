"""``agentroll bench chaos``: SIGKILL a served rollout worker at random moments; count what a
trainer misses or sees twice (no baseline and no ratio, so nothing is paired).

A real ``agentroll worker --recipe`` process (built-in engine, tiny model, guess_number)
serves a consumer here; it is SIGKILLed at seeded moments (``MOMENTS``), restarted, then
drained (``run_chaos_bench_async``); ``tally``: nothing lost, duplicated or split in groups.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import logging
import os
import random
import secrets
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentroll.bench.chaos_tally import (
    MOMENTS,
    ChaosOutcome,
    Event,
    Kill,
    explain,
    kill_plan,
    tally,
)
from agentroll.errors import AgentrollError, ConfigError
from agentroll.run.loop import worker_command

if TYPE_CHECKING:
    from agentroll.stream.client import StreamClient
    from agentroll.weights.exporter import WeightExporter

logger = logging.getLogger("agentroll.bench.chaos")

FINAL_ROUNDS = 4  # SIGTERM + restart rounds of the final drain, at most
_READY_TIMEOUT = 180.0  # seconds a (re)started worker may take to serve
_MOMENT_TIMEOUT = 30.0  # seconds a kill waits for its moment (then it kills anyway)

_RECIPE = """\
[run]
seed = {seed}
[environment]
name = "guess_number"
kwargs = {{ num_tasks = 64 }}
[backend]
replicas = 1
kv_cache_mb = 16
max_num_seqs = 16
prefill_budget = 256
[sampling]
max_tokens = 16
[rollout]
concurrency = 8
samples_per_task = {samples_per_task}
[sync]
strategy = "pause"
policy = "keep"
encoding = "delta"
[buffer]
max_staleness = 2
on_stale = "keep"
capacity = 64
lease_ttl = 30.0
[trainer]
batch_size = {batch_size}
"""


# -- counting (pure) -----------------------------------------------------------------------


# -- the worker process --------------------------------------------------------------------


def stream_token(run_dir: Path, token: str) -> str:
    """The token the worker serves with: what ``agentroll.stream.auth.load_token`` reads from
    its run directory where that module exists and finds one (not this process's
    environment: the worker's was set here), else ``token`` (the one passed to the worker
    in the recipe's ``stream.token_env``, which a worker honours either way)."""
    try:
        auth = importlib.import_module("agentroll.stream.auth")
    except ImportError:
        return token
    load = getattr(auth, "load_token", None)
    if load is None:
        return token
    try:
        found = load(run_dir, env=None)
    except (OSError, ValueError, TypeError, AgentrollError):
        return token
    return str(found) if found else token


class _Worker:
    """``agentroll worker --recipe`` on the bench's run directory, started again and again;
    its stderr goes to ``worker.log`` there, each start's stdout to ``worker.out``."""

    def __init__(self, root: Path, token_env: str, token: str) -> None:
        self.root = root
        self.run_dir = root / "run"
        self.ready_file = root / "worker-ready.json"
        self.log_path = self.run_dir / "worker.log"
        self.out_path = self.run_dir / "worker.out"
        self.env = {**os.environ, token_env: token}
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.ready_file.unlink(missing_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cmd = worker_command(
            self.root / "recipe.toml", self.root / "model", self.run_dir, self.ready_file
        )
        with open(self.log_path, "ab") as log, open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=log, env=self.env)
        self.starts += 1

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    async def wait_ready(self) -> str:
        """The stream's URL once this start serves; ``RuntimeError`` if it exits first or
        takes longer than ``_READY_TIMEOUT``."""
        assert self.proc is not None
        deadline = time.monotonic() + _READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the worker exited with {self.proc.returncode} before serving; "
                    f"{self.log_path} ends with:\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError, ValueError, KeyError):
                ready = json.loads(self.ready_file.read_text())
                if ready["pid"] == self.proc.pid:
                    return str(ready["url"])
            await asyncio.sleep(0.01)
        raise RuntimeError(f"the worker did not serve within {_READY_TIMEOUT:.0f} s")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def kill(self) -> None:
        """SIGKILL and wait for the process to be gone."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(self.proc.wait)

    async def stop(self, grace: float = 60.0) -> dict[str, Any]:
        """SIGTERM (the worker checkpoints what is in flight) and its summary line; SIGKILL
        and ``RuntimeError`` if it does not exit within ``grace`` or exits with an error."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(self.proc.wait, grace)
        except subprocess.TimeoutExpired:
            await self.kill()
            raise RuntimeError(f"the worker ignored SIGTERM for {grace:.0f} s") from None
        lines = self.out_path.read_text(errors="replace").strip().splitlines()
        if code != 0 or not lines:
            raise RuntimeError(
                f"the stopped worker exited with {code}; {self.log_path} ends with:\n"
                f"{self.log_tail()}"
            )
        summary: dict[str, Any] = json.loads(lines[-1])
        return summary

    def close(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()


def spool_pending(spool_dir: Path) -> tuple[list[str], int]:
    """The ids a stopped worker's spool holds unacknowledged (what its next start restores)
    and the torn records the opening dropped.  Opening runs the spool's recovery, as the
    next start would; the worker must not be running."""
    from agentroll.stream.spool import Spool

    if not spool_dir.is_dir():
        return [], 0
    with Spool(spool_dir) as spool:
        ids = [record.id for record in spool.pending()]
        torn = spool.statistics().torn_records_dropped
    return ids, torn


def _spool_signature(spool_dir: Path) -> tuple[tuple[str, int, int], ...]:
    """Name, size and mtime of each segment file: it changes with every spool write."""
    out = []
    for path in spool_dir.glob("*.seg"):
        with contextlib.suppress(FileNotFoundError):  # collected meanwhile
            st = path.stat()
            out.append((path.name, st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


# -- the consumer --------------------------------------------------------------------------


class _Consumer:
    """A trainer's side of the stream across worker restarts: leases, dedupes by id, acks
    (an ack that failed is sent again to the next worker), and every ``push_every`` batches
    changes a few weights and pushes the delta (what a worker at another version needs when
    it starts: a full update)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        batch_size: int,
        push_every: int,
        seed: int,
        step_seconds: float = 0.05,
    ) -> None:
        from safetensors.torch import load_file

        from agentroll.weights.exporter import WeightExporter

        self.state = load_file(str(model_dir / "model.safetensors"))
        self.names = sorted(self.state)
        self.exporter: WeightExporter = WeightExporter(lambda: self.state)
        self.rng = random.Random(seed)
        self.batch_size = batch_size
        self.push_every = push_every
        self.step_seconds = step_seconds  # a training step: the batch is held, not acked
        self.events: list[Event] = []
        self.seen: set[str] = set()
        self.to_ack: dict[str, None] = {}  # leased ids not confirmed acked (ordered)
        self.training = True  # push a new version every push_every batches
        self.incarnation = 0
        self.worker_version: int | None = None  # None: ask the worker
        self.batches = 0
        self.pushes = 0
        self.last_fresh = time.monotonic()  # when a lease last brought an unseen id
        self.longest_episode = 0.0
        self.ack_sent = asyncio.Event()  # set when an ack request goes out
        self.leased = asyncio.Event()  # set when a lease brought trajectories
        self.acking = False  # an ack request is out and not answered
        self.push_lock = asyncio.Lock()
        self.error: BaseException | None = None  # why the last run() ended

    def _train_step(self) -> None:
        """A stand-in for an optimizer step: 32 seeded entries of one tensor change."""
        import torch

        flat = self.state[self.rng.choice(self.names)].view(-1)
        picked = self.rng.sample(range(flat.numel()), min(32, flat.numel()))
        flat[torch.tensor(picked)] += 1e-3

    async def push(self, client: StreamClient, *, step: bool) -> None:
        """Push what the worker needs to reach the exporter's version (after one more
        training step with ``step``).  Raises ``AgentrollError`` when the worker is gone."""
        async with self.push_lock:
            if step:
                self._train_step()
                self.exporter.export()
            if self.worker_version is None:
                self.worker_version = int((await client.status())["policy_version"])
            update = self.exporter.update_for(self.worker_version)
            if update is None:
                return
            self.worker_version = None  # unknown until the reply (a kill may come first)
            await client.push_weights(update)
            self.worker_version = update.version
            self.pushes += 1

    async def _flush_acks(self, client: StreamClient) -> None:
        if not self.to_ack:
            return
        ids = list(self.to_ack)
        self.ack_sent.set()
        self.acking = True
        await client.ack(ids)  # durable in the worker's spool once it replies
        self.acking = False
        for tid in ids:
            self.events.append(Event("acked", tid, incarnation=self.incarnation))
            self.to_ack.pop(tid, None)

    async def step(self, client: StreamClient) -> None:
        await self._flush_acks(client)
        # the trainer's version as the worker knows it: the last weights it confirmed
        batch = await client.lease(self.batch_size, wait=0.5, trainer_version=self.worker_version)
        if batch is None:
            return
        for t in batch.trajectories:
            self.events.append(Event("leased", t.id, t.group_id, self.incarnation))
            self.to_ack[t.id] = None  # re-offered ones too: an ack makes them leave
            if t.id not in self.seen:  # the dedupe: a trainer trains on these only
                self.seen.add(t.id)
                self.last_fresh = time.monotonic()
                self.longest_episode = max(self.longest_episode, t.finished_at - t.started_at)
        self.leased.set()
        await asyncio.sleep(self.step_seconds)  # a trainer acks after its step
        await self._flush_acks(client)
        self.batches += 1
        if self.training and self.batches % self.push_every == 0:
            await self.push(client, step=True)

    async def run(self, client: StreamClient) -> None:
        """Sync the worker's weights, then consume until the worker goes away (the error
        that ended it is kept in ``error``)."""
        self.error, self.acking = None, False
        self.worker_version = None  # a fresh worker: ask it
        try:
            await self.push(client, step=False)
            while True:
                await self.step(client)
        except AgentrollError as exc:  # StreamError, WeightSyncError: the worker is gone
            self.error = exc


# -- the bench -----------------------------------------------------------------------------


@dataclass
class ChaosResult:
    """A chaos run: the outcome, each kill, and the final drain."""

    outcome: ChaosOutcome
    kills: list[Kill]
    final_rounds: int
    weight_pushes: int
    seconds: float
    final_pending: list[str]

    def line(self) -> str:
        return self.outcome.line()


async def _await_moment(
    moment: str,
    rng: random.Random,
    *,
    consumer: _Consumer,
    client: StreamClient,
    spool_dir: Path,
) -> tuple[bool, bool]:
    """Wait until ``moment`` (at most ``_MOMENT_TIMEOUT``); returns whether a weight push and
    an ack were in flight as it came (the caller kills right then).  ``weights`` starts a
    push of its own (one more training step) and kills 0-10 ms into it."""
    push: asyncio.Task[None] | None = None
    try:
        if moment == "restart":
            await asyncio.sleep(rng.uniform(0.0, 0.25))
        elif moment == "generate":
            await asyncio.sleep(rng.uniform(0.5, 3.0))
        elif moment == "publish":
            await asyncio.sleep(rng.uniform(0.2, 2.0))
            before = _spool_signature(spool_dir)
            deadline = time.monotonic() + _MOMENT_TIMEOUT
            while time.monotonic() < deadline:  # files: nothing to wait on but a poll
                await asyncio.sleep(0.002)
                if _spool_signature(spool_dir) != before:
                    break
        elif moment == "lease":
            await asyncio.sleep(rng.uniform(0.3, 2.0))
            consumer.leased.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_MOMENT_TIMEOUT):
                    await consumer.leased.wait()
            await asyncio.sleep(rng.uniform(0.0, consumer.step_seconds / 2))
        elif moment == "weights":
            await asyncio.sleep(rng.uniform(0.3, 2.0))
            push = asyncio.ensure_future(consumer.push(client, step=True))
            await asyncio.sleep(rng.uniform(0.0, 0.01))
        elif moment == "ack":
            await asyncio.sleep(rng.uniform(0.3, 2.0))
            consumer.ack_sent.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_MOMENT_TIMEOUT):
                    await consumer.ack_sent.wait()
            await asyncio.sleep(rng.uniform(0.0, 0.001))  # an ack commits in about 1 ms
        else:
            raise ValueError(f"unknown kill moment {moment!r}; use one of {MOMENTS}")
        return consumer.push_lock.locked(), consumer.acking
    finally:
        if push is not None and not push.done():
            # it fails once the worker is gone; its error is the expected one
            push.add_done_callback(lambda t: t.cancelled() or t.exception())


async def _end_consumer(task: asyncio.Task[None]) -> None:
    """Let the consumer see that the worker is gone (a refused connection), else cancel."""
    try:
        async with asyncio.timeout(30.0):
            await asyncio.shield(task)
    except TimeoutError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _wait_quiet(consumer: _Consumer, task: asyncio.Task[None], quiet: float) -> None:
    """Until no lease brought an unseen id for ``quiet`` seconds and every ack is confirmed
    (at most 300 s); ``RuntimeError`` if the consumer stopped first."""
    deadline = time.monotonic() + 300.0
    while time.monotonic() < deadline:
        if task.done():
            raise RuntimeError(f"the consumer stopped while the worker served: {consumer.error}")
        if time.monotonic() - consumer.last_fresh >= quiet and not consumer.to_ack:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the worker kept publishing for 300 s after the weight pushes stopped")


async def _incarnation(worker: _Worker, token: str) -> StreamClient:
    """Start the worker again and a client of its stream."""
    from agentroll.stream.client import StreamClient

    worker.start()
    url = await worker.wait_ready()
    return StreamClient(url, token=stream_token(worker.run_dir, token), conversation=False)


async def _chaos(
    worker: _Worker, token: str, consumer: _Consumer, plan: list[str], seed: int
) -> list[Kill]:
    """One worker start per entry of ``plan``, killed at that moment while the consumer
    consumes; after each kill, what the spool holds."""
    rng = random.Random(seed)
    spool_dir = worker.run_dir / "spool"
    records: list[Kill] = []
    for index, moment in enumerate(plan):
        consumer.incarnation = worker.starts
        async with await _incarnation(worker, token) as client:
            ready_at = time.monotonic()
            task = asyncio.ensure_future(consumer.run(client))
            push, ack = await _await_moment(
                moment, rng, consumer=consumer, client=client, spool_dir=spool_dir
            )
            if task.done():
                raise RuntimeError(
                    f"the consumer stopped while the worker served: {consumer.error}"
                )
            unacked, landed = len(consumer.to_ack), time.monotonic() - ready_at
            await worker.kill()
            await _end_consumer(task)
        pending, torn = await asyncio.to_thread(spool_pending, spool_dir)
        kill = Kill(index, moment, landed, push, ack, unacked, len(pending), torn, pending)
        records.append(kill)
        logger.info("chaos %s; %d delivered so far", kill.describe(), len(consumer.seen))
    return records


async def _drain(worker: _Worker, token: str, consumer: _Consumer) -> tuple[int, list[str]]:
    """No more training steps (admission closes once the consumer took what the staleness
    bound lets start at its version): start the worker, consume until quiet, SIGTERM, until
    a stop leaves nothing checkpointed, saved or unacked in the spool (``FINAL_ROUNDS`` at
    most).  Returns the rounds and the ids the spool holds at the end."""
    consumer.training = False
    pending: list[str] = []
    for rounds in range(1, FINAL_ROUNDS + 1):
        consumer.incarnation = worker.starts
        async with await _incarnation(worker, token) as client:
            consumer.last_fresh = time.monotonic()
            task = asyncio.ensure_future(consumer.run(client))
            await _wait_quiet(consumer, task, max(3.0, 2.0 * consumer.longest_episode + 1.0))
            summary = await worker.stop()
            await _end_consumer(task)
        pending, torn = await asyncio.to_thread(spool_pending, worker.run_dir / "spool")
        leftovers = sorted(p.name for p in (worker.run_dir / "checkpoints").glob("*"))
        logger.info(
            "chaos drain round %d: the stopped worker checkpointed %s; the spool holds %d "
            "unacked (%d torn dropped); checkpoint dir: %s",
            rounds,
            summary.get("checkpointed"),
            len(pending),
            torn,
            ", ".join(leftovers) or "empty",
        )
        if not summary.get("checkpointed") and not leftovers and not pending:
            return rounds, pending
    logger.warning("chaos: the drain did not finish in %d rounds", FINAL_ROUNDS)
    return FINAL_ROUNDS, pending


async def run_chaos_bench_async(
    kills: int = 8,
    *,
    seed: int = 0,
    samples_per_task: int = 4,
    directory: str | Path | None = None,
) -> ChaosResult:
    """Run the chaos bench in ``directory`` (kept; default: a temporary one, removed).
    The consumer leases, dedupes by id, acks after a short step and pushes delta weights;
    after the kills the worker is drained (no new weights, SIGTERM, restart until nothing
    is left).  Progress goes to the ``agentroll.bench.chaos`` logger.  Raises
    ``ConfigError`` for bad arguments, ``RuntimeError`` when the worker fails to start or
    stop, or the consumer stops while the worker serves.  No worker process outlives it."""
    from agentroll.model.tiny import create_tiny
    from agentroll.run.recipe import parse_recipe

    if not 0 <= kills <= 1000:
        raise ConfigError(f"--kills {kills}; use 0 to 1000")
    if not 1 <= samples_per_task <= 16:
        raise ConfigError(f"--samples-per-task {samples_per_task}; use 1 to 16")
    batch_size = samples_per_task * max(1, 8 // samples_per_task)
    text = _RECIPE.format(seed=seed, samples_per_task=samples_per_task, batch_size=batch_size)
    recipe = parse_recipe(text, source="bench chaos recipe")
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        if directory is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agentroll-chaos-")))
        else:
            root = Path(directory)
            root.mkdir(parents=True, exist_ok=True)
        (root / "recipe.toml").write_text(text)
        await asyncio.to_thread(create_tiny, root / "model", seed=seed)
        token = secrets.token_hex(16)
        worker = _Worker(root, recipe.stream.token_env, token)
        stack.callback(worker.close)
        consumer = _Consumer(root / "model", batch_size=batch_size, push_every=2, seed=seed)
        records = await _chaos(worker, token, consumer, kill_plan(kills, seed), seed)
        rounds, final_pending = await _drain(worker, token, consumer)
    durable = [tid for k in records for tid in k.pending_ids] + final_pending
    outcome = tally(
        kills=kills, durable=durable, events=consumer.events, samples_per_task=samples_per_task
    )
    if not outcome.target_met:
        logger.error("chaos: target missed\n%s", explain(outcome, records, consumer.events))
    return ChaosResult(
        outcome=outcome,
        kills=records,
        final_rounds=rounds,
        weight_pushes=consumer.pushes,
        seconds=time.monotonic() - start,
        final_pending=final_pending,
    )


def run_chaos_bench(kills: int = 8, **kwargs: Any) -> ChaosResult:
    """``run_chaos_bench_async`` on a new event loop."""
    return asyncio.run(run_chaos_bench_async(kills, **kwargs))


# -- command line --------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``agentroll bench chaos``."""
    parser.add_argument("--kills", type=int, default=8, help="SIGKILLs of the worker")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill moments and delays")
    parser.add_argument(
        "--samples-per-task", type=int, default=4, help="group size of the worker's rollouts"
    )
    parser.add_argument(
        "--dir", default=None, help="run directory, kept (default: a temporary one, removed)"
    )


def main(args: argparse.Namespace) -> int:
    """CLI entry: run the bench (progress on stderr), print its line; 1 if the target
    (lost = duplicated_after_dedupe = groups_incomplete = 0) is missed."""
    result = run_chaos_bench(
        args.kills, seed=args.seed, samples_per_task=args.samples_per_task, directory=args.dir
    )
    print(result.line(), flush=True)
    return 0 if result.outcome.target_met else 1
