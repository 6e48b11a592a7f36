"""A replica whose ``TorchBackend`` lives in a Ray actor (DESIGN.md "Fleet").

Invariants: ray is imported only when a ``RayReplica`` is made; a dead actor surfaces as
``ReplicaDown`` from every call, streams in flight included, and the replica is never used
again; a stream the client stops consuming is aborted in the actor; ``version`` changes only
with the results of ``start``/``apply``/``swap``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec

from agentroll.backends.base import GenerationChunk, GenerationRequest, ResumePolicy
from agentroll.errors import BackendError, ConfigError, require
from agentroll.fleet.replica import Replica, ReplicaDown
from agentroll.types import SleepReport, WakeReport

if TYPE_CHECKING:
    from agentroll.weights.update import WeightUpdate

# A graceful stop that takes longer than this is cut short by killing the actor.
_STOP_TIMEOUT_S = 10.0
# Stream ids remembered from closes that found no stream (see ``_ReplicaHost``).
_MAX_CLOSED_EARLY = 4096

# (chunks, done, error): what one ``take`` returns.
_Batch = tuple[list[GenerationChunk], bool, str | None]


def _merge(chunks: list[GenerationChunk]) -> list[GenerationChunk]:
    """Join consecutive chunks of equal versions (fewer objects to pickle); a rollback
    chunk starts a new one, since it applies before its own tokens."""
    out: list[GenerationChunk] = []
    for chunk in chunks:
        last = out[-1] if out else None
        if (
            last is not None
            and chunk.rollback == 0
            and last.finish_reason is None
            and (last.policy_version, last.kv_version) == (chunk.policy_version, chunk.kv_version)
        ):
            last.token_ids.extend(chunk.token_ids)
            last.logprobs.extend(chunk.logprobs)
            last.finish_reason = chunk.finish_reason
        else:
            out.append(chunk)
    return out


def _compact(snapshot: Any) -> Any:
    """``snapshot`` with tensors that own exactly their bytes: pickling a view (``snapshot_many``
    slices one gather, ``truncated`` slices blocks) would carry the whole tensor it views."""
    import torch

    changes = {}
    for name in ("k", "v"):
        t = getattr(snapshot, name)
        if t is not None and t.untyped_storage().nbytes() != t.numel() * t.element_size():
            changes[name] = t.clone(memory_format=torch.contiguous_format)
    return msgspec.structs.replace(snapshot, **changes) if changes else snapshot


class _Pump:
    """The chunks of one request waiting in the actor for the client's next ``take``."""

    __slots__ = ("chunks", "done", "error", "stream_id", "task", "waiter")

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self.chunks: list[GenerationChunk] = []
        self.done = False
        self.error: str | None = None
        self.task: asyncio.Task[None] | None = None
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


async def _run_pump(pump: _Pump, stream: AsyncIterator[GenerationChunk]) -> None:
    # cancelled by ``close_stream``: the cancellation reaches the backend's generator, which
    # aborts the request
    try:
        async for chunk in stream:
            pump.chunks.append(chunk)
            pump.wake()
    except Exception as exc:
        pump.error = str(exc) or type(exc).__name__
    finally:
        pump.done = True
        pump.wake()


async def _cancel_pump(pump: _Pump) -> None:
    if pump.task is not None and not pump.task.done():
        pump.task.cancel()
        await asyncio.wait([pump.task])
    pump.done = True
    pump.wake()


