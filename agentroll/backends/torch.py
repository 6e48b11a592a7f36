"""The built-in engine behind the async Backend protocol (the embedded default backend).

Invariants: one stepper task owns the engine; every engine call happens either inside a
step (on the backend's single worker thread) or on the event loop while no step is in
flight, so requests are never mutated concurrently; ``pause`` returns only after the step in
flight has finished, i.e. at a token boundary; a cancelled ``generate`` aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from agentroll.backends.base import Backend, GenerationChunk, GenerationRequest, ResumePolicy
from agentroll.chat import ChatTokenizer
from agentroll.errors import BackendError

logger = logging.getLogger("agentroll.backends.torch")


class _Rollback:
    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


class TorchBackend(Backend):
    """``TorchBackend(EngineConfig(model=DIR))`` or ``TorchBackend(DIR, dtype=..., ...)``."""

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
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        self._commands: list[tuple[str, Any]] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._paused = False
        self._policy: ResumePolicy = "keep"
        self._failure: BaseException | None = None

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
        for queue in self._streams.values():
            queue.put_nowait(BackendError("the torch backend was closed"))
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
                self._apply_commands()
                if self._paused or not engine.has_work():
                    self._wake.clear()
                    continue
                self._idle.clear()
                try:
                    outputs = await asyncio.shield(
                        loop.run_in_executor(self._executor, engine.step)
                    )
                finally:
                    self._idle.set()
                for out in outputs:
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                # Let the consumers take their tokens before the next step: run concurrently,
                # their Python would fight the step's Python for the GIL and slow both.
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the engine itself broke: fail every stream
            logger.exception("torch engine step failed")
            self._failure = exc
            for queue in self._streams.values():
                queue.put_nowait(BackendError(f"engine step failed: {type(exc).__name__}: {exc}"))

    def _apply_commands(self) -> None:
        commands, self._commands = self._commands, []
        for op, arg in commands:
            if op == "add":
                request: GenerationRequest = arg
                try:
                    self.engine.add_request(
                        request.request_id, list(request.prompt_ids), request.sampling
                    )
                except ValueError as exc:
                    queue = self._streams.get(request.request_id)
                    if queue is not None:
                        queue.put_nowait(BackendError(str(exc)))
            elif op == "abort":
                self.engine.abort(arg)
            elif op == "restore":
                snap, queue = arg
                try:
                    self.engine.restore(snap)
                except ValueError as exc:
                    queue.put_nowait(BackendError(str(exc)))

    def _submit(self, op: str, arg: Any) -> None:
        self._commands.append((op, arg))
        self._wake.set()

    # -- generation ------------------------------------------------------------------------

    def _open(self, request_id: str) -> asyncio.Queue[Any]:
        if self._stepper is None:
            raise BackendError("the torch backend is not started; use `async with backend:`")
        if self._failure is not None:
            raise BackendError(f"the torch engine failed earlier: {self._failure}")
        if request_id in self._streams:
            raise BackendError(f"request {request_id!r} is already streaming")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = queue
        return queue

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        queue = self._open(request.request_id)
        self._submit("add", request)
        async for chunk in self._stream(request.request_id, queue):
            yield chunk

    async def restore(self, snapshot: Any) -> AsyncIterator[GenerationChunk]:
        """Continue a request from a ``RequestSnapshot`` (taken here or in another process);
        yields the tokens sampled after the snapshot."""
        queue = self._open(snapshot.request_id)
        self._submit("restore", (snapshot, queue))
        async for chunk in self._stream(snapshot.request_id, queue):
            yield chunk

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[Any]
    ) -> AsyncIterator[GenerationChunk]:
        finished = False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                chunk: GenerationChunk | None = None
                for item in items:
                    if isinstance(item, BaseException):
                        finished = True
                        raise item
                    if isinstance(item, _Rollback):
                        if chunk is not None:
                            yield chunk
                        chunk = GenerationChunk(
                            token_ids=[],
                            logprobs=[],
                            policy_version=self.policy_version,
                            kv_version=self.policy_version,
                            rollback=item.n,
                        )
                        continue
                    if item.error is not None:
                        finished = True
                        raise BackendError(f"request {request_id!r} refused: {item.error}")
                    if (
                        chunk is not None
                        and (
                            chunk.policy_version != item.policy_version
                            or chunk.kv_version != item.kv_version
                        )
                        and chunk.token_ids
                    ):
                        yield chunk
                        chunk = None
                    if chunk is None:
                        chunk = GenerationChunk(
                            token_ids=[],
                            logprobs=[],
                            policy_version=item.policy_version,
                            kv_version=item.kv_version,
                        )
                    elif not chunk.token_ids:  # a rollback chunk takes the versions of what follows
                        chunk.policy_version, chunk.kv_version = (
                            item.policy_version,
                            item.kv_version,
                        )
                    chunk.token_ids.append(item.token_id)
                    chunk.logprobs.append(item.logprob)
                    if item.finish_reason is not None:
                        chunk.finish_reason = item.finish_reason
                        finished = True
                        break
                if chunk is not None:
                    yield chunk
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._stepper is not None:
                self._submit("abort", request_id)

    # -- pause / resume / weights / snapshots -----------------------------------------------

    async def pause(self, policy: ResumePolicy = "keep") -> None:
        """Stop at a token boundary: waits for the step in flight, then pauses every request
        (keeping its KV).  ``policy`` is applied at ``resume``."""
        if policy not in ("keep", "recompute", "restart"):
            raise ValueError(f"unknown resume policy {policy!r}; use keep, recompute or restart")
        self._paused = True
        self._policy = policy
        await self._idle.wait()
        self._apply_commands()
        self.engine.pause_all()

    async def resume(self) -> None:
        """Continue every paused request under the policy given to ``pause``."""
        if not self._paused:
            return
        rollback = self.engine.resume_all(self._policy)
        for request_id, n in rollback.items():
            queue = self._streams.get(request_id)
            if queue is not None and n:
                queue.put_nowait(_Rollback(n))
        self._paused = False
        self._wake.set()

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
        loop = asyncio.get_running_loop()
        return int(
            await loop.run_in_executor(
                self._executor, lambda: self.engine.load_weights(weights, version=version)
            )
        )

    async def snapshot(self, request_id: str, *, with_kv: bool = True) -> Any:
        """A ``RequestSnapshot`` of a request, taken while paused."""
        self._require_paused("snapshot")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, lambda: self.engine.snapshot(request_id, with_kv=with_kv)
        )

    async def score(self, token_ids: list[int]) -> list[float]:
        """Logprobs of ``token_ids[1:]`` from a fresh prefill under the current weights, run
        on the engine's thread (so with the engine's kernels and thread settings)."""
        loop = asyncio.get_running_loop()
        return list(await loop.run_in_executor(self._executor, self.engine.score, token_ids))

    async def abort(self, request_id: str) -> None:
        """Drop a request (its stream ends with ``finish_reason='abort'``)."""
        queue = self._streams.get(request_id)
        if self._paused:
            self.engine.abort(request_id)
        else:
            self._submit("abort", request_id)
        if queue is not None:
            from agentroll.engine.engine import StepOutput

            queue.put_nowait(
                StepOutput(request_id, None, float("nan"), self.policy_version, -1, "abort")
            )
