"""The gateway's HTTP routes: OpenAI-compatible endpoints per session, session lifecycle.

Invariants: every refusal is a 4xx with an OpenAI-style error body saying what to change,
and the server goes on serving other sessions; a body is refused beyond its limit before it
is read whole; a session is named by its path (``/sessions/{sid}/v1/...``) or by the API key
(``Authorization: Bearer <sid>`` on ``/v1/...``); with a token, lifecycle routes need it and
completion routes need it or the session's id (a 128-bit secret); a client that leaves
mid-call aborts its generation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from agentroll.gateway.calls import StreamedCall
from agentroll.gateway.gateway import Gateway
from agentroll.gateway.session import Session
from agentroll.gateway.wire import (
    ChatRequest,
    CompletionRequest,
    RequestError,
    RewardRequest,
    SessionRequest,
    decode,
)
from agentroll.stream.http import App, HTTPConfig, HTTPError, Request, Response, serve

_JSON = "application/json"
_SSE = "text/event-stream"
_SMALL_BODY = 64 << 10


def _json(obj: Any, status: int = 200) -> Response:
    return Response(status, [msgspec.json.encode(obj)], _JSON)


def _error(exc: RequestError) -> Response:
    return Response(exc.status, [exc.body()], _JSON)


def _refusal(status: int, message: str) -> Response:
    """What the server refuses before or around the routes, as an OpenAI error body."""
    kind = (
        "authentication_error"
        if status == 401
        else "server_error"
        if status >= 500
        else "invalid_request_error"
    )
    return _error(RequestError(status, message, kind=kind))


class GatewayApp:
    """Routes requests to a ``Gateway``."""

    def __init__(self, gateway: Gateway, *, token: str | None = None) -> None:
        self.gateway = gateway
        self.token = token
        self._admin = f"Bearer {token}" if token else None

    def app(self) -> App:
        return App(routes={}, fallback=self.handle, authorize=self._authorize, error=_refusal)

    def _bearer(self, request: Request) -> str:
        value = request.headers.get("authorization", "")
        return value[7:].strip() if value[:7].lower() == "bearer " else ""

    def _authorize(self, request: Request) -> str | None:
        if self._admin is None:
            return None
        if request.headers.get("authorization", "") == self._admin:
            return None
        key = self._bearer(request)
        parts = request.path.strip("/").split("/")
        scoped = parts[:1] == ["v1"] or (parts[:1] == ["sessions"] and parts[2:3] == ["v1"])
        if scoped and key in self.gateway.sessions:
            sid = parts[1] if parts[0] == "sessions" else key
            if sid == key:
                return None
        return (
            "missing or wrong bearer token: send the gateway's token, or on a session's "
            "/v1 routes the session id as the API key"
        )

    async def handle(self, request: Request) -> Response:
        try:
            return await self._route(request)
        except RequestError as exc:
            return _error(exc)
        except HTTPError as exc:  # body limits and timeouts of the server
            return _error(RequestError(exc.status, exc.message))

    async def _route(self, request: Request) -> Response:
        parts = request.path.strip("/").split("/")
        method = request.method
        gw = self.gateway
        if parts == ["sessions"]:
            _allow(method, "POST")
            body = await request.body(_SMALL_BODY)
            req = decode(body or b"{}", SessionRequest, "session")
            session = gw.open_session(
                task_id=req.task_id,
                group_id=req.group_id,
                group_size=req.group_size,
                seed=req.seed,
                metadata=req.metadata,
            )
            return _json(
                {
                    "id": session.id,
                    "api_key": session.id,
                    "base_path": f"/sessions/{session.id}/v1",
                    "group_id": session.group_id,
                    "sample_index": session.sample_index,
                },
                201,
            )
        if parts in (["status"], ["health"]):
            _allow(method, "GET")
            return _json(gw.status())
        if parts[:1] == ["sessions"] and len(parts) >= 2:
            sid, rest = parts[1], parts[2:]
        elif parts[:1] == ["v1"]:
            sid, rest = self._bearer(request), parts
            if not sid:
                raise RequestError(
                    401,
                    "name the session: use /sessions/{sid}/v1/... or send the session "
                    "id as the API key",
                    code="no_session",
                )
        else:
            raise RequestError(404, f"no route {request.path!r}", code="not_found")
        session = gw.session(sid)
        if not rest:
            _allow(method, "GET")
            return _json(_describe(session))
        if rest == ["reward"]:
            _allow(method, "POST")
            rr = decode(await request.body(_SMALL_BODY), RewardRequest, "reward")
            try:
                session.set_reward(rr.reward, rr.rewards)
            except ValueError as exc:
                raise RequestError(400, str(exc), param="reward") from None
            return _json({"id": sid, "reward": session.reward})
        if rest == ["end"]:
            _allow(method, "POST")
            await request.body(_SMALL_BODY)
            trajs = await gw.end(session)
            return _json({"id": sid, "samples": len(trajs), "status": session.status})
        if rest == ["v1", "models"]:
            _allow(method, "GET")
            return _json(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": gw.config.model,
                            "object": "model",
                            "created": 0,
                            "owned_by": "agentroll",
                        }
                    ],
                }
            )
        if rest == ["v1", "chat", "completions"]:
            _allow(method, "POST")
            body = await request.body(gw.config.max_body_bytes)
            creq = decode(body, ChatRequest, "chat completions")
            if creq.stream:
                events = await gw.chat_stream(session, creq)
                return Response(
                    200,
                    (),
                    _SSE,
                    [("cache-control", "no-cache")],
                    on_close=events.close,
                    stream=self._tracked(session, events),
                )
            return _json(await self._call(request, session, gw.chat(session, creq)))
        if rest == ["v1", "completions"]:
            _allow(method, "POST")
            body = await request.body(gw.config.max_body_bytes)
            preq = decode(body, CompletionRequest, "completions")
            return _json(await self._call(request, session, gw.completion(session, preq)))
        raise RequestError(404, f"no route {request.path!r}", code="not_found")

    async def _call(self, request: Request, session: Session, coro: Any) -> Any:
        """Run a call while its client is there (it is cancelled when the client leaves or
        the session ends)."""
        task = asyncio.ensure_future(coro)
        self.gateway.track(session, str(id(task)), task)
        left = False

        def gone() -> None:
            nonlocal left
            left = True
            task.cancel()

        forget = request.on_disconnect(gone)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the server is shutting down
            if left:
                raise ConnectionError("the client left during the call") from None
            raise RequestError(
                409, "the session ended during the call", code="session_ended"
            ) from None
        finally:
            forget()

    async def _tracked(self, session: Session, call: StreamedCall) -> AsyncIterator[bytes]:
        # not the connection's task (ending the session must not kill the connection): a
        # handle that ``end`` cancels, seen between events
        handle: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        key = f"stream-{id(call)}"
        session.in_flight[key] = handle
        events = aiter(call)
        try:
            async for event in events:
                if handle.cancelled():
                    break
                yield event
        finally:
            session.in_flight.pop(key, None)
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()


def _allow(method: str, allowed: str) -> None:
    if method != allowed:
        raise RequestError(405, f"{method} is not allowed here; use {allowed}")


def _describe(session: Session) -> dict[str, Any]:
    cap = session.capture
    return {
        "id": session.id,
        "task_id": session.task.id,
        "group_id": session.group_id,
        "calls": cap.calls,
        "samples": len(cap.samples),
        "forks": cap.num_forks,
        "mismatched_tokens": cap.mismatched_tokens,
        "unparsed_tool_calls": session.unparsed_tool_calls,
        "tokens": [len(s.builder) for s in cap.samples],
        "reward": session.reward,
        "ended": session.ended,
    }


GATEWAY_HTTP = HTTPConfig(max_connections=4096, max_connections_per_client=4096)


@contextlib.asynccontextmanager
async def serve_gateway(
    gateway: Gateway,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    config: HTTPConfig | None = None,
) -> AsyncIterator[str]:
    """Serve ``gateway`` over HTTP for the block; yields the base URL.  A host other than
    loopback needs ``token`` (``ConfigError`` otherwise)."""
    from agentroll._net import is_loopback
    from agentroll.errors import ConfigError

    if token is None and not is_loopback(host):
        raise ConfigError(f"serving the gateway on {host!r} needs a token (or bind 127.0.0.1)")
    app = GatewayApp(gateway, token=token).app()
    if token is None:
        app.authorize = None
    async with serve(
        app, host=host, port=port, what="the gateway", config=config or GATEWAY_HTTP
    ) as url:
        yield url


__all__ = ["GATEWAY_HTTP", "GatewayApp", "serve_gateway"]