class _ReplicaHost:
    """The actor: a ``TorchBackend`` and the pumps of its streams (one event loop)."""

    def __init__(self, model_dir: str, overrides: dict[str, Any]) -> None:
        self._model_dir = model_dir
        self._overrides = overrides
        self._backend: Any = None
        self._pumps: dict[str, _Pump] = {}  # by request id
        # streams closed before their ``open`` ran (Ray may start a call whose large argument
        # is still in transfer after a later call); bounded, as a close may also come late
        self._closed_early: collections.OrderedDict[str, None] = collections.OrderedDict()

    async def start(self) -> int:
        from agentroll.backends.torch import TorchBackend

        if self._backend is None:
            backend = TorchBackend(self._model_dir, **self._overrides)
            await backend.start()
            self._backend = backend
        return int(self._backend.policy_version)

    def _live(self) -> Any:
        if self._backend is None:
            raise BackendError("the replica's backend is not started (or was stopped)")
        return self._backend

    # -- streams ---------------------------------------------------------------------------

    async def open(self, request: GenerationRequest, stream_id: str) -> _Batch:
        """Start generating ``request`` as stream ``stream_id`` (unique per call); returns
        its first batch of chunks."""
        generate = self._live().generate
        return await self._open(request.request_id, stream_id, lambda: generate(request))

    async def open_restore(self, snapshot: Any, stream_id: str) -> _Batch:
        """Continue a request from a ``RequestSnapshot``; returns its first batch."""
        restore = self._live().restore
        return await self._open(snapshot.request_id, stream_id, lambda: restore(snapshot))

    async def _open(self, request_id: str, stream_id: str, make: Any) -> _Batch:
        if stream_id in self._closed_early:
            del self._closed_early[stream_id]
            return [], True, None
        if request_id in self._pumps:
            raise BackendError(f"request {request_id!r} is already streaming on this replica")
        pump = self._pumps[request_id] = _Pump(stream_id)
        pump.task = asyncio.create_task(_run_pump(pump, make()), name=f"pump-{request_id}")
        return await self.take(request_id, stream_id)

    async def take(self, request_id: str, stream_id: str) -> _Batch:
        """Every chunk buffered for the stream, waiting until there is one or the stream
        ended; ``done`` is True with the last batch (``error`` set if the stream failed)."""
        pump = self._pumps.get(request_id)
        if pump is None or pump.stream_id != stream_id:
            return [], True, f"request {request_id!r} is not streaming on this replica"
        while not pump.chunks and not pump.done:
            pump.waiter = asyncio.get_running_loop().create_future()
            await pump.waiter
        chunks, pump.chunks = pump.chunks, []
        if pump.done and self._pumps.get(request_id) is pump:
            del self._pumps[request_id]
        return _merge(chunks), pump.done, pump.error

    async def close_stream(self, request_id: str, stream_id: str) -> None:
        """The client stopped consuming: abort the request and drop its buffer."""
        pump = self._pumps.get(request_id)
        if pump is None or pump.stream_id != stream_id:
            self._closed_early[stream_id] = None
            while len(self._closed_early) > _MAX_CLOSED_EARLY:
                self._closed_early.popitem(last=False)
            return
        del self._pumps[request_id]
        await _cancel_pump(pump)

    # -- control ---------------------------------------------------------------------------

    async def pause(self) -> None:
        await self._live().pause("keep")

    async def resume(self, policies: Mapping[str, ResumePolicy] | None) -> None:
        await self._live().resume(policies)

    async def apply(self, update: WeightUpdate) -> int:
        backend = self._live()
        await backend.apply(update)
        return int(backend.policy_version)

    async def snapshot(self, request_id: str, with_kv: bool) -> Any:
        return _compact(await self._live().snapshot(request_id, with_kv=with_kv))

    async def snapshot_many(self, request_ids: list[str], with_kv: bool) -> dict[str, Any]:
        snaps = await self._live().snapshot_many(request_ids, with_kv=with_kv)
        return {rid: _compact(snap) for rid, snap in snaps.items()}

    async def abort(self, request_id: str) -> None:
        await self._live().abort(request_id)

    async def inflight(self) -> dict[str, int]:
        return dict(self._live().inflight())

    async def stage(self, update: WeightUpdate, max_bytes: int | None) -> None:
        await self._live().stage(update, max_bytes=max_bytes)

    async def swap(self) -> int:
        return int(await self._live().swap())

    async def sleep(self, level: int, policies: Mapping[str, ResumePolicy] | None) -> Any:
        return await self._live().sleep(level, policy="keep", policies=policies)

    async def wake(
        self,
        update: WeightUpdate | None,
        fallback: bool,
        policies: Mapping[str, ResumePolicy] | None,
    ) -> tuple[Any, int]:
        backend = self._live()
        report = await backend.wake(update, fallback=fallback, policies=policies)
        return report, int(backend.policy_version)

    async def busy_seconds(self) -> float:
        return float(self._live().busy_seconds)

    async def steps(self) -> int:
        return int(self._live().steps)

    async def generating_seconds(self) -> float:
        return float(self._live().generating_seconds)

    async def stop(self) -> None:
        """Close the backend; every open stream ends with an error."""
        backend, self._backend = self._backend, None
        if backend is not None:
            await backend.close()
        for pump in list(self._pumps.values()):
            if pump.error is None and not pump.done:
                pump.error = "the replica was closed"
            await _cancel_pump(pump)


