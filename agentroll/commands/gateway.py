"""``agentroll gateway``: serve a recipe's OpenAI-compatible gateway and trajectory stream.

Outside agents create a session (``POST /sessions``) and call
``/sessions/{sid}/v1/chat/completions``; ended sessions stream to trainers.  Prints one
JSON summary line when stopped (SIGTERM / SIGINT).
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", required=True, help="recipe TOML (its [gateway] section)")
    parser.add_argument("--port", type=int, default=None, help="gateway port (default: recipe's)")
    parser.add_argument("--run-dir", default=None, help="spool and token (default: recipe's dir)")
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the recipe's)")
    parser.add_argument("--ready-file", default=None, help="write {url, stream_url, pid} here")


def main(args: argparse.Namespace) -> int:
    from agentroll.run.gateway import main_gateway

    summary = main_gateway(
        args.recipe,
        model=args.model,
        run_dir=args.run_dir,
        port=args.port,
        ready_file=args.ready_file,
    )
    print(json.dumps(summary), flush=True)
    return 0
