"""``agentroll gateway --recipe R.toml``: the gateway and the trajectory stream, served.

Invariants: an ended group of sessions is published to the spool before a trainer can lease
it (the stream's own guarantee); weights a trainer pushes are installed through
``Gateway.sync`` with the recipe's resume policy, so calls in flight only wait; one token
(the stream's) guards both servers when the gateway is not on loopback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentroll._gc import settle_heap
from agentroll._net import is_loopback
from agentroll.gateway import Gateway, GatewayConfig, serve_gateway
from agentroll.rollout.buffer import BufferConfig
from agentroll.run.build import build_backend, resume_policy
from agentroll.run.recipe import Recipe
from agentroll.stream.api import serve_stream
from agentroll.stream.auth import TOKEN_FILE, ensure_token
from agentroll.stream.server import StreamConfig, TrajectoryStream
from agentroll.weights.update import WeightUpdate

logger = logging.getLogger("agentroll.run.gateway")


def gateway_config(recipe: Recipe) -> GatewayConfig:
    g = recipe.gateway
    return GatewayConfig(
        tool_parser=g.tool_parser,
        idle_timeout=g.idle_timeout,
        fork_policy=g.fork_policy,
        max_tokens=g.max_tokens,
        model=g.model,
        seed=recipe.run.seed,
    )


async def serve_recipe_gateway(
    recipe: Recipe,
    *,
    model_dir: str | Path,
    run_dir: str | Path,
    stop: asyncio.Event,
    ready: Callable[[str, str], None] | None = None,
    port: int | None = None,
    token: str | None = None,
) -> dict[str, Any]:
    """Serve until ``stop`` is set; ``ready(gateway_url, stream_url)`` once both listen.
    Returns the gateway's counters."""
    run_dir = Path(run_dir)
    token = await asyncio.to_thread(
        ensure_token, run_dir, token or os.environ.get(recipe.stream.token_env)
    )
    backend = build_backend(recipe, model_dir)
    gw: Gateway | None = None

    async def on_weights(update: WeightUpdate, *, policy: str | None = None) -> None:
        assert gw is not None
        chosen = policy or resume_policy(recipe.sync)  # the pusher's, else the recipe's
        await gw.sync(update, policy=chosen, strategy=None)  # type: ignore[arg-type]

    stream = TrajectoryStream(
        recipe.stream.spool_dir or run_dir / "spool",
        StreamConfig(
            buffer=BufferConfig(
                capacity=recipe.buffer.capacity,
                max_staleness=recipe.buffer.max_staleness,
                on_stale=recipe.buffer.on_stale,
                lease_ttl=recipe.buffer.lease_ttl,
            )
        ),
        on_weights=on_weights,
    )
    host = recipe.gateway.host
    async with backend:
        gw = Gateway(backend, config=gateway_config(recipe), publish=stream.publish)
        async with (
            stream,
            gw,
            serve_stream(
                stream, host=recipe.stream.host, port=recipe.stream.port, token=token
            ) as stream_url,
            serve_gateway(
                gw,
                host=host,
                port=recipe.gateway.port if port is None else port,
                token=None if is_loopback(host) else token,
            ) as url,
        ):
            if ready is not None:
                ready(url, stream_url)
            await stop.wait()
        return gw.status()


def main_gateway(
    recipe_path: str | Path,
    *,
    model: str | None = None,
    run_dir: str | Path | None = None,
    port: int | None = None,
    ready_file: str | Path | None = None,
) -> dict[str, Any]:
    """Serve a recipe's gateway until SIGTERM / SIGINT; live sessions end as abandoned."""
    import signal

    from agentroll.run.recipe import GatewaySection
    from agentroll.run.service import load_served_recipe
    from agentroll.run.worker import stop_on_signals

    recipe, out, model = load_served_recipe(
        recipe_path,
        run_dir=run_dir,
        model=model,
        port=port,
        port_bound=GatewaySection.bounds["port"],
    )

    async def main() -> dict[str, Any]:
        stop = asyncio.Event()

        def ready(url: str, stream_url: str) -> None:
            settle_heap()  # everything is imported and loaded: the serving heap starts here
            logger.warning(
                "gateway at %s (sessions: POST %s/sessions); trajectories at %s (token in %s)",
                url,
                url,
                stream_url,
                out / TOKEN_FILE,
            )
            if ready_file is not None:
                tmp = Path(ready_file).with_suffix(".tmp")
                info = {
                    "url": url,
                    "stream_url": stream_url,
                    "pid": os.getpid(),
                    "token_file": str(out / TOKEN_FILE),
                }
                tmp.write_text(json.dumps(info))
                tmp.replace(ready_file)

        with stop_on_signals(stop, (signal.SIGTERM, signal.SIGINT)):
            return await serve_recipe_gateway(
                recipe, model_dir=model, run_dir=out, stop=stop, ready=ready, port=port
            )

    return asyncio.run(main())


__all__ = ["gateway_config", "main_gateway", "serve_recipe_gateway"]