@functools.cache
def _actor_class(ray: Any) -> Any:
    return ray.remote(_ReplicaHost)


class RayReplica(Replica):
    """``RayReplica(model_dir, name="ray-0", num_cpus=1, **engine_overrides)``: a
    ``TorchBackend(model_dir, **engine_overrides)`` in a Ray actor.

    ``num_cpus``/``num_gpus`` and ``actor_options`` (any other ``ActorClass.options``, e.g.
    ``scheduling_strategy``) place the actor.  The caller connects to Ray first
    (``ray.init(...)``); ``start`` creates the actor and returns once the model is loaded.

    Raises ``MissingDependencyError`` (an ``ImportError``) when ray is not installed.

    ``RayReplica`` is the client half, in the fleet's process; ``_ReplicaHost`` is the actor
    half, holding the backend in the actor's event loop.  A stream runs as a pump task in the
    actor that buffers the backend's chunks per request; the client fetches them with ``take``
    calls, one in flight at a time, each returning every chunk buffered so far.  An error
    raised by a call in the actor is re-raised as itself, a stream's error as ``BackendError``
    with its message; snapshots cross processes with tensors that own their bytes (no view
    drags a larger tensor along).
    """

    def __init__(
        self,
        model_dir: str | Path,
        name: str = "ray-0",
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        actor_options: Mapping[str, Any] | None = None,
        **engine_overrides: Any,
    ) -> None:
        self._ray = require("ray", "ray")
        self.model_dir = str(model_dir)
        self.name = name
        self.engine_overrides = dict(engine_overrides)
        self.actor_options: dict[str, Any] = {
            "num_cpus": num_cpus,
            "num_gpus": num_gpus,
            **(actor_options or {}),
        }
        self.actor: Any = None  # the actor handle, once started
        self._version = 0
        self._dead: str | None = None
        self._closed = False

    @property
    def version(self) -> int:
        return self._version

    @property
    def supports_snapshots(self) -> bool:
        return True

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the actor and load the model in it.  Raises ``ConfigError`` when Ray is not
        initialised, the backend's error when the model cannot be loaded (the actor is then
        killed), ``ReplicaDown`` when the actor dies while starting."""
        ray = self._ray
        if self.actor is not None:
            return
        if self._closed:
            raise BackendError(f"replica {self.name} was closed; make a new one")
        if not ray.is_initialized():
            raise ConfigError(
                "Ray is not initialised: call ray.init() (or ray.init(address=...) to join a "
                "running cluster) before starting a RayReplica"
            )
        self.actor = (
            _actor_class(ray)
            .options(**self.actor_options)
            .remote(self.model_dir, self.engine_overrides)
        )
        try:
            self._version = int(await self._call("start"))
        except BaseException:
            actor, self.actor = self.actor, None
            ray.kill(actor, no_restart=True)
            raise

    async def close(self) -> None:
        """Stop the backend (streams in flight fail with ``BackendError``) and kill the
        actor.  Idempotent; never raises for a dead actor."""
        actor, self.actor = self.actor, None
        self._closed = True
        if actor is None:
            return
        ray = self._ray
        if not ray.is_initialized():
            return  # the cluster, and the actor with it, is gone
        try:
            if self._dead is None:
                await asyncio.wait_for(actor.stop.remote(), _STOP_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # the actor is killed below either way
        finally:
            ray.kill(actor, no_restart=True)

    def kill(self, reason: str = "killed") -> None:
        """Fault injection: kill the actor (``ray.kill``); every call from now on raises
        ``ReplicaDown``, streams in flight included."""
        if self._dead is None:
            self._dead = reason
        if self.actor is not None and self._ray.is_initialized():
            self._ray.kill(self.actor, no_restart=True)

    # -- calls -----------------------------------------------------------------------------

    def _check(self) -> None:
        if self._dead is None and self.actor is not None and not self._ray.is_initialized():
            self._dead = "ray was shut down"  # and a call would start a new cluster
        if self._dead is not None:
            raise ReplicaDown(f"replica {self.name} is down ({self._dead})")
        if self.actor is None:
            state = "closed" if self._closed else "not started; await replica.start() first"
            raise BackendError(f"replica {self.name} is {state}")

    async def _await(self, ref: Any) -> Any:
        """The result of an actor call; Ray's errors translated: a dead actor becomes
        ``ReplicaDown``, an error raised in the actor is re-raised as itself."""
        errors = self._ray.exceptions
        try:
            return await ref
        except errors.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, Exception):
                raise cause from exc
            raise BackendError(f"replica {self.name} failed: {exc}") from exc
        except (
            errors.RayActorError,  # ActorDiedError, ActorUnavailableError
            errors.WorkerCrashedError,
            errors.NodeDiedError,
            errors.LocalRayletDiedError,
            errors.ObjectLostError,
        ) as exc:
            if self._dead is None:
                self._dead = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise ReplicaDown(f"replica {self.name} is down ({self._dead})") from exc
        except errors.RayError as exc:
            raise BackendError(f"replica {self.name}: {type(exc).__name__}: {exc}") from exc

    async def _call(self, method: str, *args: Any) -> Any:
        self._check()
        return await self._await(getattr(self.actor, method).remote(*args))

    # -- streams ---------------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream ``request``'s tokens from the actor.  Raises ``ReplicaDown`` if the actor
        dies, ``BackendError`` with the actor's message if the stream fails there; closing
        or cancelling the iterator aborts the request in the actor."""
        return self._stream("open", request, request.request_id)

    def restore(self, snapshot: Any) -> AsyncIterator[GenerationChunk]:
        """Continue a request from a ``RequestSnapshot`` (taken on any replica)."""
        return self._stream("open_restore", _compact(snapshot), snapshot.request_id)

    async def _stream(
        self, method: str, arg: Any, request_id: str
    ) -> AsyncIterator[GenerationChunk]:
        self._check()
        actor = self.actor
        stream_id = uuid.uuid4().hex
        done = closing = False
        try:
            try:
                batch = await self._await(getattr(actor, method).remote(arg, stream_id))
            except (asyncio.CancelledError, ReplicaDown):
                raise
            except BaseException:
                done = True  # refused: there is no stream to close
                raise
            while True:
                chunks, done, error = batch
                # the next batch is fetched while this one is consumed
                ref = None if done else actor.take.remote(request_id, stream_id)
                for chunk in chunks:
                    self._check()
                    try:
                        yield chunk
                    except GeneratorExit:
                        closing = True
                        raise
                if error is not None:
                    raise BackendError(f"replica {self.name}: {error}")
                if ref is None:
                    return
                batch = await self._await(ref)
        finally:
            if not done and self._dead is None and self.actor is actor:
                ref = actor.close_stream.remote(request_id, stream_id)
                # aclose() returns once the actor dropped the request (as a local backend's
                # does); a cancelled stream does not wait
                if closing:
                    with contextlib.suppress(BackendError):
                        await self._await(ref)

    # -- control ---------------------------------------------------------------------------

    async def pause(self) -> None:
        await self._call("pause")

    async def resume(self, policies: Mapping[str, ResumePolicy] | None = None) -> None:
        await self._call("resume", None if policies is None else dict(policies))

    async def apply(self, update: WeightUpdate) -> int:
        self._version = int(await self._call("apply", update))
        return self._version

    async def snapshot(self, request_id: str, *, with_kv: bool = True) -> Any:
        return await self._call("snapshot", request_id, with_kv)

    async def snapshot_many(
        self, request_ids: list[str], *, with_kv: bool = True
    ) -> dict[str, Any]:
        """Snapshots of the unfinished ones among ``request_ids`` (paused), in one call."""
        return dict(await self._call("snapshot_many", list(request_ids), with_kv))

    async def abort(self, request_id: str) -> None:
        if self._dead is not None or self.actor is None:
            return  # nothing runs there any more
        with contextlib.suppress(ReplicaDown):
            await self._call("abort", request_id)

    async def inflight(self) -> dict[str, int]:
        return dict(await self._call("inflight"))

    async def stage(self, update: WeightUpdate, *, max_bytes: int | None = None) -> None:
        await self._call("stage", update, max_bytes)

    async def swap(self) -> int:
        self._version = int(await self._call("swap"))
        return self._version

    async def sleep(
        self, level: int = 1, policies: Mapping[str, ResumePolicy] | None = None
    ) -> SleepReport:
        return cast(
            SleepReport,
            await self._call("sleep", level, None if policies is None else dict(policies)),
        )

    async def wake(
        self,
        update: WeightUpdate | None = None,
        *,
        fallback: bool = False,
        policies: Mapping[str, ResumePolicy] | None = None,
    ) -> WakeReport:
        report, version = await self._call(
            "wake", update, fallback, None if policies is None else dict(policies)
        )
        self._version = int(version)
        return cast(WakeReport, report)

    async def busy_seconds(self) -> float:
        return float(await self._call("busy_seconds"))

    async def steps(self) -> int:
        return int(await self._call("steps"))

    async def generating_seconds(self) -> float:
        return float(await self._call("generating_seconds"))


