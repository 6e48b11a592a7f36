"""Shared pieces of the gateway tests: a gateway served in a background thread, so that
synchronous clients (openai, langchain) can call it from the test's thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from agentroll.backends.base import Backend
from agentroll.gateway import Gateway, GatewayConfig, serve_gateway


class Served:
    """A gateway on its own event loop thread: ``url``, ``gateway``, ``run(coro)``."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self.gateway: Gateway | None = None

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextmanager
def served_gateway(
    make_backend: Callable[[], Backend], config: GatewayConfig | None = None, **kwargs: Any
) -> Iterator[Served]:
    served = Served()
    ready = threading.Event()
    stop: asyncio.Event | None = None
    errors: list[BaseException] = []

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        backend = make_backend()
        async with (
            backend,
            Gateway(backend, config=config, **kwargs) as gw,
            serve_gateway(gw) as url,
        ):
            served.url, served.gateway = url, gw
            ready.set()
            await stop.wait()

    def thread() -> None:
        asyncio.set_event_loop(served.loop)
        try:
            served.loop.run_until_complete(main())
        except BaseException as exc:  # surfaced by the test
            errors.append(exc)
            ready.set()

    t = threading.Thread(target=thread, daemon=True)
    t.start()
    assert ready.wait(30), "the gateway did not start"
    if errors:
        raise errors[0]
    try:
        yield served
    finally:
        assert stop is not None
        served.loop.call_soon_threadsafe(stop.set)
        t.join(30)
        if errors:
            raise errors[0]


def open_session(url: str, **fields: Any) -> str:
    import httpx

    reply = httpx.post(f"{url}/sessions", json=fields, timeout=10)
    reply.raise_for_status()
    return str(reply.json()["id"])


def end_session(url: str, sid: str, reward: float | None = None) -> None:
    import httpx

    if reward is not None:
        httpx.post(f"{url}/sessions/{sid}/reward", json={"reward": reward}, timeout=10)
    httpx.post(f"{url}/sessions/{sid}/end", json={}, timeout=10).raise_for_status()
