"""``agentroll serve-env NAME``: serve an agentroll environment as an OpenEnv server.

OpenEnv clients (``GenericEnvClient``, ``MCPToolClient``) then drive it: reset/step/state
over HTTP and WebSocket, its tools over MCP.  Binds 127.0.0.1 unless ``--host`` says
otherwise; off loopback a bearer token is required (given, or generated and printed).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="environment: a built-in name, module:Class or entry point")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    parser.add_argument(
        "--kwargs", default="{}", help="JSON object of the environment's constructor arguments"
    )
    parser.add_argument("--max-sessions", type=int, default=64, help="concurrent sessions")
    parser.add_argument(
        "--token", default=None, help="bearer token clients must send (default: none on loopback)"
    )


def main(args: argparse.Namespace) -> int:
    from agentroll.errors import ConfigError
    from agentroll.integrations import openenv_server as srv

    try:
        kwargs = json.loads(args.kwargs)
    except ValueError as exc:
        raise ConfigError(f"--kwargs is not JSON: {exc}") from exc
    if not isinstance(kwargs, dict):
        raise ConfigError("--kwargs must be a JSON object, e.g. '{\"num_tasks\": 10}'")
    token = args.token
    if token is None and not srv.is_loopback(args.host):
        token = secrets.token_urlsafe(24)  # off loopback the server is never open
    app = srv.create_app(args.name, max_sessions=args.max_sessions, token=token, **kwargs)
    sock = srv.bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    ready = {"url": f"http://{shown}:{port}", "pid": os.getpid()}
    if token is not None and args.token is None:
        ready["token"] = token

    def announce() -> None:  # once it listens, so a reader may connect at once
        print(json.dumps(ready), flush=True)

    srv.server_for(app, announce).run(sockets=[sock])  # until SIGINT / SIGTERM
    return 0
