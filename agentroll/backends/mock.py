"""A scripted backend for tests and overhead benchmarks.

Per request it returns the text or token ids a script gives (a list indexed by turn, or a
function of the request), with optional latency, split into chunks.  Invariants: the same
request gets the same tokens and logprobs; ``max_tokens`` truncates with finish ``length``;
``pause()`` holds every stream at a chunk boundary until ``resume()``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from agentroll.backends.base import Backend, GenerationChunk, GenerationRequest, ResumePolicy
from agentroll.chat import ChatTokenizer
from agentroll.errors import BackendError, ConfigError

if TYPE_CHECKING:
    from agentroll.weights.update import WeightUpdate


class MockResponse(msgspec.Struct, kw_only=True):
    """A scripted reply: ``text`` (tokenized, end-of-turn appended) or raw ``token_ids``."""

    text: str | None = None
    token_ids: list[int] | None = None
    add_eot: bool = True


ScriptItem = str | list[int] | MockResponse
Script = Sequence[ScriptItem] | Callable[[GenerationRequest], ScriptItem]


class MockBackend(Backend):
    """Scripted generation.  ``requests`` records every request when ``record`` is set."""

    name = "mock"

    def __init__(
        self,
        script: Script,
        *,
        tokenizer: ChatTokenizer | None = None,
        latency: float = 0.0,
        chunk_size: int = 0,
        policy_version: int = 0,
        record: bool = False,
    ) -> None:
        if not latency >= 0 or chunk_size < 0:
            raise ConfigError("latency and chunk_size must be >= 0")
        self.script = script
        self.tokenizer = tokenizer
        self.latency = latency
        self.chunk_size = chunk_size
        self._policy_version = policy_version
        self.record = record
        self.requests: list[GenerationRequest] = []
        self.events: list[tuple[str, Any]] = []
        self._running = asyncio.Event()
        self._running.set()
        self._encoded: dict[str, list[int]] = {}

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def set_policy_version(self, version: int) -> None:
        self._policy_version = version

    def _ids(self, request: GenerationRequest) -> list[int]:
        if callable(self.script):
            item = self.script(request)
        else:
            if not self.script:
                raise BackendError("MockBackend script is empty")
            item = self.script[min(request.turn_index, len(self.script) - 1)]
        if isinstance(item, str):
            item = MockResponse(text=item)
        if isinstance(item, list):
            return item
        if item.token_ids is not None:
            return list(item.token_ids)
        if self.tokenizer is None:
            raise ConfigError("MockBackend needs a tokenizer to return text")
        text = item.text or ""
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = self.tokenizer.encode(text)
        return [*ids, self.tokenizer.eot_id] if item.add_eot else list(ids)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        if self.record:
            self.requests.append(request)
        ids = self._ids(request)
        finish = "stop"
        if len(ids) > request.sampling.max_tokens:
            ids, finish = ids[: request.sampling.max_tokens], "length"
        if self.latency:
            await asyncio.sleep(self.latency)
        step = self.chunk_size or max(len(ids), 1)
        for start in range(0, max(len(ids), 1), step):
            if not self._running.is_set():
                await self._running.wait()
            part = ids[start : start + step]
            pos = len(request.prompt_ids) + start
            yield GenerationChunk(
                token_ids=part,
                # deterministic, distinct per position
                logprobs=[-0.01 * ((pos + i) % 97 + 1) for i in range(len(part))],
                policy_version=self._policy_version,
                kv_version=self._policy_version,
                finish_reason=finish if start + step >= len(ids) else None,  # type: ignore[arg-type]
            )

    async def pause(self, policy: ResumePolicy = "keep") -> None:
        self.events.append(("pause", policy))
        self._running.clear()

    async def resume(self, policies: Mapping[str, ResumePolicy] | None = None) -> None:
        self.events.append(("resume", dict(policies) if policies else None))
        self._running.set()

    async def apply(self, update: WeightUpdate) -> None:
        self.events.append(("apply", getattr(update, "version", None)))
        version = getattr(update, "version", None)
        if isinstance(version, int):
            self._policy_version = version
