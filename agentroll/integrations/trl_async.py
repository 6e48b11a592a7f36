"""TRL ``AsyncGRPOTrainer`` on agentroll workers: its rollout worker and its weight transfer.

Invariants: a trajectory is acknowledged only once TRL trained on it (one weight sync after
it left the rollout queue) and is never put on the queue twice (ids deduped across worker
restarts); a sample's ``model_version`` is the TRL version of the oldest weights that sampled
any of its trained tokens; every push is checksummed and its digest equals the trainer's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import inspect
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from multiprocessing.queues import Queue as MPQueue
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import torch

from agentroll.errors import ConfigError, MissingDependencyError, StreamError, WeightSyncError
from agentroll.stream.client import StreamClient
from agentroll.trainer.advantages import group_advantages
from agentroll.types import Trajectory
from agentroll.weights.exporter import WeightExporter
from agentroll.weights.layout import ServingLayout, convert
from agentroll.weights.update import WeightUpdate, model_digest, state_checksums

logger = logging.getLogger("agentroll.integrations.trl_async")
_T = TypeVar("_T")

#: the TRL releases whose AsyncGRPOTrainer contract this module is written against
SUPPORTED_TRL = ">=1.16,<1.17"
_SAMPLE_FIELDS = (
    "prompt",
    "completion",
    "input_ids",
    "completion_mask",
    "old_log_probs",
    "advantage",
    "model_version",
    "group_id",
    "metrics",
    "enqueued_at",
)
_WORKER_METHODS = ("start", "stop", "update_model_version", "check_health")
_TRANSFER_METHODS = ("init_weight_transfer", "pause", "send_weights", "resume", "destroy")


def check_trl_contract() -> type:
    """Import TRL's AsyncGRPO and check the contract this module relies on; returns its
    ``RolloutSample`` class.  Raises ``MissingDependencyError`` without trl, ``ConfigError``
    naming ``SUPPORTED_TRL`` when the installed release's contract differs."""
    try:
        import trl
    except ImportError as exc:
        raise MissingDependencyError("trl", "trl") from exc
    version = getattr(trl, "__version__", "unknown")
    missing: list[str] = []
    try:
        # the experimental-API banner is for people who import it by hand; this pins it
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.async_grpo import async_grpo_trainer as trainer_mod
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        fields = {f.name for f in dataclasses.fields(RolloutSample)}
        missing += [f"RolloutSample.{f}" for f in _SAMPLE_FIELDS if f not in fields]
        params = inspect.signature(trainer_mod.AsyncGRPOTrainer.__init__).parameters
        missing += [
            f"AsyncGRPOTrainer({p}=...)"
            for p in ("rollout_worker", "weight_transfer")
            if p not in params
        ]
        for proto, names in (
            (trainer_mod.RolloutWorkerProtocol, _WORKER_METHODS),
            (trainer_mod.WeightTransferProtocol, _TRANSFER_METHODS),
        ):
            missing += [f"{proto.__name__}.{n}" for n in names if not hasattr(proto, n)]
        missing += [
            f"async_grpo_trainer.{n}"
            for n in ("TREE_ATTENTION", "register_tree_attention", "get_peak_flops_per_device")
            if not hasattr(trainer_mod, n)
        ]
    except (ImportError, AttributeError, TypeError) as exc:
        missing.append(f"trl.experimental.async_grpo ({exc})")
    if missing:
        raise ConfigError(
            f"the installed trl {version} does not have the AsyncGRPOTrainer contract this "
            f"adapter supports (trl{SUPPORTED_TRL}): missing {', '.join(missing)}; install "
            f"a supported release: pip install 'trl{SUPPORTED_TRL}'"
        )
    return RolloutSample


# -- shared helpers (also for GRPOTrainer's rollout_func) ------------------------------------


