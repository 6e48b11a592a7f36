"""The worker's HTTP API over a ``TrajectoryStream``: lease, ack, weights, status, metrics.

Invariants: every route requires ``Authorization: Bearer <token>``; every bad request gets a
4xx with a message and the server keeps serving; a lease's ``trainer_version`` above the
newest weights received is refused (409); an msgpack lease body is sent from the spool's
files (sendfile), its framing written around the stored records, never re-encoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, get_args

import msgspec

from agentroll.errors import WeightSyncError
from agentroll.stream.auth import check_token
from agentroll.stream.http import App, Handler, HTTPError, Request, Response, serve
from agentroll.stream.server import TrajectoryStream
from agentroll.stream.wire import (
    JSON,
    MSGPACK,
    AckReply,
    AckRequest,
    LeaseBatch,
    LeaseRequest,
)
from agentroll.types import (
    ResumePolicy,
    decode_json,
    decode_msgpack,
    encode_json,
    encode_msgpack,
)

#: the resume policies a weight push may ask for (``POST /v1/weights?policy=``)
RESUME_POLICIES: tuple[str, ...] = get_args(ResumePolicy)


class _RawLeaseBatch(msgspec.Struct, kw_only=True):
    """``LeaseBatch`` with trajectories as their stored msgpack bytes (no re-encoding);
    ``trajectories`` is the last field: encoded empty, its header is the last byte."""

    lease_id: str
    expires_at: float
    ttl: float
    trainer_version: int
    trajectories: list[msgspec.Raw]


def _msgpack_array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` items (what ``encode`` writes before them)."""
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _decode_body(request: Request, body: bytes, typ: type[Any]) -> Any:
    is_json = "json" in request.headers.get("content-type", "")
    try:
        return decode_json(body, typ) if is_json else decode_msgpack(body, typ)
    except (msgspec.MsgspecError, ValueError) as exc:
        fmt = "JSON" if is_json else "msgpack"
        raise HTTPError(400, f"malformed {fmt} body for {typ.__name__}: {exc}") from exc


def _wants_json(request: Request) -> bool:
    return JSON in request.headers.get("accept", "")


def _reply(request: Request, obj: Any) -> Response:
    if _wants_json(request):
        return Response.data(encode_json(obj), JSON)
    return Response.data(encode_msgpack(obj), MSGPACK)


