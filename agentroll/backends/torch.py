"""The built-in engine behind the async Backend protocol (the embedded default backend).

Invariants: one stepper task owns the engine and requests are never mutated concurrently;
``pause`` returns only after the step in flight has finished, i.e. at a token boundary; a
cancelled ``generate`` aborts its request; KV blocks held for a request moved to another
engine are neither written nor reused until its ``release`` has run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentroll.backends.base import (
    Backend,
    GenerationChunk,
    GenerationRequest,
    ReportsBusy,
    ReportsInflight,
    ResumePolicy,
    SupportsAbort,
    SupportsSleep,
    SupportsSnapshotMany,
    SupportsStaging,
    check_sleep,
    check_wake,
)
from agentroll.chat import ChatTokenizer
from agentroll.errors import BackendError
from agentroll.types import SleepReport, WakeReport

if TYPE_CHECKING:
    from agentroll.engine.snapshot import RequestSnapshot
    from agentroll.weights.update import WeightUpdate

logger = logging.getLogger("agentroll.backends.torch")


class _Rollback:
    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


class _Stream:
    """The outputs of one request waiting for its consumer (lighter than an asyncio.Queue:
    one list and at most one pending future)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self) -> list[Any]:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        items, self.items = self.items, []
        return items


class TorchBackend(
    Backend,
    SupportsSnapshotMany,
    SupportsStaging,
    SupportsSleep,
    SupportsAbort,
    ReportsInflight,
    ReportsBusy,
):
    """``TorchBackend(EngineConfig(model=DIR))`` or ``TorchBackend(DIR, dtype=..., ...)``.

    Every engine call happens either inside a step (on the backend's single worker thread) or
    on the event loop while no step is in flight.  One read crosses threads: another engine in
    this process, restoring a request moved from here, reads the KV blocks held for it
    (``snapshot_many(hold_kv=True)``), which nothing here writes or reuses until the
    ``release`` command it queues has run.
    """

    tokenizer: ChatTokenizer  # always known: the model directory holds it

    name = "torch"

    def __init__(self, config: Any, **overrides: Any) -> None:
        from agentroll.engine.engine import EngineConfig

        if isinstance(config, str | Path):
            config = EngineConfig(model=str(config), **overrides)
        elif overrides:
            import msgspec

            config = msgspec.structs.replace(config, **overrides)
        self.config = config
        self.tokenizer = ChatTokenizer.from_pretrained(config.model)
        self.engine: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._stepper: asyncio.Task[None] | None = None
        self._streams: dict[str, _Stream] = {}
        self._commands: list[tuple[str, Any]] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._paused = False
        self._policy: ResumePolicy = "keep"
        self._failure: BaseException | None = None
        self._busy = 0.0  # wall time spent in finished engine steps
        self._step_t0: float | None = None
        self._generating = 0.0  # wall time serving requests: not paused, work in the engine
        self._gen_since: float | None = None
        self.steps = 0
        self._staged: Any = None
        self._updating = 0  # weight updates in progress (apply, load, stage, swap)
        self._sleep_policies: dict[str, ResumePolicy] = {}
        self._sleep_paused = False  # the caller had paused before sleep: wake leaves it so
        self.spill_dir: str | None = None  # where a CPU engine parks weights at level 2

    @property
    def policy_version(self) -> int:
        return 0 if self.engine is None else int(self.engine.policy_version)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        from agentroll.engine.engine import LLMEngine

        if self._stepper is not None:
            return
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="agentroll-engine")
        loop = asyncio.get_running_loop()
        self.engine = await loop.run_in_executor(self._executor, LLMEngine, self.config)
        self._stepper = asyncio.create_task(self._run(), name="agentroll-torch-stepper")

    async def close(self) -> None:
        stepper, self._stepper = self._stepper, None
        if stepper is not None:
            stepper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stepper
        for stream in self._streams.values():
            stream.put_nowait(BackendError("the torch backend was closed"))
        sleep = getattr(self.engine, "_sleep", None)
        if sleep is not None and sleep.weights is not None:
            sleep.weights.discard()  # its spill file
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # -- the stepper -----------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        try:
            while True:
                await self._wake.wait()
                if self._paused or not (self._commands or engine.has_work()):
                    self._stop_generating()
                    self._wake.clear()
                    continue
                if self._gen_since is None:
                    self._gen_since = time.perf_counter()
                # Commands (new requests, restores with their KV, aborts) run on the engine
                # thread with the step: a restore of many migrated requests must not block
                # the event loop that every other replica and episode shares.
                commands = self._take_commands()
                self._idle.clear()
                self._step_t0 = t0 = time.perf_counter()
                try:
                    errors, outputs = await asyncio.shield(
                        loop.run_in_executor(self._executor, self._work, commands)
                    )
                finally:
                    self._busy += time.perf_counter() - t0
                    self._step_t0 = None
                    self.steps += 1
                    self._idle.set()
                self._deliver_errors(errors)
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put_nowait(out)
                # Let the consumers take their tokens before the next step: run concurrently,
                # their Python would fight the step's Python for the GIL and slow both.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the engine itself broke: fail every stream
            logger.exception("torch engine step failed")
            self._failure = exc
            for stream in self._streams.values():
                stream.put_nowait(BackendError(f"engine step failed: {type(exc).__name__}: {exc}"))

    def _take_commands(self) -> list[tuple[str, Any]]:
        """The queued commands for the next hand-off, in order, up to the first restore that
        makes their KV tokens exceed ``restore_tokens_per_call`` (at least one restore); the
        rest stay queued, and ``_work`` then hands back after one step."""
        commands = self._commands
        budget = self.engine.config.restore_tokens_per_call
        for i, (op, arg) in enumerate(commands):
            if op != "restore":
                continue
            budget -= arg.num_computed_tokens if arg.has_kv else 0
            if budget < 0 and i > 0:
                self._commands = commands[i:]
                return commands[:i]
        self._commands = []
        return commands

    def _work(self, commands: list[tuple[str, Any]]) -> tuple[list[tuple[str, str]], list[Any]]:
        """On the engine thread: apply ``commands``, then step while there is work, up to
        ``steps_per_call`` steps and ``max_call_s`` seconds.  Whatever the event loop queued
        meanwhile (a pause, a command, a close) ends the run after the step in flight: only
        flags are read here, so nothing is mutated across threads."""
        errors = self._apply(commands)
        engine, config = self.engine, self.config
        outputs: list[Any] = []
        deadline = time.perf_counter() + config.max_call_s
        for _ in range(config.steps_per_call):
            if not engine.has_work():
                break
            outputs += engine.step()
            if (
                self._paused
                or self._commands
                or self._stepper is None
                or time.perf_counter() >= deadline
            ):
                break
        return errors, outputs

    def _apply(self, commands: list[tuple[str, Any]]) -> list[tuple[str, str]]:
        """Apply queued commands to the engine; returns (request id, error) of refused ones
        (delivered on the event loop: streams are not thread-safe)."""
        errors: list[tuple[str, str]] = []
        for op, arg in commands:
            try:
                if op == "add":
                    request: GenerationRequest = arg
                    self.engine.add_request(
                        request.request_id, list(request.prompt_ids), request.sampling
                    )
                elif op == "abort":
                    self.engine.abort(arg)
                elif op == "restore":
                    self.engine.restore(arg)
                elif op == "release":
                    self.engine.release_blocks(arg)
            except ValueError as exc:
                if op == "release":  # nobody waits on it: a bug to see in the log
                    logger.error("releasing held KV blocks failed: %s", exc)
                    continue
                rid = arg.request_id if op in ("add", "restore") else str(arg)
                errors.append((rid, str(exc)))
        return errors

    def _deliver_errors(self, errors: list[tuple[str, str]]) -> None:
        for rid, message in errors:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put_nowait(BackendError(message))

    def _apply_commands(self) -> None:
        """Apply queued commands on the event loop (only while no step is in flight)."""
        commands, self._commands = self._commands, []
        self._deliver_errors(self._apply(commands))

    def _submit(self, op: str, arg: Any) -> None:
        self._commands.append((op, arg))
        self._wake.set()

    # -- generation ------------------------------------------------------------------------

    def _open(self, request_id: str) -> _Stream:
        if self._stepper is None:
            raise BackendError("the torch backend is not started; use `async with backend:`")
        if self._failure is not None:
            raise BackendError(f"the torch engine failed earlier: {self._failure}")
        if request_id in self._streams:
            raise BackendError(f"request {request_id!r} is already streaming")
        stream = _Stream()
        self._streams[request_id] = stream
        return stream

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        stream = self._open(request.request_id)
        self._submit("add", request)
        async for chunk in self._stream(request.request_id, stream):
            yield chunk

    async def restore(self, snapshot: RequestSnapshot) -> AsyncIterator[GenerationChunk]:
        """Continue a request from a ``RequestSnapshot`` (taken here or in another process);
        yields the tokens sampled after the snapshot."""
        stream = self._open(snapshot.request_id)
        self._submit("restore", snapshot)
        async for chunk in self._stream(snapshot.request_id, stream):
            yield chunk

    async def _stream(self, request_id: str, stream: _Stream) -> AsyncIterator[GenerationChunk]:
        finished = False
        try:
            while not finished:
                items = await stream.take()
                for chunk in self._chunks(request_id, items):
                    finished = chunk.finish_reason is not None
                    yield chunk
        finally:
            # a request that ended in error is already gone: its abort is a no-op
            self._streams.pop(request_id, None)
            if not finished and self._stepper is not None:
                self._submit("abort", request_id)

    def _chunks(self, request_id: str, items: list[Any]) -> list[GenerationChunk]:
        """Group step outputs into chunks of equal (policy_version, kv_version); raises the
        error an item carries."""
        out: list[GenerationChunk] = []
        chunk: GenerationChunk | None = None
        for item in items:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, _Rollback):
                version = self.policy_version
                chunk = GenerationChunk(
                    token_ids=[],
                    logprobs=[],
                    policy_version=version,
                    kv_version=version,
                    rollback=item.n,
                )
                out.append(chunk)
                continue
            if item.error is not None:
                raise BackendError(f"request {request_id!r} refused: {item.error}")
            versions = (item.policy_version, item.kv_version)
            if chunk is None or (
                chunk.token_ids and (chunk.policy_version, chunk.kv_version) != versions
            ):
                chunk = GenerationChunk(
                    token_ids=[], logprobs=[], policy_version=versions[0], kv_version=versions[1]
                )
                out.append(chunk)
            elif not chunk.token_ids:  # a rollback chunk takes the versions of what follows
                chunk.policy_version, chunk.kv_version = versions
            fault = self.config.test_fault
            if item.token_id is not None and not (
                fault == "drop_last_token" and item.finish_reason is not None
            ):
                chunk.token_ids.append(item.token_id)
                chunk.logprobs.append(
                    item.logprob + 1e-3 if fault == "perturb_logprobs" else item.logprob
                )
            if item.finish_reason is not None:
                chunk.finish_reason = item.finish_reason
                break
        return out

    # -- pause / resume / weights / snapshots -----------------------------------------------

    async def pause(self, policy: ResumePolicy = "keep") -> None:
        """Stop at a token boundary: waits for the step in flight, then pauses every request
        (keeping its KV).  ``policy`` is applied at ``resume``."""
        if policy not in ("keep", "recompute", "restart"):
            raise ValueError(f"unknown resume policy {policy!r}; use keep, recompute or restart")
        if self.asleep:  # paused already; its requests are parked under the sleep's policies
            return
        self._paused = True
        self._policy = policy
        await self._idle.wait()
        self._stop_generating()
        self._apply_commands()
        self.engine.pause_all()

    async def resume(self, policies: Mapping[str, ResumePolicy] | None = None) -> None:
        """Continue every paused request under the policy given to ``pause``, or the one
        ``policies`` names for its request id."""
        if not self._paused:
            return
        if self.asleep:
            raise BackendError("the backend sleeps; `await backend.wake(...)` resumes it")
        rollback = self.engine.resume_all(self._policy, policies)
        for request_id, n in rollback.items():
            stream = self._streams.get(request_id)
            if stream is not None and n:
                stream.put_nowait(_Rollback(n))
        self._paused = False
        self._wake.set()

    @property
    def busy_seconds(self) -> float:
        """Wall time spent in engine steps so far, the step in flight included."""
        t0 = self._step_t0
        return self._busy + (time.perf_counter() - t0 if t0 is not None else 0.0)

    @property
    def generating_seconds(self) -> float:
        """Wall time spent serving requests so far: not paused, and the engine had requests
        (steps, and the scheduling between back-to-back steps)."""
        since = self._gen_since
        return self._generating + (time.perf_counter() - since if since is not None else 0.0)

    def _stop_generating(self) -> None:
        if self._gen_since is not None:
            self._generating += time.perf_counter() - self._gen_since
            self._gen_since = None

    @property
    def paused(self) -> bool:
        return self._paused

    def inflight(self) -> dict[str, int]:
        """Tokens generated so far by each unfinished request (exact while paused; parked
        requests of a sleeping engine included)."""
        return dict(self.engine.inflight())

    def _require_paused(self, what: str) -> None:
        if not self._paused:
            raise BackendError(
                f"{what} needs the backend paused; call `await backend.pause()` first"
            )

    async def load_weights(
        self, weights: dict[str, torch.Tensor] | str | Path, *, version: int | None = None
    ) -> int:
        """Load full weights in place while paused; returns the new policy version."""
        self._require_paused("load_weights")
        self._require_awake("load_weights")
        loop = asyncio.get_running_loop()
        with self._update():
            return int(
                await loop.run_in_executor(
                    self._executor, lambda: self.engine.load_weights(weights, version=version)
                )
            )

    async def apply(self, update: WeightUpdate) -> None:
        """Apply a ``WeightUpdate`` (full or delta) while paused; ``WeightSyncError`` leaves
        the weights and version unchanged."""
        self._require_paused("apply")
        self._require_awake("apply")
        loop = asyncio.get_running_loop()
        with self._update():
            await loop.run_in_executor(self._executor, self.engine.apply_update, update)

    def staging_bytes(self, update: WeightUpdate) -> int:
        """Memory a background ``stage`` of ``update`` needs."""
        return int(self.engine.weight_store().staging_bytes(update))

    async def stage(self, update: WeightUpdate, *, max_bytes: int | None = None) -> None:
        """Verify ``update`` into a second copy of the touched tensors while generation goes
        on (on a separate thread; the live weights are only read).  Refused with
        ``WeightSyncError`` when the copy needs more than ``max_bytes`` (default: the memory
        available on the weights' device, less 10%)."""
        from agentroll.errors import WeightSyncError

        need = self.staging_bytes(update)
        limit = available_bytes(self.engine.runner.device) if max_bytes is None else max_bytes
        if need > limit:
            raise WeightSyncError(
                f"a background update needs {need / 2**20:.1f} MiB for its second copy but "
                f"only {limit / 2**20:.1f} MiB may be used; use the pause or rolling strategy"
            )
        self._require_awake("stage")
        with self._update():
            self._staged = await asyncio.to_thread(self.engine.stage_update, update)

    async def swap(self) -> int:
        """Install the staged update at a token boundary (a pause of one memcpy); returns
        the new version.  In-flight requests keep their KV (``keep``)."""
        if self._staged is None:
            raise BackendError("nothing is staged; call `await backend.stage(update)` first")
        self._require_awake("swap")
        staged, self._staged = self._staged, None
        was_paused = self._paused
        if not was_paused:
            await self.pause("keep")
        try:
            loop = asyncio.get_running_loop()
            with self._update():
                return int(
                    await loop.run_in_executor(self._executor, self.engine.commit_staged, staged)
                )
        finally:
            if not was_paused:
                await self.resume()

    def _require_awake(self, what: str) -> None:
        if self.asleep:
            raise BackendError(
                f"{what} while the backend sleeps (level {self.asleep}); pass the update to "
                "`await backend.wake(update)`"
            )

    @contextlib.contextmanager
    def _update(self) -> Any:
        self._updating += 1
        try:
            yield
        finally:
            self._updating -= 1

    # -- sleep / wake ----------------------------------------------------------------------

    @property
    def asleep(self) -> int:
        """The sleep level: 0 awake, 1 KV cache released, 2 weights released as well."""
        return 0 if self.engine is None else int(self.engine.asleep)

    async def sleep(
        self,
        level: int = 1,
        *,
        policy: ResumePolicy | None = None,
        policies: Mapping[str, ResumePolicy] | None = None,
    ) -> SleepReport:
        """Release the KV cache (level 1), and the weights too (level 2), after pausing at a
        token boundary.  Requests in flight are parked: under ``keep`` (the default, or the
        policy of an earlier ``pause``) with a host copy of their KV, under ``recompute`` or
        ``restart`` without (re-prefilled or regenerated at wake); ``policies`` names it per
        request id.  Requests made while asleep wait for ``wake``.

        Raises ``BackendError``, changing nothing (a pause it made is undone), when asleep
        already, during a weight update, or while KV is held for requests moving away."""
        check_sleep(self.asleep, level, policy)
        if self._updating or self._staged is not None:
            raise BackendError(
                "a weight update is in progress on this backend; sleep once it has returned"
            )
        was_paused = self._paused
        if not was_paused:
            await self.pause(policy or "keep")
        elif policy is not None:
            self._policy = policy
        chosen = {rid: (policies or {}).get(rid, self._policy) for rid in self.engine.requests}
        keep = [rid for rid, p in chosen.items() if p == "keep"]
        loop = asyncio.get_running_loop()
        try:
            report: SleepReport = await loop.run_in_executor(
                self._executor,
                lambda: self.engine.sleep(level, keep_kv=keep, spill_dir=self.spill_dir),
            )
        except ValueError as exc:
            if not was_paused:
                await self.resume()
            raise BackendError(f"the backend cannot sleep now: {exc}") from exc
        self._sleep_policies = dict(policies or {})
        self._sleep_paused = was_paused
        self._stop_generating()
        return report

    async def wake(
        self,
        update: WeightUpdate | None = None,
        *,
        fallback: bool = False,
        policies: Mapping[str, ResumePolicy] | None = None,
    ) -> WakeReport:
        """Reallocate what ``sleep`` released, install ``update`` (full or delta, verified as
        ``apply`` does), restore the parked requests first in line and, unless the caller had
        paused before ``sleep``, resume them under the sleep's policies (``policies``
        overrides per request).  After level 2 an update is required, or ``fallback=True``
        to serve the last good weights.

        Raises ``BackendError`` when awake or an update is missing, ``WeightSyncError`` when
        the update is refused: the backend then still sleeps, nothing changed, and a
        second ``wake`` (another update, or ``fallback``) may follow."""
        from agentroll.errors import WeightSyncError

        check_wake(self.asleep, update, fallback)
        loop = asyncio.get_running_loop()
        try:
            with self._update():
                report: WakeReport = await loop.run_in_executor(
                    self._executor, lambda: self.engine.wake(update, fallback=fallback)
                )
        except WeightSyncError:
            raise
        except ValueError as exc:
            raise BackendError(f"the backend cannot wake: {exc}") from exc
        for rid, why in report.failed.items():
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put_nowait(BackendError(f"request {rid!r} {why}"))
        if report.fallback:
            logger.info(
                "the torch backend woke on its last good weights (version %d)", report.version
            )
        merged = {**self._sleep_policies, **(policies or {})}
        self._sleep_policies = {}
        if not self._sleep_paused:  # else the caller's own resume(...) decides
            await self.resume(merged)
        return report

    async def snapshot(self, request_id: str, *, with_kv: bool = True) -> RequestSnapshot:
        """A ``RequestSnapshot`` of a request, taken while paused."""
        self._require_paused("snapshot")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, lambda: self.engine.snapshot(request_id, with_kv=with_kv)
        )

    async def snapshot_many(
        self, request_ids: list[str], *, with_kv: bool = True, hold_kv: bool = False
    ) -> dict[str, RequestSnapshot]:
        """Snapshots of the unfinished ones among ``request_ids``, in one engine call.  With
        ``hold_kv`` their KV blocks are held here, not copied while paused: each snapshot's
        ``kv_hold`` is read by the engine (in this process) that restores it, then handed
        back to this one (at its next step boundary)."""
        self._require_paused("snapshot")
        engine = self.engine
        loop = asyncio.get_running_loop()

        def release(block_ids: list[int]) -> None:  # from any thread (a finalizer, too)
            with contextlib.suppress(RuntimeError):  # the loop is closed: the engine too
                loop.call_soon_threadsafe(self._submit, "release", block_ids)

        hold = release if hold_kv else None
        return await loop.run_in_executor(
            self._executor,
            lambda: engine.snapshot_many(request_ids, with_kv=with_kv, hold_kv=hold),
        )

    async def score(self, token_ids: list[int]) -> list[float]:
        """Logprobs of ``token_ids[1:]`` from a fresh prefill under the current weights, run
        on the engine's thread (so with the engine's kernels and thread settings)."""
        loop = asyncio.get_running_loop()
        return list(await loop.run_in_executor(self._executor, self.engine.score, token_ids))

    async def abort(self, request_id: str) -> None:
        """Drop a request (its stream ends with ``finish_reason='abort'``)."""
        stream = self._streams.get(request_id)
        if self._paused:
            self.engine.abort(request_id)
        else:
            self._submit("abort", request_id)
        if stream is not None:
            from agentroll.engine.engine import StepOutput

            stream.put_nowait(
                StepOutput(request_id, None, float("nan"), self.policy_version, -1, "abort")
            )


def available_bytes(device: Any) -> int:
    """Memory that may be used on ``device`` for a second copy of weights: 90% of what is
    free (CUDA: ``mem_get_info``; CPU: ``MemAvailable``)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free * 0.9)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * 0.9)
    except OSError:
        pass
    return 0