def engine_state(
    named: Iterable[tuple[str, torch.Tensor]], layout: ServingLayout | None = None
) -> dict[str, torch.Tensor]:
    """A trainer's ``(name, tensor)`` pairs as the engine holds them: host tensors under the
    engine's names (wrapper prefixes stripped, ``layout`` renames, fusions, skips and serving
    dtype applied).  The built-in engine loads Hugging Face safetensors checkpoints under
    their own names, so for Llama / Qwen2 / Qwen3 the default layout only strips wrappers."""
    state: dict[str, torch.Tensor] = {}
    for bucket in convert(named, layout or ServingLayout()):
        state.update(bucket)
    return state


def sampled_min_version(traj: Trajectory) -> int:
    """The oldest ``policy_version`` among the tokens the trainer trains on (``loss_mask``
    1): the honest staleness of a sample whose tokens span several syncs.  -1 when it has
    no sampled token."""
    sampled = traj.policy_version[traj.loss_mask.astype(bool)]
    return int(sampled.min()) if len(sampled) else -1


class VersionMap:
    """Agentroll weight versions -> TRL ``model_version`` numbers.  ``record(a, t)`` after
    the push of agentroll version ``a`` became TRL version ``t``; ``trl_version(a)`` is the
    TRL version of the newest push at or below ``a`` (0 for weights older than every push:
    the checkpoint a worker started or restarted from).  Thread-safe."""

    def __init__(self) -> None:
        self._pairs: dict[int, int] = {}
        self._lock = threading.Lock()

    def record(self, agentroll_version: int, trl_version: int) -> None:
        with self._lock:
            self._pairs[agentroll_version] = trl_version

    def trl_version(self, agentroll_version: int) -> int:
        with self._lock:
            older = [a for a in self._pairs if a <= agentroll_version]
            return self._pairs[max(older)] if older else 0


def trajectory_sample(
    traj: Trajectory,
    *,
    sample_cls: type,
    advantage: float,
    model_version: int,
    group_id: int,
    metrics: Mapping[str, float] | None = None,
) -> Any:
    """One TRL ``RolloutSample`` of a trajectory: the exact token ids the backend sampled
    and the environment's tokens between them (``completion_mask`` = ``loss_mask``: 0 on
    prompt, tool and environment tokens), behaviour logprobs aligned with ``input_ids`` (0
    where not sampled)."""
    prompt_len = traj.prompt_len
    messages = list(traj.messages)
    first = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
    return sample_cls(
        prompt=[_message(m) for m in messages[:first]],
        completion=[_message(m) for m in messages[first:]],
        input_ids=traj.token_ids.astype(np.int64),
        completion_mask=traj.loss_mask.astype(np.int64),
        old_log_probs=np.nan_to_num(traj.logprobs, nan=0.0).astype(np.float32),
        advantage=float(advantage),
        model_version=int(model_version),
        group_id=int(group_id),
        metrics={
            "reward": float(traj.reward),
            "prompt_tokens": float(prompt_len),
            **(metrics or {}),
        },
        enqueued_at=time.time(),
    )


def _message(m: Any) -> dict[str, Any]:
    return {"role": m.role, "content": m.content if isinstance(m.content, str) else str(m.content)}


# -- the rollout worker ---------------------------------------------------------------------


class _ConsumingQueue(queue.Queue[Any]):
    """TRL's rollout queue: holds ``(sample, trajectory id)`` and hands TRL the sample,
    telling ``on_take`` the id (under the queue's lock, in the order TRL takes them)."""

    def __init__(self, maxsize: int, on_take: Callable[[str], None]) -> None:
        super().__init__(maxsize)
        self._on_take = on_take

    def _get(self) -> Any:
        sample, traj_id = super()._get()
        self._on_take(traj_id)
        return sample


