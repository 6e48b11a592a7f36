"""``agentroll bench gateway`` with small numbers, and its load generator's pieces: the line
has the promised keys and adds up (every chat call answered, no fork, one sample per
session), a client echo that does not extend the history is counted as a fork, and the raw
HTTP client reads content-length, chunked and read-to-close bodies on one connection."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import msgspec
import pytest

from agentroll.bench import BENCHMARKS
from agentroll.bench import gateway as bench_gateway
from agentroll.bench.gateway import (
    GatewayBenchConfig,
    TrajectorySink,
    inproc_round,
    scripted_backend,
)
from agentroll.bench.gateway_load import (
    FINAL_TEXT,
    HTTPConnection,
    ReplyError,
    chat_body,
    check_reply,
    percentile,
    tool_message,
)
from agentroll.errors import ConfigError
from agentroll.gateway import Gateway

KEYS = [
    "calls_per_s",
    "p50_ms",
    "p99_ms",
    "server_cpu_ms_per_call",
    "client_cpu_ms_per_call",
    "inproc_calls_per_s",
    "inproc_cpu_ms_per_call",
    "ratio_vs_inproc",
    "ratio_min",
    "ratio_max",
    "server_cpu_ms_min",
    "server_cpu_ms_max",
    "failed",
    "forks",
    "calls",
    "sessions",
    "turns",
    "pairs",
]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_gateway.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_small_run_answers_every_call_without_forks(capsys: pytest.CaptureFixture[str]) -> None:
    assert BENCHMARKS["gateway"][0] == "agentroll.bench.gateway"
    assert bench_gateway.main(_args("--sessions", "64", "--turns", "3")) == 0
    out = capsys.readouterr().out.strip().splitlines()
    pairs = [field.split("=") for field in out[-1].split()]
    assert [k for k, _ in pairs] == KEYS
    values = {k: float(v) for k, v in pairs}
    assert values["failed"] == 0 and values["forks"] == 0
    assert values["calls"] == 64 * 3 and values["sessions"] == 64 and values["turns"] == 3
    assert values["pairs"] == 5
    assert 0 < values["ratio_min"] <= values["ratio_vs_inproc"] <= values["ratio_max"]
    assert values["server_cpu_ms_min"] <= values["server_cpu_ms_per_call"]
    assert values["server_cpu_ms_per_call"] <= values["server_cpu_ms_max"]
    for key in ("calls_per_s", "server_cpu_ms_per_call", "client_cpu_ms_per_call"):
        assert values[key] > 0, key
    assert values["inproc_calls_per_s"] > 0 and values["inproc_cpu_ms_per_call"] > 0
    assert 0 < values["p50_ms"] <= values["p99_ms"]


async def test_in_process_round_counts_calls_samples_and_trajectories() -> None:
    sink = TrajectorySink()
    async with scripted_backend(2) as backend, Gateway(backend, publish=sink) as gw:
        result, errors = await inproc_round(
            gw, sink, sessions=8, turns=2, group_size=4, prefix="t", label="", mode="off"
        )
    assert errors == []
    assert (result.calls, result.failed, result.forks) == (16, 0, 0)
    assert sink.trajectories == 8 and sink.forked == 0


async def test_an_echo_that_rewrites_the_history_is_a_fork(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = bench_gateway._check

    def rewrites(reply: dict[str, Any], last: bool) -> tuple[dict[str, Any], str]:
        message, call_id = real(reply, last)
        return {**message, "content": "something the model never said"}, call_id

    monkeypatch.setattr(bench_gateway, "_check", rewrites)
    sink = TrajectorySink()
    async with scripted_backend(3) as backend, Gateway(backend, publish=sink) as gw:
        result, errors = await inproc_round(
            gw, sink, sessions=4, turns=3, group_size=1, prefix="f", label="", mode="off"
        )
    assert result.forks == 4 * 2  # turns 1 and 2 of each session start a new sample
    assert result.failed == 4  # each session ended with 3 samples, not 1
    assert sink.forked == 8 and any("samples" in e for e in errors)


def test_check_reply_returns_the_message_bytes_to_echo() -> None:
    message = (
        b'{"role":"assistant","content":null,"tool_calls":[{"id":"call_0_0_0","type":'
        b'"function","function":{"name":"add","arguments":"{\\"a\\": 1, \\"b\\": 2}"}}]}'
    )
    body = b'{"id":"x","choices":[{"index":0,"message":%b,"finish_reason":"tool_calls"}]}' % (
        message
    )
    assert check_reply(body, last=False) == (message, "call_0_0_0")
    with pytest.raises(ReplyError, match="final text"):
        check_reply(body, last=True)
    wrong = body.replace(b'\\"b\\": 2', b'\\"b\\": 5')
    with pytest.raises(ReplyError, match="arguments"):
        check_reply(wrong, last=False)
    final = msgspec.json.encode(
        {
            "choices": [
                {"message": {"role": "assistant", "content": FINAL_TEXT}, "finish_reason": "stop"}
            ]
        }
    )
    assert check_reply(final, last=True)[1] == ""
    with pytest.raises(ReplyError, match="malformed"):
        check_reply(b'{"choices": []}', last=True)


def test_chat_body_holds_the_messages_in_order() -> None:
    body = msgspec.json.decode(chat_body([b'{"role":"user","content":"hi"}', tool_message("c1")]))
    assert body["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    assert body["tools"][0]["function"]["name"] == "add"


async def test_client_reads_length_chunked_and_close_delimited_bodies() -> None:
    requests: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for reply in (
            [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: x\r\n\r\nhello"],
            # a chunked body split at awkward places, a chunk extension and a trailer
            [
                b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n4;ext=1\r",
                b"\nwiki\r\n5\r\npe",
                b"dia\r\n0\r\nX-Trailer: 1\r\n\r\n",
            ],
            [b"HTTP/1.1 404 Not Found\r\nConnection: close\r\n\r\nto the end"],
        ):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            requests.append(head + await reader.readexactly(length))
            for piece in reply:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.01)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        conn = await HTTPConnection.connect("127.0.0.1", port)
        first = await conn.request("POST", "/a", b'{"x":1}')
        second = await conn.request("POST", "/b")
        third = await conn.request("POST", "/c", b"{}")
        await conn.close()
    assert (first.status, first.body, first.keep_alive) == (200, b"hello", True)
    assert (second.status, second.body, second.keep_alive) == (201, b"wikipedia", True)
    assert (third.status, third.body, third.keep_alive) == (404, b"to the end", False)
    assert requests[0].startswith(b"POST /a HTTP/1.1\r\n") and requests[0].endswith(b'{"x":1}')
    assert b"content-length: 0\r\n" in requests[1]
    with pytest.raises(ConnectionError):
        await conn.request("POST", "/d")  # the server said close


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0 and percentile(values, 0.99) == 99.0
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) != percentile([], 0.5)  # nan


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sessions": 0}, ">= 1"),
        ({"sessions": 12, "group_size": 8}, "multiple"),
        ({"pairs": 4}, "pairs"),
    ],
)
def test_config_refuses_what_cannot_be_measured(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        GatewayBenchConfig(**kwargs)
