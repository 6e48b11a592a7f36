"""Issue 30 item 4: the stream always requires a bearer token, also on loopback.

A worker without a given token generates one into ``<run_dir>/stream.token`` (mode 0600,
atomically) and keeps it across restarts; consumers find it in the environment or that
file; an empty token is refused with a ``ConfigError`` naming where it came from."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import httpx
import pytest

from agentroll.errors import ConfigError
from agentroll.run.recipe import parse_recipe
from agentroll.stream import StreamClient, TrajectoryStream, serve_stream, stream_app
from agentroll.stream.auth import TOKEN_FILE, ensure_token, load_token

ROUTES = [
    ("POST", "/v1/lease"),
    ("POST", "/v1/ack"),
    ("POST", "/v1/weights"),
    ("GET", "/v1/status"),
    ("GET", "/metrics"),
]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_ensure_token_generates_once_writes_0600_and_keeps_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = ensure_token(run_dir, None)
    path = run_dir / TOKEN_FILE
    assert len(first) >= 40 and path.read_text().strip() == first and mode(path) == 0o600
    assert ensure_token(run_dir, None) == first  # a restarted worker keeps its token
    assert ensure_token(run_dir, "given") == "given" == path.read_text().strip()
    assert mode(path) == 0o600 and not list(run_dir.glob(".*tmp*"))
    os.chmod(path, 0o644)  # someone widened it: rewritten private
    assert ensure_token(run_dir, None) == "given" and mode(path) == 0o600


@pytest.mark.parametrize("empty", ["", "  \n"])
def test_an_empty_token_is_refused_naming_it(tmp_path: Path, empty: str) -> None:
    with pytest.raises(ConfigError, match="given stream token is empty"):
        ensure_token(tmp_path, empty)
    (tmp_path / TOKEN_FILE).write_text(empty)
    with pytest.raises(ConfigError, match=rf"{TOKEN_FILE}.*is empty"):
        ensure_token(tmp_path, None)
    with pytest.raises(ConfigError, match="StreamClient token is empty"):
        StreamClient("http://127.0.0.1:1", token=empty)


def test_load_token_reads_the_environment_then_the_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AGENTROLL_STREAM_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=rf"AGENTROLL_STREAM_TOKEN is not set.*{TOKEN_FILE}"):
        load_token(tmp_path)
    with pytest.raises(ConfigError, match="AGENTROLL_STREAM_TOKEN"):
        StreamClient("http://127.0.0.1:1")  # a client without a token says where to get one
    written = ensure_token(tmp_path, None)
    assert load_token(tmp_path) == written
    monkeypatch.setenv("AGENTROLL_STREAM_TOKEN", "from-env")
    assert load_token(tmp_path) == "from-env" and load_token(tmp_path, env=None) == written
    monkeypatch.setenv("AGENTROLL_STREAM_TOKEN", "")
    with pytest.raises(ConfigError, match="environment variable AGENTROLL_STREAM_TOKEN is empty"):
        load_token(tmp_path)


async def test_every_route_requires_the_token_on_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a worker on 127.0.0.1 without a token served every route to anyone who could
    reach the port (any sandbox sharing the host's network)."""
    monkeypatch.delenv("AGENTROLL_STREAM_TOKEN", raising=False)
    token = ensure_token(tmp_path, None)
    async with (
        TrajectoryStream(tmp_path / "spool") as stream,
        serve_stream(stream, token=token) as url,
    ):
        async with httpx.AsyncClient(base_url=url) as raw:
            for method, path in ROUTES:
                for headers in ({}, {"authorization": "Bearer"}, {"authorization": "Bearer wrong"}):
                    r = await raw.request(method, path, headers=headers)
                    assert r.status_code == 401, (path, headers)
        async with StreamClient(url, run_dir=tmp_path) as client:  # the token from the file
            assert await client.lease() is None
    with pytest.raises(ConfigError, match="stream token is empty"):
        stream_app(stream, token="")


def test_the_recipe_and_the_service_refuse_an_empty_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentroll.run.service import RolloutService

    with pytest.raises(ConfigError, match=r"stream\.token_env"):
        parse_recipe('[stream]\ntoken_env = ""\n')
    recipe = parse_recipe('[stream]\ntoken_env = "MY_TOKEN"\n')
    monkeypatch.setenv("MY_TOKEN", "")
    with pytest.raises(ConfigError, match=r"\$MY_TOKEN.*is empty"):
        RolloutService(recipe, model_dir=tmp_path, run_dir=tmp_path)


@pytest.mark.slow  # a real worker: two tiny-engine replicas
async def test_a_worker_started_without_a_token_generates_and_requires_one(
    tiny_model: Path, tmp_path: Path, small_fleet_toml: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentroll.run.service import RolloutService

    monkeypatch.delenv("AGENTROLL_STREAM_TOKEN", raising=False)
    recipe = parse_recipe(
        '[environment]\nname = "calculator"\nkwargs = { num_tasks = 8 }\n' + small_fleet_toml
    )
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    service = RolloutService(recipe, model_dir=tiny_model, run_dir=tmp_path)
    task = asyncio.create_task(service.serve(stop, ready=ready.set_result))
    try:
        url = await asyncio.wait_for(asyncio.shield(ready), 60)
        path = tmp_path / TOKEN_FILE
        assert mode(path) == 0o600 and path.read_text().strip() == service.token
        async with httpx.AsyncClient(base_url=url) as raw:
            assert (await raw.post("/v1/lease")).status_code == 401
        async with StreamClient(url, run_dir=tmp_path) as client:
            batch = await client.lease(max=2, wait=30)
            assert batch is not None and len(batch.trajectories) == 2
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
