"""Trainer side of the trajectory stream: an async httpx client that leases and acks.

Invariants: a consumer sees each trajectory id at most once (with ``seen_path`` also across
restarts: an id is persisted only after the worker confirmed its ack, so a crash in between
re-delivers rather than loses); a re-offered trajectory acknowledged already is acknowledged
again; every httpx error becomes a ``StreamError`` (weights: ``WeightSyncError``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import os
import sys
from collections.abc import AsyncGenerator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import httpx
import msgspec

from agentroll._fs import fsync_path
from agentroll.errors import ConfigError, StreamError
from agentroll.stream.auth import TOKEN_ENV, check_token, load_token
from agentroll.stream.transport import FastTransport
from agentroll.stream.wire import (
    JSON,
    MSGPACK,
    AckReply,
    AckRequest,
    LeaseBatch,
    LeaseRequest,
    OnUndecodable,
    Undecodable,
    WireFormat,
    decode_lease,
    split_lease,
)
from agentroll.types import (
    Trajectory,
    decode_json,
    decode_msgpack,
    encode_json,
    encode_msgpack,
)

if TYPE_CHECKING:
    from agentroll.weights.update import WeightUpdate

logger = logging.getLogger("agentroll.stream.client")

_ACKS_IN_FLIGHT = 4  # batches(auto_ack=True): acks sent and not yet answered, at most
#: batches(prefetch=True): lease requests in flight ahead of the consumer, each on its own
#: connection (the worker's send buffer holds about one lease: two keep the next ones
#: coming while a batch is decoded)
_LEASES_IN_FLIGHT = 2
_Reply = tuple[int, str, bytes | bytearray]  # an undecoded reply: status, content type, body


# -- persisted acknowledgements ------------------------------------------------------------


def _load_seen(path: Path) -> set[str]:
    """Ids in a seen file: one JSON list per line; a torn last line is dropped."""
    seen: set[str] = set()
    if not path.exists():
        return seen
    data = path.read_bytes()
    good = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            ids = json.loads(line)
        except ValueError:
            break
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            break  # damaged: what follows is dropped like a torn tail
        seen.update(ids)
        good += len(line)
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return seen


def _append_seen(path: Path, ids: list[str]) -> None:
    with open(path, "ab") as f:
        f.write(json.dumps(ids).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())


def _write_dead_letters(directory: Path, bad: list[Undecodable], suffix: str) -> None:
    """Each of ``bad`` as ``<id><suffix>`` (its bytes as leased) and a line of
    ``errors.jsonl``, fsync'd before they are acknowledged."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = []
    for b in bad:
        # the id made a file name, and a hash of it: two ids never share a file
        safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in b.id)
        digest = hashlib.blake2b(b.id.encode(), digest_size=6).hexdigest()
        name = f"{safe[:150]}-{digest}{suffix}"
        with open(directory / name, "wb") as f:
            f.write(b.data)
            os.fsync(f.fileno())
        lines.append(json.dumps({"id": b.id, "file": name, "error": b.error}) + "\n")
    with open(directory / "errors.jsonl", "a") as f:
        f.writelines(lines)
        os.fsync(f.fileno())
    fsync_path(directory)


async def _first_reply(leasing: collections.deque[asyncio.Future[_Reply]]) -> _Reply:
    """Take the oldest lease request in ``leasing`` that has finished, waiting for one to
    finish.  Requests go out on separate connections and may reach the worker out of order;
    one that found the buffer empty (a younger one took what was there) long-polls, and
    must not hold back the younger reply that has trajectories.  Raises the request's
    ``StreamError``."""
    if not any(f.done() for f in leasing):
        await asyncio.wait(leasing, return_when=asyncio.FIRST_COMPLETED)
    done = next(f for f in leasing if f.done())
    leasing.remove(done)
    return done.result()