class AgentrollRolloutWorker:
    """A TRL ``RolloutWorkerProtocol`` fed by an agentroll worker's trajectory stream at
    ``url`` (``agentroll worker --recipe ...``).

    A thread leases whole groups, computes GRPO advantages per group
    (``agentroll.trainer.advantages.group_advantages``; ``normalize_std=False`` for Dr. GRPO)
    and puts one ``RolloutSample`` per trajectory on ``rollout_buffer``.  A trajectory TRL
    took from the queue is acknowledged after the *next* weight sync (``update_model_version``):
    the trainer forwards at most one micro-batch ahead of its optimizer step, so by then it
    has trained on it.  What was taken after the last sync but one is left unacknowledged
    at ``stop`` and offered again to the next consumer after its lease ttl.  Ids are deduped
    by the ``StreamClient`` (across worker restarts; with ``seen_path`` also across trainer
    restarts).  ``weight_transfer``: the ``AgentrollWeightTransfer`` pushing to the same
    worker; it maps agentroll versions to TRL's (without one they are taken to be equal) and
    re-sends the weights to a worker that came back from a crash at its checkpoint's version.
    ``token``/``run_dir``: the worker's bearer token, as for ``StreamClient``.  A trajectory
    with no sampled token is acknowledged without being queued (there is nothing to train).
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        run_dir: str | Path | None = None,
        seen_path: str | Path | None = None,
        weight_transfer: AgentrollWeightTransfer | None = None,
        lease_max: int = 64,
        lease_wait: float = 1.0,
        queue_maxsize: int = 64,
        normalize_std: bool = True,
        retry_interval: float = 0.2,
    ) -> None:
        self._sample_cls = check_trl_contract()
        if lease_max < 1 or queue_maxsize < 1:
            raise ConfigError("AgentrollRolloutWorker lease_max and queue_maxsize must be >= 1")
        self.url = url
        self._client_kwargs: dict[str, Any] = {
            "token": token,
            "run_dir": run_dir,
            "seen_path": seen_path,
            "conversation": True,
        }
        StreamClient(url, **self._client_kwargs)  # a missing token is a ConfigError now
        self.weight_transfer = weight_transfer
        self.versions = weight_transfer.versions if weight_transfer is not None else None
        self.lease_max = lease_max
        self.lease_wait = lease_wait
        self.normalize_std = normalize_std
        self.retry_interval = retry_interval
        # typed as TRL's protocol declares them (its attributes admit either queue type)
        self.rollout_buffer: queue.Queue[Any] | MPQueue[Any] = _ConsumingQueue(
            queue_maxsize, self._on_take
        )
        self.metrics_queue: queue.Queue[Any] | MPQueue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._taken_now: list[str] = []  # taken since the last weight sync
        self._taken_prev: list[str] = []  # taken between the last two syncs: maybe untrained
        self._ack_ready: list[str] = []  # trained, not acknowledged yet
        self.taken: list[str] = []  # every id TRL took, in order (for audits and tests)
        self.acked: list[str] = []  # ids the worker confirmed acknowledged
        self._group_ids: dict[str, int] = {}
        self._trl_version = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last_contact = time.monotonic()
        self._wake: Callable[[], None] = lambda: None
        self.reconnects = 0

    # -- RolloutWorkerProtocol --

    def start(self) -> None:
        """Start the leasing thread (TRL calls it once, after the first weight sync)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._main, name="agentroll-rollout", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Acknowledge what is known trained, stop the thread and wait for it (TRL calls it
        at train end)."""
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    def update_model_version(self, model_version: int) -> None:
        """A weight sync finished: TRL's version is now ``model_version``.  Everything taken
        before the previous sync is trained, and is acknowledged."""
        with self._lock:
            if self.versions is not None and self.weight_transfer is not None:
                self.versions.record(self.weight_transfer.version, model_version)
            self._trl_version = model_version
            self._ack_ready += self._taken_prev
            self._taken_prev, self._taken_now = self._taken_now, []
        self._wake()

    def check_health(self, stale_after_s: float) -> None:
        """Raise the leasing thread's error, or ``StreamError`` when the worker has not
        answered for ``stale_after_s`` seconds."""
        if self._error is not None:
            raise StreamError(f"the agentroll rollout thread failed: {self._error!r}") from (
                self._error
            )
        silent = time.monotonic() - self._last_contact
        if silent > stale_after_s:
            raise StreamError(
                f"the agentroll worker at {self.url} has not answered for {silent:.0f}s; "
                "check that it is running (agentroll worker --recipe ...)"
            )

    # -- the thread --

    def _on_take(self, traj_id: str) -> None:
        with self._lock:
            self._taken_now.append(traj_id)
            self.taken.append(traj_id)

    def _trl_version_of(self, traj: Trajectory) -> int:
        version = sampled_min_version(traj)
        return self.versions.trl_version(version) if self.versions is not None else version

    def samples(self, batch: list[Trajectory]) -> tuple[list[tuple[Any, str]], list[str]]:
        """The ``(RolloutSample, id)`` of each trajectory of ``batch`` worth training on, and
        the ids of those with no sampled token."""
        advantages = group_advantages(
            [t.reward for t in batch], [t.group_id for t in batch], normalize_std=self.normalize_std
        )
        rewards: dict[str, list[float]] = {}
        for t in batch:
            rewards.setdefault(t.group_id, []).append(t.reward)
        out, empty = [], []
        for traj, adv in zip(batch, advantages, strict=True):
            if not traj.loss_mask.any():
                empty.append(traj.id)
                continue
            gid = self._group_ids.setdefault(traj.group_id, len(self._group_ids))
            group = rewards[traj.group_id]
            std = float(np.std(group, ddof=1)) if len(group) > 1 else 0.0
            sample = trajectory_sample(
                traj,
                sample_cls=self._sample_cls,
                advantage=float(adv),
                model_version=self._trl_version_of(traj),
                group_id=gid,
                metrics={"reward_std": std, "failed": float(traj.status == "failed")},
            )
            out.append((sample, traj.id))
        return out, empty

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # reported to TRL through check_health
            self._error = exc
            logger.exception("agentroll rollout thread failed")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def wake_up() -> None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to wake
                loop.call_soon_threadsafe(wake.set)

        self._wake = wake_up
        async with StreamClient(self.url, **self._client_kwargs) as client:
            acker = asyncio.create_task(self._ack_loop(client, wake))
            try:
                while not self._stop.is_set():
                    try:
                        await self._lease_loop(client)
                    except StreamError as exc:
                        # the worker is down or restarting: leases expire and acks repeat,
                        # so trying again is safe
                        logger.warning("agentroll worker unreachable, retrying: %s", exc)
                        self.reconnects += 1
                        await asyncio.sleep(self.retry_interval)
            finally:
                self._stop.set()
                wake.set()
                await acker

    async def _lease_loop(self, client: StreamClient) -> None:
        reconnected = self.reconnects > 0
        async with contextlib.aclosing(
            client.batches(self.lease_max, self.lease_wait, prefetch=False)
        ) as batches:
            if reconnected and self.weight_transfer is not None:
                # a worker that crashed came back at its checkpoint's weights
                await asyncio.to_thread(self.weight_transfer.resync)
            skipped = client.skipped
            while not self._stop.is_set():
                batch = await anext(batches)
                self._last_contact = time.monotonic()
                samples, empty = self.samples(batch)
                with self._lock:
                    self._ack_ready += empty
                # "total" keys are summed over TRL's logging window: push deltas
                self.metrics_queue.put(
                    {
                        "agentroll/trajectories_total": float(len(batch)),
                        "agentroll/reoffered_skipped_total": float(client.skipped - skipped),
                    }
                )
                skipped = client.skipped
                for item in samples:
                    await asyncio.to_thread(self._put, item)

    def _put(self, item: tuple[Any, str]) -> None:
        while not self._stop.is_set():
            try:
                self.rollout_buffer.put(item, timeout=0.2)  # full: TRL is behind
                return
            except queue.Full:
                continue

    async def _ack_loop(self, client: StreamClient, wake: asyncio.Event) -> None:
        while True:
            stopping = self._stop.is_set()
            with self._lock:
                ids, self._ack_ready = self._ack_ready, []
            if ids:
                try:
                    await client.ack(ids)
                    self.acked += ids
                    self._last_contact = time.monotonic()
                except StreamError as exc:
                    with self._lock:
                        self._ack_ready = ids + self._ack_ready
                    if stopping:
                        logger.warning(
                            "%d trained trajectories not acknowledged: %s", len(ids), exc
                        )
                        return
                    await asyncio.sleep(self.retry_interval)
                    continue
            if stopping:
                return
            wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=1.0)


# -- the weight transfer --------------------------------------------------------------------


def _run_sync(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` to completion from synchronous code (TRL's callbacks), on a thread of its
    own when this thread already runs an event loop (a notebook, an async caller)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@dataclasses.dataclass(frozen=True, slots=True)
class PushRecord:
    """One push: the update's versions, kind and payload size; the trainer's own digest
    (``model_digest`` of ``state_checksums`` of what it sent) and whether the worker, which
    verified its digest against the update's after applying it, reported that version."""

    version: int
    base_version: int
    kind: str
    payload_bytes: int
    trainer_digest: str
    update_digest: str
    worker_version: int

    @property
    def digest_match(self) -> bool:
        return self.trainer_digest == self.update_digest and self.worker_version == self.version


