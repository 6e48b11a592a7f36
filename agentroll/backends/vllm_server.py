"""The ``http`` backend: an OpenAI-compatible vLLM server, through httpx.

Invariants: token-in/token-out on ``/v1/completions``; a request's chunks carry one version
pair each; a consumer that leaves closes its stream (the server aborts the request);
``resume`` posts ``/resume`` even if a step before it failed; a failed update keeps the old
version; transient faults are retried, a 4xx is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from agentroll.backends._vllm_common import Epochs, HostWeights, finish_reason
from agentroll.backends._vllm_transfer import CheckedBackend
from agentroll.backends.base import (
    Backend,
    GenerationChunk,
    GenerationRequest,
    ResumePolicy,
)
from agentroll.errors import BackendError

if TYPE_CHECKING:
    from agentroll.weights.update import WeightUpdate

__all__ = ["VLLMServerBackend", "serve_vllm"]

log = logging.getLogger("agentroll.backends.vllm_server")

_QUIET = 0.05  # seconds without events that count as "the frozen engine sent all it had"
_DONE = object()


class _Stream:
    """One request's reader: events parsed into a queue, tokens counted as they arrive."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.produced = 0
        self.last_event = time.monotonic()
        self.task: asyncio.Task[None] | None = None


class _Live:
    __slots__ = ("epochs", "recompute", "restart", "stream")

    def __init__(self, version: int) -> None:
        self.epochs = Epochs(version)
        self.restart = False  # resume: drop the turn, submit the prompt again
        self.recompute = False  # resume: submit prompt + tokens so far again
        self.stream: _Stream | None = None