@contextlib.contextmanager
def local_cluster(num_cpus: int = 4, object_store_mb: int = 200) -> Any:
    """A Ray cluster on this machine for tests and benchmarks: every server bound to
    127.0.0.1, token authentication with a token kept in this process's environment
    (nothing written to ~/.ray), no usage stats, no dashboard, files under a fresh /tmp
    directory removed afterwards.  Yields the ``ray`` module; shuts the cluster down."""
    import os
    import secrets
    import shutil
    import tempfile

    saved = {k: os.environ.get(k) for k in _CLUSTER_ENV}
    # read when ray is imported: bind to loopback instead of the host's address
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # ray.init turns token authentication on; with a token here it writes none to ~/.ray
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    os.environ.pop("RAY_AUTH_MODE", None)
    temp_dir = tempfile.mkdtemp(prefix="agentroll-ray-")
    try:
        ray = require("ray", "ray")
        from ray._private import ray_constants

        # ray may have been imported before the variable was set
        saved_flag = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
        ray_constants.ENABLE_RAY_CLUSTER = False
        if ray.is_initialized():
            raise ConfigError("a Ray cluster is already connected; local_cluster() starts its own")
        try:
            ray.init(
                num_cpus=num_cpus,
                object_store_memory=object_store_mb * 2**20,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                _temp_dir=temp_dir,
            )
            yield ray
        finally:
            ray.shutdown()
            if saved_flag is not None:
                ray_constants.ENABLE_RAY_CLUSTER = saved_flag
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_CLUSTER_ENV = (
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    "RAY_USAGE_STATS_ENABLED",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_MODE",
)


__all__ = ["RayReplica", "local_cluster"]