class AgentrollWeightTransfer:
    """A TRL ``WeightTransferProtocol`` pushing the trainer's weights to the agentroll
    worker at ``url`` as ``WeightUpdate``s over its stream API (``POST /v1/weights``).

    The first push is a full update (the worker's bytes are unknown then), each later one
    a delta against the last push (``WeightExporter``); a worker found at another version
    than that base (it restarted from its checkpoint) gets a full update instead.  Each
    update carries xxh3-128 checksums per tensor and a model digest; the worker applies it
    transactionally, verifies its whole-model digest against it and refuses it otherwise,
    and this side checks the update's digest against its own ``model_digest(
    state_checksums(...))`` and the worker's version afterwards (``history``).  ``layout``
    maps the trainer's parameter names and dtype to the engine's (see ``engine_state``).
    ``policy``: the resume policy of the generations each push pauses (``keep``,
    ``recompute``, ``restart``; None: the worker's recipe's ``[sync] policy``).
    ``pause``/``resume`` do nothing: the worker pauses its generations at a token boundary
    for the push itself and resumes them under that policy in one transaction, so a
    trainer that dies between the two cannot leave it paused.  A worker that is unreachable is retried for
    ``retry_for`` seconds (``StreamError`` then); a refused update raises
    ``WeightSyncError``.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        run_dir: str | Path | None = None,
        layout: ServingLayout | None = None,
        retry_for: float = 120.0,
        retry_interval: float = 0.2,
        policy: str | None = None,
    ) -> None:
        check_trl_contract()
        if policy not in (None, "keep", "recompute", "restart"):
            raise ConfigError(f"policy={policy!r}: use 'keep', 'recompute', 'restart' or None")
        self.policy = policy
        self.url = url
        self._client_kwargs: dict[str, Any] = {"token": token, "run_dir": run_dir}
        StreamClient(url, **self._client_kwargs)  # a missing token is a ConfigError now
        self.layout = layout or ServingLayout()
        self.retry_for = retry_for
        self.retry_interval = retry_interval
        self.versions = VersionMap()
        self.history: list[PushRecord] = []
        self._state: dict[str, torch.Tensor] = {}
        self._exporter: WeightExporter | None = None
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        """The agentroll version of the last push (-1 before the first)."""
        return self._exporter.version if self._exporter is not None else -1

    # -- WeightTransferProtocol --

    def init_weight_transfer(self) -> None:
        """Check that the worker answers (within ``retry_for``)."""
        _run_sync(self._with_client(self._worker_version))

    def pause(self) -> None:
        """Nothing: the push pauses the worker's generations itself (see the class)."""

    def resume(self) -> None:
        """Nothing: the push resumes them under ``policy``."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Convert TRL's ``(name, tensor)`` stream to the engine's layout and push it; returns
        once the worker applied and verified it.  Raises ``WeightSyncError``, ``StreamError``."""
        state = engine_state(iterator, self.layout)
        with self._lock:
            self._state = state
            record = _run_sync(self._with_client(self._push))
        self._check(record)
        logger.info(
            "pushed %s v%d (base %d, %d bytes), digest %s matches",
            record.kind, record.version, record.base_version, record.payload_bytes,
            record.trainer_digest,
        )  # fmt: skip

    def destroy(self) -> None:
        """Drop the host copy of the last weights."""
        with self._lock:
            self._state, self._exporter = {}, None

    # -- beyond the protocol --

    def resync(self) -> bool:
        """Re-send the last pushed weights (a full update) to a worker not at their version,
        e.g. one restarted from its checkpoint after a crash; True if it pushed (recorded in
        ``history``)."""
        with self._lock:
            if self._exporter is None:
                return False
            exporter = self._exporter

            async def run(client: StreamClient) -> PushRecord | None:
                if await self._worker_version(client) == exporter.version:
                    return None
                update = exporter.full()
                await client.push_weights(update, policy=self.policy)
                return self._record(update, await self._worker_version(client))

            record = _run_sync(self._with_client(run))
        if record is None:
            return False
        self._check(record)
        logger.info("re-sent v%d to a restarted worker", record.version)
        return True

    def _record(self, update: WeightUpdate, worker_version: int) -> PushRecord:
        record = PushRecord(
            version=update.version,
            base_version=update.base_version,
            kind=update.kind,
            payload_bytes=update.payload_bytes,
            trainer_digest=model_digest(state_checksums(self._state)),
            update_digest=update.digest,
            worker_version=worker_version,
        )
        self.history.append(record)
        return record

    def _check(self, record: PushRecord) -> None:
        if not record.digest_match:
            raise WeightSyncError(
                f"after push v{record.version} the worker is at v{record.worker_version} and "
                f"the update's digest {record.update_digest} is not the trainer's "
                f"{record.trainer_digest}"
            )

    async def _with_client(self, fn: Callable[[StreamClient], Any]) -> Any:
        async with StreamClient(self.url, **self._client_kwargs) as client:
            return await fn(client)

    async def _worker_version(self, client: StreamClient) -> int:
        deadline = time.monotonic() + self.retry_for
        while True:
            try:
                return int((await client.status())["policy_version"])
            except StreamError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(self.retry_interval)  # restarting: try again

    async def _push(self, client: StreamClient) -> PushRecord:
        worker_version = await self._worker_version(client)
        update: WeightUpdate
        if self._exporter is None:
            self._exporter = WeightExporter(lambda: self._state, version=worker_version + 1)
            update = self._exporter.full()
        else:
            update = self._exporter.export()
            if worker_version != update.base_version:
                update = self._exporter.full()
        deadline = time.monotonic() + self.retry_for
        while True:
            try:
                await client.push_weights(update, policy=self.policy)
                break
            except WeightSyncError as exc:
                if not isinstance(exc.__cause__, httpx.HTTPError):
                    raise  # the worker refused it: sending again changes nothing
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(self.retry_interval)
                if await self._worker_version(client) != update.base_version:
                    update = self._exporter.full()  # it restarted in between
        return self._record(update, await self._worker_version(client))


def digest_lines(history: list[PushRecord]) -> list[str]:
    """One ``key=value`` line per push, for logs."""
    return [
        f"push={i} version={r.version} base={r.base_version} kind={r.kind} "
        f"bytes={r.payload_bytes} digest_match={r.digest_match}"
        for i, r in enumerate(history)
    ]


__all__ = [
    "SUPPORTED_TRL",
    "AgentrollRolloutWorker",
    "AgentrollWeightTransfer",
    "PushRecord",
    "VersionMap",
    "check_trl_contract",
    "digest_lines",
    "engine_state",
    "sampled_min_version",
    "trajectory_sample",
]
