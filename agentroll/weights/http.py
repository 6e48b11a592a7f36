"""HTTP weight transport, sender side: an update streamed to a ``/weights`` endpoint.

The body is the ``encode_frames`` stream (header frame, then payloads) sent with chunked
transfer encoding; the receiver (the trajectory stream's ``POST /v1/weights``) judges the
header before any payload.  Invariant: the outcome is learned from the status (200 applied,
409 refused, 413 too large, 400 malformed, 401 bad token); any failure is ``WeightSyncError``.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import httpx

from agentroll.errors import WeightSyncError
from agentroll.weights.transport import (
    WeightSender,
    describe,
    encode_frames,
    run_blocking,
)
from agentroll.weights.update import WeightUpdate

CONTENT_TYPE = "application/x-agentroll-weights"


class HttpTransport(WeightSender):
    """Send updates to a replica's ``weights_app`` endpoint at ``url``, streamed in chunks of
    ``chunk_bytes``.  ``send`` returns when the replica accepted the update (200) and raises
    ``WeightSyncError`` when it refused it (the reply text is in the message) or when the
    connection failed or timed out (``timeout`` seconds per read/write).  Sending is safe to
    retry: the replica never applies a partial upload.  Pass ``client`` to share a pool
    (it is then not closed by ``aclose``)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        chunk_bytes: int = 1 << 20,
        timeout: float = 300.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.url = url
        self.chunk_bytes = chunk_bytes
        self._headers = {"content-type": CONTENT_TYPE}
        if token is not None:
            self._headers["authorization"] = f"Bearer {token}"
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0))

    async def send(self, update: WeightUpdate) -> None:
        header = await run_blocking(describe, update)
        frames = functools.partial(encode_frames, update, header, chunk_bytes=self.chunk_bytes)

        async def body() -> AsyncIterator[bytes]:
            for chunk in frames():
                yield chunk

        try:
            response = await self._client.post(self.url, content=body(), headers=self._headers)
        except httpx.HTTPError as exc:
            raise WeightSyncError(
                f"weight upload v{update.version} to {self.url} failed: {exc!r}"
            ) from exc
        if response.status_code != 200:
            raise WeightSyncError(
                f"replica at {self.url} refused update v{update.version}: "
                f"HTTP {response.status_code}: {response.text}"
            )
        try:
            version = response.json()["version"]
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightSyncError(f"unexpected reply from {self.url}: {response.text!r}") from exc
        if version != update.version:
            raise WeightSyncError(
                f"replica at {self.url} acknowledged v{version}, not v{update.version}"
            )

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()