class StreamClient:
    """Consume a worker's trajectory stream at ``url`` (e.g. ``http://127.0.0.1:8600``).

    ``token``: the worker's bearer token; None takes ``load_token(run_dir, env=token_env)``
    (``$AGENTROLL_STREAM_TOKEN``, else the worker's ``<run_dir>/stream.token``), and
    ``ConfigError`` says where to find one when neither has it: every worker requires one.
    ``format``: body encoding of requests and replies (msgpack is ~3x denser than JSON's
    base64 arrays).  ``seen_path``: a file of acknowledged ids that makes the dedupe survive
    a restart of the consumer (it grows by ~40 bytes per trajectory).  ``timeout``: seconds
    per request on top of a lease's ``wait``.  ``conversation=False``: leased trajectories
    come without their ``turns`` and ``messages`` (empty lists), for a trainer that uses
    only their token arrays, reward and ids; they are stepped over in the body, never built
    into objects, which saves about a third of a consumer's CPU (``agentroll bench
    stream``).  Use as ``async with StreamClient(...)``.  Leased trajectories come from
    ``decode_lease``: with msgpack their arrays are writable views of their batch's receive
    buffer (freed with the batch's last array).  A leased trajectory that does not decode
    (another version's record, a field of another type) raises ``StreamError`` naming it
    (``on_undecodable="raise"``), or, with ``"skip"``, is written to ``dead_letter_dir``
    (``<id>.msgpack`` or ``.json``, and a line in ``errors.jsonl``), acknowledged, counted
    in ``undecodable`` and logged; the rest of its batch is delivered either way."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        run_dir: str | Path | None = None,
        token_env: str = TOKEN_ENV,
        format: WireFormat = "msgpack",
        seen_path: str | Path | None = None,
        timeout: float = 30.0,
        conversation: bool = True,
        on_undecodable: OnUndecodable = "raise",
        dead_letter_dir: str | Path | None = None,
    ) -> None:
        if on_undecodable not in ("raise", "skip"):
            raise ConfigError(
                f"StreamClient on_undecodable={on_undecodable!r}; use 'raise' or 'skip'"
            )
        if format not in ("msgpack", "json"):
            raise ConfigError(f"StreamClient format={format!r}; use 'msgpack' or 'json'")
        if timeout <= 0:
            raise ConfigError(f"StreamClient timeout={timeout}; use a positive number of seconds")
        if token is None:
            token = load_token(run_dir, env=token_env)
        self.url = url.rstrip("/")
        self.token = check_token(token, "StreamClient token")
        self.format: WireFormat = format
        self.timeout = timeout
        self.conversation = conversation
        self.on_undecodable: OnUndecodable = on_undecodable
        self.dead_letter_dir = Path(dead_letter_dir) if dead_letter_dir is not None else None
        self.undecodable = 0  # leased trajectories set aside (on_undecodable="skip")
        self.seen_path = Path(seen_path) if seen_path is not None else None
        self._mime = MSGPACK if format == "msgpack" else JSON
        headers = {"accept": self._mime, "content-type": self._mime}
        headers["authorization"] = f"Bearer {self.token}"
        self._headers = headers
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
            # plain http (what serve_stream speaks): FastTransport; https (a TLS proxy in
            # front of the worker): httpx's default transport
            transport=FastTransport() if self.url.startswith("http://") else None,
        )
        self._weights_client: httpx.AsyncClient | None = None  # streamed uploads: httpcore
        # handed to the consumer by this process and not acknowledged yet (in-flight ids only)
        self._yielded: set[str] = set()
        # acknowledged (by this process or a persisted one): grows with the run, about 100
        # bytes an id (a set of str), and ``seen_path`` about 35 bytes an id on disk
        self._acked: set[str] = set()
        if self.seen_path is not None:
            self._acked = _load_seen(self.seen_path)
        self.skipped = 0  # re-offered trajectories not yielded again

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()
        if self._weights_client is not None:
            await self._weights_client.aclose()

    def _encode(self, obj: Any) -> bytes:
        return encode_msgpack(obj) if self.format == "msgpack" else encode_json(obj)

    def _decode(self, ctype: str, data: bytes | bytearray, typ: Any) -> Any:
        try:
            if typ is LeaseBatch:
                return decode_lease(
                    data, json=ctype.startswith(JSON), conversation=self.conversation
                )
            if ctype.startswith(JSON):
                return decode_json(bytes(data), typ)
            return decode_msgpack(bytes(data), typ)
        except (msgspec.MsgspecError, ValueError, TypeError) as exc:
            raise StreamError(
                f"unexpected reply from {self.url} ({ctype or 'no content type'}): {exc}; "
                "is the URL an agentroll worker of the same version?"
            ) from exc

    async def _request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        *,
        extra_timeout: float = 0.0,
        headers: dict[str, str] | None = None,
    ) -> _Reply:
        """One request: ``(status, content type, body)``; the body as the transport received
        it (one bytearray from ``FastTransport``: not copied again).  Raises ``StreamError``
        for a transport failure or a 4xx/5xx reply."""
        timeout = httpx.Timeout(self.timeout + extra_timeout, connect=10.0)
        request = self._client.build_request(
            method, path, content=body or None, timeout=timeout, headers=headers
        )
        try:
            response = await self._client.send(request, stream=True)
            try:
                parts = [part async for part in response.aiter_bytes()]
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            raise StreamError(
                f"request {path} to the worker at {self.url} failed: {exc!r}; check that the "
                "worker is running and reachable (it retries safely: leases expire, acks repeat)"
            ) from exc
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self._check(path, response.status_code, data)
        return response.status_code, response.headers.get("content-type", ""), data

    def _check(self, path: str, status: int, data: bytes | bytearray) -> None:
        if status < 400:
            return
        if status == 401:
            raise StreamError(
                f"the worker at {self.url} refused {path}: wrong token; pass the worker's "
                "token as StreamClient(token=...), or its run directory as run_dir=... (the "
                "worker writes it to <run_dir>/stream.token)"
            )
        text = bytes(data[:4096]).decode("utf-8", "replace").strip()
        raise StreamError(f"the worker at {self.url} refused {path}: HTTP {status}: {text}")

    async def lease(
        self, max: int = 64, wait: float = 0.0, *, trainer_version: int | None = None
    ) -> LeaseBatch | None:
        """Lease up to ``max`` trajectories (whole groups; at least one group), waiting up to
        ``wait`` seconds for one; None if none came.  No dedupe here (see ``batches``).
        Raises ``StreamError``."""
        batch, bad = self._decode_lease(await self._lease_reply(max, wait, trainer_version))
        if bad:
            await self._set_aside(bad)
        return batch

    async def _lease_reply(self, max: int, wait: float, trainer_version: int | None) -> _Reply:
        """The undecoded reply of one lease request: ``(status, content type, body)``."""
        request = LeaseRequest(max=max, wait=wait, trainer_version=trainer_version)
        return await self._request("POST", "/v1/lease", self._encode(request), extra_timeout=wait)

    def _decode_lease(self, reply: _Reply) -> tuple[LeaseBatch | None, list[Undecodable]]:
        """The batch of a lease reply (None for 204) and the trajectories in it this client
        cannot decode (see ``split_lease``: the slow path, taken only when the whole body
        was refused)."""
        status, ctype, data = reply
        if status == 204:
            return None, []
        json = ctype.startswith(JSON)
        try:
            return decode_lease(data, json=json, conversation=self.conversation), []
        except (msgspec.MsgspecError, ValueError, TypeError) as exc:
            try:
                return split_lease(data, json=json, conversation=self.conversation)
            except ValueError:
                raise StreamError(
                    f"unexpected reply from {self.url} ({ctype or 'no content type'}): {exc}; "
                    "is the URL an agentroll worker of the same version?"
                ) from exc

    async def _set_aside(self, bad: list[Undecodable]) -> None:
        """Leased trajectories that do not decode: a ``StreamError`` (``on_undecodable=
        "raise"``: they are offered again after the lease's ttl, and again refused), or
        written to ``dead_letter_dir`` (durably), acknowledged and counted in
        ``undecodable`` (``"skip"``)."""
        first = bad[0]
        what = f"{len(bad)} leased trajectories ({first.id!r}: {first.error})"
        if self.on_undecodable == "raise":
            raise StreamError(
                f"the worker at {self.url} sent {what} that this client cannot decode; the "
                "worker offers them again after the lease's ttl.  Fix what produced them (an "
                "older or newer agentroll, a field of another type), or pass "
                "StreamClient(on_undecodable='skip', dead_letter_dir=...) to keep their bytes "
                "aside and acknowledge them"
            )
        if self.dead_letter_dir is not None:
            suffix = ".msgpack" if self.format == "msgpack" else ".json"
            await asyncio.to_thread(_write_dead_letters, self.dead_letter_dir, bad, suffix)
        logger.warning(
            "set aside %s%s", what, f" in {self.dead_letter_dir}" if self.dead_letter_dir else ""
        )
        await self.ack([b.id for b in bad])
        self.undecodable += len(bad)

    async def ack(self, ids: Iterable[str]) -> int:
        """Acknowledge trajectories by id: they leave the worker for good.  Returns how many
        left its spool (0 for ids acknowledged before).  Persists the ids to ``seen_path``
        after the worker confirmed.  Raises ``StreamError``; retrying is safe."""
        ids = list(ids)
        if not ids:
            return 0
        _, ctype, data = await self._request("POST", "/v1/ack", self._encode(AckRequest(ids=ids)))
        reply: AckReply = self._decode(ctype, data, AckReply)
        fresh = [i for i in ids if i not in self._acked]
        self._acked.update(ids)
        self._yielded.difference_update(ids)  # ``_fresh`` checks ``_acked`` first
        if self.seen_path is not None and fresh:
            await asyncio.to_thread(_append_seen, self.seen_path, fresh)
        return reply.acked

    async def _fresh(self, batch: LeaseBatch) -> list[Trajectory]:
        """The trajectories of ``batch`` never handed out by this client (now marked as
        handed out); ones acknowledged before a restart are acknowledged again."""
        fresh: list[Trajectory] = []
        again: list[str] = []
        for traj in batch.trajectories:
            if traj.id in self._acked:
                again.append(traj.id)  # acknowledged before a restart of either side
            elif traj.id not in self._yielded:
                fresh.append(traj)
        self.skipped += len(batch.trajectories) - len(fresh)
        if again:
            await self.ack(again)
        self._yielded.update(t.id for t in fresh)
        return fresh

    async def take(
        self, n: int, wait: float = 5.0, *, trainer_version: int | None = None
    ) -> list[Trajectory]:
        """Exactly ``n`` trajectories never handed out before (deduped as ``batches`` does),
        leasing as often as needed; whole groups when ``n`` is a multiple of the group size.
        For a trainer that steps on fixed-size batches.  Raises ``StreamError``."""
        out: list[Trajectory] = []
        while len(out) < n:
            batch = await self.lease(n - len(out), wait, trainer_version=trainer_version)
            if batch is not None:
                out.extend(await self._fresh(batch))
        return out

    async def batches(
        self,
        max: int = 64,
        wait: float = 5.0,
        *,
        auto_ack: bool = False,
        trainer_version: int | None = None,
        prefetch: bool = True,
    ) -> AsyncGenerator[list[Trajectory], None]:
        """Lease batches forever (break out of the loop to stop) and yield each as a list of
        trajectories never yielded before (a batch of only re-offered ones is not yielded).
        With ``auto_ack`` a batch is acknowledged when the consumer asks for the next one:
        the ack is sent then and completes while the next batches are leased and decoded (up
        to 4 acks in flight; a failed ack raises at a later step).  Acks in flight when the
        loop stops are completed when the generator is closed: use
        ``async with contextlib.aclosing(client.batches(...)) as batches`` to have it done
        when the block ends rather than at garbage collection.  The batch yielded last is
        not acknowledged when the loop stops (a break and an exception look the same to the
        generator, and the consumer may not have finished it): ``ack`` its ids once it is
        done with them; until then this client does not hand them out again, and the worker
        offers them again after their lease ttl.  Without ``auto_ack`` call ``ack``.  With
        ``prefetch`` the next two leases are requested while the consumer works on the
        current batch, and whichever reply comes first is used first (a request that found
        nothing long-polls without holding the others back; when the loop stops, leases in
        flight are cancelled; anything they had leased is offered again after its ttl).
        Raises ``StreamError``."""
        leasing: collections.deque[asyncio.Future[_Reply]]
        leasing = collections.deque()  # lease requests in flight, oldest first
        acking: collections.deque[asyncio.Future[int]] = collections.deque()
        try:
            while True:
                if not leasing:
                    leasing.append(
                        asyncio.ensure_future(self._lease_reply(max, wait, trainer_version))
                    )
                reply = await _first_reply(leasing)
                if prefetch and reply[0] != 204:
                    # the next requests go out before this reply is decoded: the worker
                    # prepares and sends the next batches (on their own connections) while
                    # this one is decoded and used
                    while len(leasing) < _LEASES_IN_FLIGHT:
                        leasing.append(
                            asyncio.ensure_future(self._lease_reply(max, wait, trainer_version))
                        )
                    await asyncio.sleep(0)  # let them send their requests first
                batch, bad = self._decode_lease(reply)
                if bad:
                    await self._set_aside(bad)
                if batch is None:
                    continue
                fresh = await self._fresh(batch)
                if not fresh:
                    continue
                yield fresh
                if auto_ack:
                    while acking and (acking[0].done() or len(acking) >= _ACKS_IN_FLIGHT):
                        await acking.popleft()  # raises the StreamError of a failed ack
                    acking.append(asyncio.ensure_future(self.ack([t.id for t in fresh])))
        finally:
            for pending in leasing:
                pending.cancel()
            if leasing:
                await asyncio.wait(leasing)
            for pending in leasing:
                if not pending.cancelled():
                    pending.exception()  # retrieved: a failed prefetch is not reported
            if acking:
                await asyncio.wait(acking)  # acks that were sent are completed, not dropped
                failed = [
                    exc for a in acking if not a.cancelled() and (exc := a.exception()) is not None
                ]
                if failed and sys.exc_info()[0] in (None, GeneratorExit):
                    raise failed[0]

    async def push_weights(
        self, update: WeightUpdate, *, chunk_bytes: int = 1 << 20, policy: str | None = None
    ) -> None:
        """Stream a full or delta ``WeightUpdate`` to the worker, which applies it before
        replying.  ``policy`` (``keep``/``recompute``/``restart``) is the resume policy of the
        generations it pauses; None leaves the worker's recipe's.  Raises
        ``WeightSyncError`` when it was refused or the upload failed (nothing was applied
        then)."""
        from agentroll.weights.http import HttpTransport

        if self._weights_client is None:  # streams the upload (FastTransport would buffer it)
            self._weights_client = httpx.AsyncClient(
                headers=self._headers, timeout=httpx.Timeout(self.timeout, connect=10.0)
            )
        query = f"?policy={policy}" if policy is not None else ""
        transport = HttpTransport(
            f"{self.url}/v1/weights{query}",
            token=self.token,
            chunk_bytes=chunk_bytes,
            client=self._weights_client,
        )
        await transport.send(update)

    async def status(self) -> dict[str, Any]:
        """The worker's ``/v1/status`` (buffer, spool, versions, uptime).  Raises
        ``StreamError``."""
        _, _, data = await self._request("GET", "/v1/status", headers={"accept": JSON})
        try:
            out: dict[str, Any] = json.loads(data)
        except ValueError as exc:
            raise StreamError(f"unexpected status reply from {self.url}: {exc}") from exc
        return out