class VLLMServerBackend(CheckedBackend, Backend):
    """A vLLM OpenAI-compatible server at ``base_url`` (e.g. ``http://127.0.0.1:8000``).

    ``model_dir`` is the checkpoint the server was started on (needed for weight updates);
    ``model`` the served model name (default: the server's first model).

    Requests go to ``/v1/completions`` (``prompt`` as token ids, ``return_token_ids``,
    ``logprobs=0``: the sampled token's logprob; start the server with ``--logprobs-mode
    processed_logprobs`` so it is the distribution sampled from), streamed as server-sent
    events.  Each request has a reader task that parses the events into a queue, so the backend
    knows how many tokens the server produced independently of how fast the episode consumes.

    Pause/resume and weights use vLLM's RL endpoints (the server runs with
    ``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=keep`` freezes requests; at ``resume`` the
    backend waits until no event has arrived for a moment (a frozen engine produces none, so
    what came was produced before the pause), cuts each request's version epoch there, and
    ``POST /resume``.  ``recompute`` closes the request's stream (the server aborts it) and
    submits prompt + tokens so far again, a fresh prefill under the new weights (a server-side
    ``/reset_prefix_cache?reset_running_requests=true`` does not re-prefill running requests:
    their post-resume logprobs are those of the old KV); ``restart`` closes the stream and
    submits the prompt again.  ``apply`` verifies the update on a host copy of the checkpoint
    (``model_dir``), writes the checkpoint where the server can read it (same machine or shared
    filesystem: ``weights_dir``) and calls ``/collective_rpc`` ``reload_weights``; a failure
    reloads the previous checkpoint and keeps the old version.

    Faults: connection errors, timeouts and 5xx answers are retried with exponential backoff
    (``retries`` times); a stream that breaks after tokens arrived is resubmitted with prompt +
    tokens so far (the rest is recomputed); when retries run out the call raises
    ``BackendError`` naming the server and the last error.  A 4xx is not retried.
    """

    name = "http"

    def __init__(
        self,
        base_url: str,
        *,
        model_dir: str | Path | None = None,
        model: str | None = None,
        api_key: str | None = None,
        retries: int = 4,
        backoff: float = 0.5,
        timeout: float = 600.0,
        weights_dir: str | Path | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        dtype: str | None = None,
        verify_served: bool | None = None,
        probe_tokens: int = 32,
        probe_tolerance: float | None = None,
    ) -> None:
        """With ``model_dir`` (the checkpoint the server runs) updates are applied by
        checkpoint reloads; ``dtype`` is the one the server runs (None: the checkpoint's),
        for ``verify_served`` (vLLM's digests of what it serves, compared with the verified
        host tensors; needs ``VLLM_SERVER_DEV_MODE=1``) and the rescoring probe
        (``probe_tokens``, ``probe_tolerance``), as in the ``vllm`` backend."""
        self._transport = transport  # tests: an httpx.MockTransport
        self.base_url = base_url.rstrip("/")
        self.model_dir = Path(model_dir).resolve() if model_dir is not None else None
        self.model = model
        self.api_key = api_key
        self.retries = retries
        self.backoff = backoff
        self.timeout = timeout
        self.weights = (
            HostWeights(self.model_dir, root=weights_dir) if self.model_dir is not None else None
        )
        self.client: httpx.AsyncClient | None = None
        self._version = 0
        self._paused = False
        self._pause_policy: ResumePolicy = "keep"
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self.stats: dict[str, int] = {"retries": 0, "resubmitted": 0, "restarted": 0}
        self._broken = None
        self._probe_due = False  # set by apply (which needs model_dir)
        if self.model_dir is not None:
            if dtype is None:
                config = json.loads((self.model_dir / "config.json").read_text())
                dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
            self._init_checks(self.model_dir, dtype, verify_served, probe_tokens, probe_tolerance)

    @property
    def policy_version(self) -> int:
        return self._version

    async def start(self) -> None:
        if self.client is not None:
            return
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(self.timeout, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            transport=self._transport,
        )
        models = await self._call("GET", "/v1/models")
        if self.model is None:
            data = models.get("data") or []
            if not data:
                raise BackendError(f"the server at {self.base_url} serves no model")
            self.model = str(data[0]["id"])

    async def close(self) -> None:
        client, self.client = self.client, None
        for live in list(self._live.values()):
            if live.stream is not None and live.stream.task is not None:
                live.stream.task.cancel()
        if client is not None:
            await client.aclose()
        if self.weights is not None:
            self.weights.cleanup()

    # -- plumbing ----------------------------------------------------------------------------

    def _require_started(self) -> httpx.AsyncClient:
        if self.client is None:
            raise BackendError("the http backend is not started; use `async with backend:`")
        return self.client

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        """One request with retries on connection errors, timeouts and 5xx."""
        client = self._require_started()
        last: str = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                resp = await client.request(method, path, **kwargs)
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            if resp.status_code >= 400:
                raise BackendError(
                    f"{self.base_url}{path} refused the request: HTTP {resp.status_code} "
                    f"{resp.text[:300]}"
                )
            return resp.json() if resp.content else {}
        raise BackendError(
            f"{self.base_url}{path} failed after {self.retries + 1} attempts; last error: {last}"
        )

    # -- generation --------------------------------------------------------------------------

    def _body(
        self, request: GenerationRequest, prompt: list[int], max_tokens: int
    ) -> dict[str, Any]:
        s = request.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "stream": True,
            "return_token_ids": True,
            "ignore_eos": s.ignore_eos,
        }
        if s.top_k:
            body["top_k"] = s.top_k
        if s.seed is not None:
            body["seed"] = s.seed
        if s.stop_token_ids:
            body["stop_token_ids"] = list(s.stop_token_ids)
        if s.stop:
            body["stop"] = list(s.stop)
        if s.logprobs:
            body["logprobs"] = 0
        return body

    async def _read(self, body: dict[str, Any], stream: _Stream) -> None:
        """Reader task: POST the completion, put ``(ids, logprobs, finish)`` items, then
        ``_DONE``; an exception is put as the item when the stream fails."""
        client = self._require_started()
        try:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code >= 400:
                    text = (await resp.aread()).decode(errors="replace")[:300]
                    raise _HTTPStatus(resp.status_code, text)
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        raise _HTTPStatus(500, str(event["error"])[:300])
                    choice = event["choices"][0]
                    ids = list(choice.get("token_ids") or [])
                    if not all(type(i) is int and 0 <= i < 1 << 31 for i in ids):
                        # what a broken server sent must not reach a trajectory: retried
                        raise _HTTPStatus(502, f"the server sent token ids {ids[:8]!r}")
                    lps_raw = (choice.get("logprobs") or {}).get("token_logprobs")
                    lps = [float(x) for x in lps_raw] if lps_raw else [0.0] * len(ids)
                    if len(lps) != len(ids):
                        raise _HTTPStatus(502, f"{len(lps)} logprobs for {len(ids)} tokens")
                    stream.produced += len(ids)
                    stream.last_event = time.monotonic()
                    stream.queue.put_nowait((ids, lps, choice.get("finish_reason")))
            stream.queue.put_nowait(_DONE)
        except asyncio.CancelledError:
            stream.queue.put_nowait(_DONE)
            raise
        except Exception as exc:
            stream.queue.put_nowait(exc)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Stream ``request``'s tokens; see the module docstring for versions and faults."""
        self._require_started()
        self._require_serving()
        rid = request.request_id
        if rid in self._live:
            raise BackendError(f"request id {rid!r} is already running on this backend")
        live = self._live[rid] = _Live(self._version)
        prompt = list(request.prompt_ids)
        delivered: list[int] = []
        failures = 0
        last_error = ""
        try:
            while True:
                remaining = request.sampling.max_tokens - len(delivered)
                if remaining <= 0:  # each resubmission made progress, so failures reset
                    raise BackendError(
                        f"{self.base_url}: request {rid!r} has its {len(delivered)} tokens "
                        "(max_tokens) but no finish reason came; the server does not follow "
                        "the completions API"
                    )
                stream = live.stream = _Stream()
                body = self._body(request, prompt + delivered, remaining)
                stream.task = asyncio.get_running_loop().create_task(self._read(body, stream))
                base = len(delivered)
                finished = False
                error: BaseException | None = None
                try:
                    while True:
                        item = await stream.queue.get()
                        if item is _DONE:
                            break
                        if isinstance(item, BaseException):
                            error = item
                            break
                        ids, lps, reason = item
                        if live.restart:
                            break
                        start = len(delivered)
                        delivered.extend(ids)
                        finish = finish_reason(reason)
                        for chunk in live.epochs.split(start, ids, lps, finish):
                            yield chunk
                        if finish is not None:
                            finished = True
                            return
                finally:
                    if not finished and stream.task is not None and not stream.task.done():
                        stream.task.cancel()  # closes the stream: the server aborts it
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await stream.task
                if live.recompute and error is None:
                    # a fresh prefill of prompt + tokens so far under the current weights
                    live.recompute = False
                    live.epochs.cutoff = len(delivered)
                    live.epochs.resume(self._version, "recompute")
                    continue
                if live.restart:
                    live.restart = False
                    self.stats["restarted"] += 1
                    for chunk in live.epochs.restart(self._version, len(delivered)):
                        yield chunk
                    delivered = []
                    continue
                retryable = error is None or not (
                    isinstance(error, _HTTPStatus) and error.status < 500
                )
                last_error = (
                    "the stream ended without a finish reason" if error is None else str(error)
                )
                if not retryable:
                    raise BackendError(f"{self.base_url} refused request {rid!r}: {last_error}")
                failures = failures + 1 if len(delivered) == base else 1
                if failures > self.retries:
                    raise BackendError(
                        f"{self.base_url}: request {rid!r} failed {failures} times in a row; "
                        f"last error: {last_error}"
                    )
                # resubmit prompt + what arrived; the engine recomputes that prefix
                self.stats["resubmitted" if len(delivered) > base else "retries"] += 1
                if len(delivered) > base:
                    live.epochs.resume(self._version, "recompute")
                await asyncio.sleep(self.backoff * 2 ** (failures - 1))
        finally:
            self._live.pop(rid, None)

    # -- pause / resume ----------------------------------------------------------------------

    async def pause(self, policy: ResumePolicy = "keep") -> None:
        """``POST /pause?mode=keep``; ``policy`` applies at ``resume``."""
        if policy not in ("keep", "recompute", "restart"):
            raise ValueError(f"unknown resume policy {policy!r}; use keep, recompute or restart")
        self._pause_policy = policy
        if self._paused:
            return
        await self._call("POST", "/pause", params={"mode": "keep"})
        self._paused = True

    async def resume(self, policies: Mapping[str, ResumePolicy] | None = None) -> None:
        """Cut each request's versions where the server's events stopped, then ``/resume``."""
        if not self._paused:
            return
        try:
            await self._quiet()
            for rid, live in self._live.items():
                policy = (policies or {}).get(rid, self._pause_policy)
                if policy in ("restart", "recompute"):
                    # close the stream (the server aborts the request); what already
                    # arrived is delivered, then generate() submits it again
                    live.restart = policy == "restart"
                    live.recompute = policy == "recompute"
                    if live.stream is not None and live.stream.task is not None:
                        live.stream.task.cancel()
                    continue
                live.epochs.cutoff = live.stream.produced if live.stream is not None else 0
                live.epochs.resume(self._version, policy)
        finally:
            await self._call("POST", "/resume")
            self._paused = False
        if self._probe_due:
            self._probe_due = False
            await self._probe()

    async def _quiet(self) -> None:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            last = max(
                (lv.stream.last_event for lv in self._live.values() if lv.stream is not None),
                default=0.0,
            )
            if time.monotonic() - last >= _QUIET:
                return
            await asyncio.sleep(_QUIET / 2)

    # -- weights ------------------------------------------------------------------------------

    async def apply(self, update: WeightUpdate) -> None:
        """Apply a full or delta ``WeightUpdate`` while paused (needs ``model_dir``)."""
        if self.weights is None:
            raise BackendError("weight updates need model_dir: the checkpoint the server runs")
        if not self._paused:
            raise BackendError("apply needs a paused backend: `await backend.pause()` first")
        verify = self._verify if self.check.verify_served else None
        await self.weights.apply(update, self._reload, f"the server at {self.base_url}", verify)
        self._version = self.weights.version
        self._probe_due = self.check.probe_tokens > 0
        with contextlib.suppress(BackendError):  # informational on the server side
            await self._call(
                "POST", "/update_weight_version", json={"new_version": str(self._version)}
            )

    async def _reload(self, directory: Path) -> None:
        await self._call(
            "POST",
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(directory)}},
        )
        await self._call("POST", "/reset_prefix_cache")

    async def _verify(self, expected: Mapping[str, Any]) -> None:
        out = await self._call(
            "POST", "/collective_rpc", json={"method": "compute_weight_checksums"}
        )
        await self.check.verify(out["results"], expected)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probabilities of ``token_ids[1:]`` under the served weights (a fresh prefill)."""
        body = {
            "model": self.model,
            "prompt": list(token_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
            "cache_salt": f"score-{next(self._ids)}-{time.monotonic_ns()}",
        }
        out = await self._call("POST", "/v1/completions", json=body)
        entries = out["choices"][0].get("prompt_logprobs") or []
        result = []
        for tok, entry in zip(token_ids[1:], entries[1:], strict=True):
            result.append(float(entry[str(tok)]["logprob"]))
        return result


class _HTTPStatus(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


@contextlib.asynccontextmanager
async def serve_vllm(
    model_dir: str | Path,
    *,
    port: int,
    max_model_len: int = 1024,
    dtype: str = "float32",
    startup_timeout: float = 180.0,
    extra_args: list[str] | None = None,
) -> AsyncIterator[str]:
    """Run vLLM's OpenAI server on 127.0.0.1:``port`` for ``model_dir`` (dev endpoints on,
    processed logprobs); yields its base URL; stops it (SIGTERM, then SIGKILL) at exit."""
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--max-model-len", str(max_model_len), "--block-size", "32",
        "--enforce-eager", "--logprobs-mode", "processed_logprobs",
        *_cpu_args(max_model_len),
        *(extra_args or []),
    ]  # fmt: skip
    # the server's log goes to a file: a pipe nobody reads would fill up and stall it
    # (AGENTROLL_VLLM_SERVER_LOG=path keeps it there)
    keep = os.environ.get("AGENTROLL_VLLM_SERVER_LOG")
    with open(keep, "ab+") if keep else tempfile.TemporaryFile() as logfile:  # noqa: ASYNC230
        proc = await asyncio.to_thread(
            subprocess.Popen,
            argv,
            env=env,
            stdout=logfile,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            await _wait_healthy(proc, logfile, url := f"http://127.0.0.1:{port}", startup_timeout)
            yield url
        finally:
            if proc.poll() is not None:  # it died while in use: say why, where it is seen
                logfile.seek(0)
                tail = logfile.read().decode(errors="replace")[-3000:]
                log.error("the vLLM server on port %d exited with %s; its log ends:\n%s",
                          port, proc.returncode, tail)  # fmt: skip
            await _stop(proc)


def _cpu_args(max_model_len: int) -> list[str]:
    """``cpu_engine_defaults`` as server flags (no chunked prefill on vLLM's CPU build)."""
    from agentroll.backends.vllm import cpu_engine_defaults

    defaults = cpu_engine_defaults(max_model_len)
    if not defaults:
        return []
    tokens = defaults["max_num_batched_tokens"]
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(tokens)]


async def _wait_healthy(
    proc: subprocess.Popen[bytes], logfile: Any, url: str, startup_timeout: float
) -> None:
    deadline = time.monotonic() + startup_timeout
    async with httpx.AsyncClient(timeout=2.0) as probe:
        while True:
            if proc.poll() is not None:
                logfile.seek(0)
                err = logfile.read().decode(errors="replace")[-2000:]
                raise BackendError(f"the vLLM server exited with {proc.returncode}: {err}")
            with contextlib.suppress(httpx.HTTPError):
                if (await probe.get(f"{url}/health")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise BackendError(f"the vLLM server did not answer within {startup_timeout} s")
            await asyncio.sleep(0.5)


async def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        await asyncio.to_thread(proc.wait, 20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)
