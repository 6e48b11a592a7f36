"""Shared by the vLLM backend tests: consume one generation, optionally syncing weights
mid-stream (pause, apply, resume in ``finally``), and keep what the consumer saw."""

from __future__ import annotations

from typing import Any

import msgspec

from agentroll.backends.base import GenerationRequest


class Run(msgspec.Struct):
    ids: list[int]
    logprobs: list[float]
    versions: list[tuple[int, int]]
    rollbacks: int = 0


async def consume(
    backend: Any,
    req: GenerationRequest,
    *,
    pause_at: int | None = None,
    policy: Any = "keep",
    update: Any = None,
) -> Run:
    """Stream ``req``; once ``pause_at`` tokens arrived: pause with ``policy``, apply
    ``update`` (if any), resume."""
    out = Run([], [], [])
    async for chunk in backend.generate(req):
        if chunk.rollback:
            out.rollbacks += 1
            del out.ids[-chunk.rollback :], out.logprobs[-chunk.rollback :]
            del out.versions[-chunk.rollback :]
        out.ids += chunk.token_ids
        out.logprobs += chunk.logprobs
        out.versions += [(chunk.policy_version, chunk.kv_version)] * len(chunk.token_ids)
        if pause_at is not None and len(out.ids) >= pause_at:
            pause_at = None
            await backend.pause(policy)
            try:
                if update is not None:
                    await backend.apply(update)
            finally:
                await backend.resume()
    return out
