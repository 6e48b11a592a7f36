"""A reference receiver of the HTTP weight transport, for tests: starlette served by uvicorn.

Invariants: the header frame is judged before a payload byte is read; servers bind 127.0.0.1
unless told otherwise, and then require a bearer token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from agentroll._net import is_loopback
from agentroll.errors import ConfigError, WeightSyncError
from agentroll.weights.transport import (
    FrameDecoder,
    UpdateHeader,
    UpdateRefusedError,
    UpdateTooLargeError,
)
from agentroll.weights.update import WeightUpdate

OnUpdate = Callable[[WeightUpdate], Awaitable[None]]
CheckHeader = Callable[[UpdateHeader], None]


def weights_app(
    on_update: OnUpdate,
    *,
    token: str | None = None,
    path: str = "/weights",
    check: CheckHeader | None = None,
    max_bytes: int | None = None,
) -> Starlette:
    """A Starlette app with ``POST {path}``: decode and verify the streamed update, then
    ``await on_update(update)``.  ``check(header)`` (e.g. ``WeightStore.check``) and
    ``max_bytes`` (payload bytes in all) judge the header frame before any payload is read:
    a refusal is answered at once, and the rest of the body is never read.  Responses: 200
    ``{"version": v}``; 400 (text) for a malformed, corrupt or truncated upload; 401 when
    ``token`` is set and the request lacks ``Authorization: Bearer <token>``; 409 (text: the
    error) when ``check`` or ``on_update`` raises ``WeightSyncError``; 413 when the header
    declares more than ``max_bytes`` or more than a tensor can take.  ``on_update`` is called
    only with a complete, verified update; other errors from it give 500.  Concurrent
    uploads are decoded concurrently; ordering applies is ``on_update``'s job."""
    expected = f"Bearer {token}".encode() if token is not None else None

    async def upload(request: Request) -> Response:
        if expected is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return PlainTextResponse(
                    "missing or wrong bearer token", 401, headers={"WWW-Authenticate": "Bearer"}
                )
        decoder = FrameDecoder(check=check, max_bytes=max_bytes)
        try:
            async for chunk in request.stream():
                decoder.feed(chunk)
            update = decoder.finish()
        except ClientDisconnect:
            # the sender is gone; nobody reads this response and the partial update is dropped
            return Response(status_code=400)
        # a refusal leaves the rest of the body unread: uvicorn drops it as it arrives, after
        # the reply, so the sender reads the reply once it has sent its body
        except UpdateRefusedError as exc:
            return PlainTextResponse(str(exc), 409)
        except UpdateTooLargeError as exc:
            return PlainTextResponse(str(exc), 413)
        except WeightSyncError as exc:
            return PlainTextResponse(f"malformed weight upload: {exc}", 400)
        try:
            await on_update(update)
        except WeightSyncError as exc:
            return PlainTextResponse(str(exc), 409)
        return JSONResponse({"version": update.version})

    return Starlette(routes=[Route(path, upload, methods=["POST"])])


class _EmbeddedServer(uvicorn.Server):
    """uvicorn that reports readiness and leaves the host's signal handlers alone."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_app(
    app: Any,
    *,
    host: str,
    port: int,
    token: str | None,
    what: str,
    on_exit: Callable[[], None] | None = None,
) -> AsyncIterator[str]:
    """Run the ASGI ``app`` under uvicorn for the duration of the block; yields the base URL
    (``port=0`` picks a free port).  A non-loopback ``host`` requires a ``token``
    (``ConfigError`` naming ``what`` otherwise).  The server task is owned by this context:
    on exit ``on_exit`` runs (e.g. to end long-polls), the server stops accepting, finishes
    in-flight requests (up to 5 s) and is awaited; if the block is cancelled during
    shutdown, the server task is cancelled and awaited too."""
    if token is None and not is_loopback(host):
        raise ConfigError(f"serving {what} on {host!r} needs a token (or bind 127.0.0.1)")
    sock = socket.create_server((host, port))
    # asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and
    # create_server's is 0: with Nagle on, every small reply waited ~40 ms for the client's
    # delayed ACK.  Accepted connections inherit the option from the listener.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        bound_port = sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=5
        )
        server = _EmbeddedServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name=f"agentroll-{what}-server")
        try:
            ready = asyncio.ensure_future(server.ready.wait())
            try:
                await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                ready.cancel()
            if task.done():
                task.result()  # raises the startup error if there is one
                raise RuntimeError(f"the {what} server exited during startup")
            url_host = f"[{host}]" if ":" in host else host
            yield f"http://{url_host}:{bound_port}"
        finally:
            if on_exit is not None:
                on_exit()
            server.should_exit = True
            try:
                await asyncio.shield(task)
            finally:
                if not task.done():
                    task.cancel()
                    await asyncio.wait({task})
    finally:
        sock.close()


@contextlib.asynccontextmanager
async def serve_weights(
    on_update: OnUpdate,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    path: str = "/weights",
    check: CheckHeader | None = None,
    max_bytes: int | None = None,
) -> AsyncIterator[str]:
    """Run ``weights_app`` under uvicorn for the duration of the block (``serve_app``);
    yields the endpoint URL."""
    app = weights_app(on_update, token=token, path=path, check=check, max_bytes=max_bytes)
    async with serve_app(app, host=host, port=port, token=token, what="weights") as url:
        yield f"{url}{path}"
