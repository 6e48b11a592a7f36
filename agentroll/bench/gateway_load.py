"""The load generator of ``agentroll bench gateway``: agent episodes over raw HTTP/1.1.

Run as its own process (``python -m agentroll.bench.gateway_load --url URL ...``) so that its
CPU is not the server's.  It opens one keep-alive connection per session, prints ``ready``,
waits for ``go`` on stdin, runs every episode as an OpenAI-SDK agent loop would (each reply's
assistant message echoed byte for byte, then a tool result) and prints one JSON
``LoadResult``.  The client is asyncio streams and msgspec: its per-request cost stays far
below the server's, so the server is what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import resource
import sys
import time
from collections.abc import Sequence

import msgspec

FINAL_TEXT = "The sum of 1 and 2 is 3."
TOOL_CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
TOOL_ARGUMENTS = {"a": 1, "b": 2}
TOOL_RESULT = "3"
_CONNECTS = 64  # connects in flight at once: the listener's backlog is asyncio's 100
_HEAD_LIMIT = 64 << 10
_ERRORS_KEPT = 5

TOOLS_JSON = msgspec.json.encode(
    [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        }
    ]
)
SYSTEM_MESSAGE = msgspec.json.encode({"role": "system", "content": "You add numbers."})
USER_MESSAGE = msgspec.json.encode({"role": "user", "content": "What is 1 + 2? Use add."})


class LoadResult(msgspec.Struct, kw_only=True):
    """What one load run measured: chat calls answered as expected (``calls``) and failed,
    the wall time from ``go`` to the last session's end, the chat calls' latency
    percentiles, this process's CPU seconds over that time, and the samples the ``end``
    replies reported in all."""

    sessions: int
    calls: int
    failed: int
    seconds: float
    p50_ms: float
    p99_ms: float
    cpu_s: float
    samples: int
    errors: list[str] = []


class ClientResponse(msgspec.Struct):
    status: int
    body: bytes
    keep_alive: bool


async def read_response(reader: asyncio.StreamReader) -> ClientResponse:
    """One HTTP/1.1 response from ``reader``: a ``content-length`` body, a chunked one
    (chunk extensions and trailers skipped), or one that lasts to the end of the stream.
    Raises ``ConnectionError`` if the stream ends early, ``ValueError`` for a malformed
    head."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        raise ConnectionError("the server closed the connection before a response") from exc
    except asyncio.LimitOverrunError as exc:
        raise ValueError(f"response head longer than {_HEAD_LIMIT} bytes") from exc
    lines = head[:-4].split(b"\r\n")
    status_line = lines[0].split(b" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(status_line[1])
    length = -1
    chunked = False
    keep_alive = status_line[0] == b"HTTP/1.1"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            keep_alive = value.strip().lower() == b"keep-alive"
    try:
        if chunked:
            body = await _read_chunked(reader)
        elif length >= 0:
            body = await reader.readexactly(length)
        elif status in (204, 304) or 100 <= status < 200:
            body = b""
        else:
            body, keep_alive = await reader.read(), False
    except asyncio.IncompleteReadError as exc:
        raise ConnectionError("the server closed the connection inside a response") from exc
    return ClientResponse(status, body, keep_alive)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # a trailer field
            return b"".join(parts)
        chunk = await reader.readexactly(size + 2)
        if chunk[-2:] != b"\r\n":
            raise ValueError("a chunk does not end with CRLF")
        parts.append(chunk[:-2])


class HTTPConnection:
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self._reader = reader
        self._writer = writer
        self._host = host
        self.open = True

    @classmethod
    async def connect(cls, host: str, port: int) -> HTTPConnection:
        reader, writer = await asyncio.open_connection(host, port, limit=_HEAD_LIMIT)
        return cls(reader, writer, f"{host}:{port}")

    async def request(self, method: str, path: str, body: bytes = b"") -> ClientResponse:
        """Send one request (a JSON body) and read its response.  Raises ``ConnectionError``
        on a closed connection."""
        if not self.open:
            raise ConnectionError("the connection was closed by the server")
        head = (
            f"{method} {path} HTTP/1.1\r\nhost: {self._host}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        self._writer.write(head.encode("latin-1") + body)  # one write: one segment
        await self._writer.drain()
        response = await read_response(self._reader)
        self.open = response.keep_alive
        return response

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):  # the server had closed it already
            await self._writer.wait_closed()


# -- replies ---------------------------------------------------------------------------------


class _Function(msgspec.Struct):
    name: str
    arguments: str


class _ToolCall(msgspec.Struct):
    id: str
    function: _Function


class _Message(msgspec.Struct):
    role: str
    content: str | None = None
    tool_calls: list[_ToolCall] = []


class _Choice(msgspec.Struct):
    message: msgspec.Raw
    finish_reason: str


class _Reply(msgspec.Struct):
    choices: list[_Choice]


class _Created(msgspec.Struct):
    id: str


class _Ended(msgspec.Struct):
    samples: int
    status: str


_reply = msgspec.json.Decoder(_Reply)
_message = msgspec.json.Decoder(_Message)
_created = msgspec.json.Decoder(_Created)
_ended = msgspec.json.Decoder(_Ended)
_arguments = msgspec.json.Decoder(dict)


class ReplyError(Exception):
    """A reply that is not what the scripted backend makes the gateway answer."""


def check_reply(body: bytes, last: bool) -> tuple[bytes, str]:
    """The assistant message of a chat reply (its JSON, to echo as is) and the id of its
    tool call (``""`` on the last turn); ``ReplyError`` if the reply is not the scripted
    one: a tool call of ``add`` with finish ``tool_calls`` before the last turn,
    ``FINAL_TEXT`` with finish ``stop`` on it."""
    try:
        choice = _reply.decode(body).choices[0]
        message = _message.decode(choice.message)
    except (msgspec.DecodeError, IndexError) as exc:
        raise ReplyError(f"malformed chat reply: {exc}") from None
    if last:
        if choice.finish_reason != "stop" or message.content != FINAL_TEXT or message.tool_calls:
            raise ReplyError(f"last turn: finish {choice.finish_reason!r}, not the final text")
        return bytes(choice.message), ""
    calls = message.tool_calls
    if choice.finish_reason != "tool_calls" or len(calls) != 1 or calls[0].function.name != "add":
        raise ReplyError(f"finish {choice.finish_reason!r} with {len(calls)} calls, not add")
    try:
        arguments = _arguments.decode(calls[0].function.arguments)
    except msgspec.DecodeError:
        raise ReplyError("the tool call's arguments are not JSON") from None
    if arguments != TOOL_ARGUMENTS:
        raise ReplyError(f"tool call arguments {arguments!r}, not {TOOL_ARGUMENTS!r}")
    return bytes(choice.message), calls[0].id


def chat_body(messages: Sequence[bytes]) -> bytes:
    """A Chat Completions body of already encoded messages, with the ``add`` tool."""
    return b'{"model":"bench","messages":[%b],"tools":%b}' % (b",".join(messages), TOOLS_JSON)


def tool_message(call_id: str) -> bytes:
    return msgspec.json.encode({"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT})


# -- episodes --------------------------------------------------------------------------------


class _Tally:
    def __init__(self) -> None:
        self.calls = 0
        self.failed = 0
        self.samples = 0
        self.latencies: list[float] = []
        self.errors: list[str] = []

    def fail(self, why: str) -> None:
        self.failed += 1
        if len(self.errors) < _ERRORS_KEPT:
            self.errors.append(why)


async def run_episode(
    conn: HTTPConnection, index: int, turns: int, group_size: int, prefix: str, tally: _Tally
) -> None:
    """One session: create it, ``turns`` chat calls, a reward, the end.  A failed call ends
    its episode early (the session is still ended, so its group is released)."""
    body = msgspec.json.encode(
        {
            "task_id": f"{prefix}-task-{index // group_size}",
            "group_id": f"{prefix}-group-{index // group_size}",
            "group_size": group_size,
            "metadata": {"bench": "gateway"},
        }
    )
    created = await conn.request("POST", "/sessions", body)
    if created.status != 201:
        tally.fail(f"POST /sessions: {created.status} {created.body[:200]!r}")
        return
    base = f"/sessions/{_created.decode(created.body).id}"
    path = f"{base}/v1/chat/completions"
    messages = [SYSTEM_MESSAGE, USER_MESSAGE]
    clock = time.perf_counter
    for turn in range(turns):
        t0 = clock()
        reply = await conn.request("POST", path, chat_body(messages))
        tally.latencies.append(clock() - t0)
        if reply.status != 200:
            tally.fail(f"chat turn {turn}: {reply.status} {reply.body[:200]!r}")
            break
        try:
            assistant, call_id = check_reply(reply.body, turn == turns - 1)
        except ReplyError as exc:
            tally.fail(f"chat turn {turn}: {exc}")
            break
        tally.calls += 1
        messages.append(assistant)
        if call_id:
            messages.append(tool_message(call_id))
    rewarded = await conn.request("POST", f"{base}/reward", b'{"reward":1.0}')
    if rewarded.status != 200:
        tally.fail(f"POST reward: {rewarded.status} {rewarded.body[:200]!r}")
    ended = await conn.request("POST", f"{base}/end")
    if ended.status != 200:
        tally.fail(f"POST end: {ended.status} {ended.body[:200]!r}")
        return
    end = _ended.decode(ended.body)
    tally.samples += end.samples
    if end.samples != 1 or end.status != "ok":
        tally.fail(f"end: {end.samples} samples, status {end.status!r} (expected 1, ok)")


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``; nan for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def raise_nofile(needed: int) -> None:
    """Raise the soft RLIMIT_NOFILE to ``needed`` descriptors where the hard limit allows;
    ``RuntimeError`` saying what to do where it does not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise RuntimeError(
            f"{needed} descriptors are needed but RLIMIT_NOFILE's hard limit is {hard}; "
            "raise `ulimit -Hn` or run fewer --sessions"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


async def _connect_all(host: str, port: int, n: int) -> list[HTTPConnection]:
    gate = asyncio.Semaphore(_CONNECTS)

    async def one() -> HTTPConnection:
        async with gate:
            return await HTTPConnection.connect(host, port)

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def run_load(
    url: str,
    sessions: int,
    turns: int,
    group_size: int,
    prefix: str,
    *,
    wait_for_go: bool = True,
) -> LoadResult:
    """Open the connections, then (after ``go`` on stdin when ``wait_for_go``) run the
    episodes concurrently; the clock and the CPU count start at ``go``."""
    hostport = url.removeprefix("http://").rstrip("/")
    host, _, port = hostport.rpartition(":")
    raise_nofile(sessions + 256)
    conns = await _connect_all(host, int(port), sessions)
    tally = _Tally()
    try:
        if wait_for_go:
            print("ready", flush=True)
            if (await asyncio.to_thread(sys.stdin.readline)).strip() != "go":
                raise RuntimeError("the bench did not say go")
        cpu0, t0 = time.process_time(), time.perf_counter()
        outcomes = await asyncio.gather(
            *(
                run_episode(conn, i, turns, group_size, prefix, tally)
                for i, conn in enumerate(conns)
            ),
            return_exceptions=True,
        )
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            tally.fail(f"episode: {type(outcome).__name__}: {outcome}")
    return LoadResult(
        sessions=sessions,
        calls=tally.calls,
        failed=tally.failed,
        seconds=seconds,
        p50_ms=percentile(tally.latencies, 0.5) * 1000.0,
        p99_ms=percentile(tally.latencies, 0.99) * 1000.0,
        cpu_s=cpu,
        samples=tally.samples,
        errors=tally.errors,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the gateway's base URL")
    parser.add_argument("--sessions", type=int, required=True)
    parser.add_argument("--turns", type=int, required=True)
    parser.add_argument("--group-size", type=int, default=1)
    parser.add_argument("--prefix", default="load", help="task and group ids start with it")
    args = parser.parse_args(argv)
    result = asyncio.run(
        run_load(args.url, args.sessions, args.turns, args.group_size, args.prefix)
    )
    sys.stdout.buffer.write(msgspec.json.encode(result) + b"\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