def stream_app(stream: TrajectoryStream, *, token: str, stop: asyncio.Event | None = None) -> App:
    """The worker's HTTP API over ``stream``, for ``agentroll.stream.http.serve``; every route
    requires ``token`` (``ConfigError`` when it is empty; see ``agentroll.stream.auth``).
    ``stop``, once set, ends pending long-polls with 204.

    Routes (all bodies msgpack, JSON with ``Accept``/``Content-Type: application/json``):
    ``POST /v1/lease`` (``max``, ``wait``, ``trainer_version``: at most the version of the
    last weights pushed; 200 ``LeaseBatch`` or 204, 409 above it), ``POST /v1/ack``
    (``{"ids": [...]}`` -> ``{"acked": n}``), ``POST /v1/weights`` (a streamed
    ``WeightUpdate``; ``?policy=keep|recompute|restart`` asks for that resume policy), ``GET /v1/status``, ``GET /metrics``.  Every route requires
    ``Authorization: Bearer <token>``; a worker writes its token to
    ``<run_dir>/stream.token`` (``agentroll.stream.auth``).
    """
    token = check_token(token, "the stream token")
    config = stream.config
    stop = stop or asyncio.Event()

    async def lease(request: Request) -> Response:
        body = await request.body(config.max_body_bytes)
        req = _decode_body(request, body, LeaseRequest) if body else LeaseRequest()
        query = request.query
        try:
            if "max" in query:
                req.max = int(query["max"])
            if "wait" in query:
                req.wait = float(query["wait"])
            if "trainer_version" in query:
                req.trainer_version = int(query["trainer_version"])
        except ValueError as exc:
            raise HTTPError(400, f"bad query parameter: {exc}") from exc
        if not 1 <= req.max <= config.max_lease:
            raise HTTPError(400, f"max={req.max}; ask for 1 to {config.max_lease}")
        if not 0 <= req.wait <= config.max_wait:
            raise HTTPError(400, f"wait={req.wait}; use 0 to {config.max_wait} seconds")
        if req.trainer_version is not None and req.trainer_version < 0:
            raise HTTPError(400, f"trainer_version={req.trainer_version}; use >= 0")
        try:
            stream.check_trainer_version(req.trainer_version)
        except ValueError as exc:
            raise HTTPError(409, str(exc)) from exc
        task = asyncio.ensure_future(
            stream.lease(req.max, wait=req.wait, trainer_version=req.trainer_version)
        )
        stopping = asyncio.ensure_future(stop.wait())
        gone = asyncio.ensure_future(request.disconnected())
        try:
            await asyncio.wait({task, stopping, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            gone.cancel()
            if not task.done():
                task.cancel()  # the buffer hands out nothing on cancellation
            await asyncio.wait({task})
        # a lease that came as the client left is offered again after its ttl
        got = None if task.cancelled() else task.result()
        if got is None:
            return Response(204)
        ttl = got.expires_at - stream._clock()
        head: dict[str, Any] = {
            "lease_id": got.id,
            "expires_at": time.time() + ttl,
            "ttl": ttl,
            "trainer_version": got.trainer_version,
        }
        if _wants_json(request):
            return Response.data(
                encode_json(LeaseBatch(**head, trajectories=got.trajectories)), JSON
            )
        # the batch's fields, then an array header, then the stored msgpack of each
        # trajectory, sent from the spool's files with sendfile (not read into memory)
        prefix = msgspec.msgpack.encode(_RawLeaseBatch(**head, trajectories=[]))
        prefix = prefix[:-1] + _msgpack_array_header(len(got.trajectories))
        return stream.lease_response(got, prefix)

    async def ack(request: Request) -> Response:
        body = await request.body(config.max_body_bytes)
        req = _decode_body(request, body, AckRequest)
        return _reply(request, AckReply(acked=await stream.ack(req.ids)))

    async def weights(request: Request) -> Response:
        from agentroll.weights.transport import (
            MAGIC,
            MAX_HEADER_BYTES,
            FrameDecoder,
            UpdateRefusedError,
            UpdateTooLargeError,
        )

        # the header frame is judged before a payload byte is read; a refusal is answered
        # at once and the connection closes after it (the rest of the body is never read)
        policy = request.query.get("policy")
        if policy is not None and policy not in RESUME_POLICIES:
            return Response.text(
                400, f"policy={policy!r}: use one of {', '.join(RESUME_POLICIES)}, or none"
            )
        hint = " (StreamConfig.max_weights_bytes)"
        decoder = FrameDecoder(
            check=stream.check_upload, max_bytes=config.max_weights_bytes, hint=hint
        )
        body_limit = config.max_weights_bytes + len(MAGIC) + 8 + MAX_HEADER_BYTES
        try:
            async for chunk in request.stream(body_limit, hint):
                decoder.feed(chunk)
            update = decoder.finish()
        except UpdateRefusedError as exc:
            return Response.text(409, str(exc))
        except UpdateTooLargeError as exc:
            return Response.text(413, str(exc))
        except WeightSyncError as exc:
            return Response.text(400, f"malformed weight upload: {exc}")
        try:
            await stream.apply_weights(update, policy=policy)
        except WeightSyncError as exc:
            return Response.text(409, str(exc))
        return Response.data(msgspec.json.encode({"version": update.version}), JSON)

    async def status(request: Request) -> Response:
        return Response.data(msgspec.json.encode(stream.status()), JSON)

    async def metrics(request: Request) -> Response:
        return Response.data(stream.metrics().encode(), "text/plain; version=0.0.4")

    routes: dict[str, dict[str, Handler]] = {
        "/v1/lease": {"POST": lease},
        "/v1/ack": {"POST": ack},
        "/v1/weights": {"POST": weights},
        "/v1/status": {"GET": status},
        "/metrics": {"GET": metrics},
    }
    return App(routes, token=token)


@contextlib.asynccontextmanager
async def serve_stream(
    stream: TrajectoryStream,
    *,
    token: str,
    host: str = "127.0.0.1",
    port: int = 0,
) -> AsyncIterator[str]:
    """Serve ``stream_app(stream, token=token)`` for the duration of the block, with
    ``stream.config.http``'s limits; yields the base URL (``port=0`` picks a free port).  A
    worker gets its ``token`` from ``agentroll.stream.auth.ensure_token``; an empty one
    raises ``ConfigError``.  On exit pending long-polls end (204), in-flight requests finish
    (up to 5 s) and every connection is closed, also when the block is cancelled."""
    stop = asyncio.Event()
    app = stream_app(stream, token=token, stop=stop)
    async with serve(
        app,
        host=host,
        port=port,
        what="trajectories",
        on_exit=stop.set,
        config=stream.config.http,
    ) as url:
        yield url
