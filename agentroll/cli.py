"""Command line: ``agentroll run | worker | report | bench | validate | envs | model``.  Each subcommand maps to one function here;
errors from agentroll print one line that says what to do, and exit with status 2."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from agentroll.errors import AgentrollError


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentroll",
        description="Rollout engine for RL post-training of tool-using LLM agents.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks (one key=value result line each)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    ov = bsub.add_parser(
        "overhead", help="engine overhead per tool turn (mock backend, real token path)"
    )
    ov.add_argument("--episodes", type=int, default=2000)
    ov.add_argument("--turns", type=int, default=4, help="tool turns per episode")
    ov.add_argument("--concurrency", type=int, default=256)

    eng = bsub.add_parser("engine", help="built-in engine tokens/s vs transformers (and vLLM)")
    eng.add_argument("--concurrency", type=int, default=32)
    eng.add_argument("--max-tokens", type=int, default=128)
    eng.add_argument(
        "--model", default=None, help="checkpoint dir (default: the tiny model, created if missing)"
    )
    eng.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads for every system measured"
    )

    sync = bsub.add_parser("sync", help="delta weight updates: bytes vs verl, encode/apply GB/s")
    sync.add_argument("--params", type=int, default=50_000_000)
    sync.add_argument("--changed", type=float, default=0.01, help="fraction of elements changed")
    sync.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])

    bp = bsub.add_parser(
        "pause", help="weight syncs during fleet rollouts: pauses, restarts, busy fraction"
    )
    bp.add_argument("--replicas", type=int, default=4)
    bp.add_argument("--episodes", type=int, default=64)
    bp.add_argument("--syncs", type=int, default=10)
    bp.add_argument(
        "--strategy", default="rolling", choices=["pause", "rolling", "drain", "background"]
    )
    bp.add_argument("--policy", default="keep", choices=["keep", "recompute", "restart"])
    bp.add_argument("--max-tokens", type=int, default=96, help="tokens per generation")
    bp.add_argument("--seed", type=int, default=0)
    bp.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    bp.add_argument(
        "--prefill-budget",
        type=int,
        default=512,
        help="tokens per engine step (bounds how long a pause waits for the step in flight)",
    )
    bp.add_argument(
        "--in-flight",
        default="migrate",
        choices=["migrate", "finish"],
        help="rolling: calls in flight on a group move at once (with their KV) or finish there "
        "first (moved after 5 s)",
    )
    bp.add_argument(
        "--kind",
        default="local",
        choices=["local", "ray"],
        help="replicas in this process, or Ray actors on a local loopback-only cluster",
    )

    bst = bsub.add_parser("stream", help="trajectory streaming MB/s end to end vs loopback/disk")
    bst.add_argument("--trajectories", type=int, default=20_000)
    bst.add_argument("--tokens", type=int, default=2048, help="tokens per trajectory")

    from agentroll.bench.chaos import add_cli_args as add_chaos_args

    add_chaos_args(
        bsub.add_parser(
            "chaos", help="SIGKILL a served worker at random moments: lost / duplicated / split"
        )
    )

    bsb = bsub.add_parser(
        "sandbox", help="sandbox acquire / cold start / exec latency vs `docker exec` (or sh)"
    )
    bsb.add_argument("--backend", choices=["docker", "local"], default="docker")
    bsb.add_argument("--execs", type=int, default=200, help="timed execs of each kind")
    bsb.add_argument(
        "--docker-host",
        default=None,
        help="daemon URL (default: $AGENTROLL_DOCKER_HOST, else $DOCKER_HOST, else the "
        "sandbox's default)",
    )
    bsb.add_argument("--acquires", type=int, default=20, help="timed starts from a full pool")
    bsb.add_argument("--cold-starts", type=int, default=10, help="timed starts without a pool")

    bvl = bsub.add_parser("vllm", help="vllm backend tokens/s vs AsyncLLM.generate directly")
    bvl.add_argument("--concurrency", type=int, default=16)
    bvl.add_argument("--max-tokens", type=int, default=64)
    bvl.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    bvl.add_argument("--rounds", type=int, default=5, help="timed rounds of each kind")

    val = sub.add_parser("validate", help="learning-semantics checks of a backend")
    val.add_argument("--backend", choices=["torch", "vllm"], default="torch")
    val.add_argument("--model", default=None, help="checkpoint dir (default: the tiny model)")
    val.add_argument("--device", default="cpu", help="torch device of the engine (cpu, cuda)")

    wk = sub.add_parser(
        "worker",
        help="rollout worker: with --recipe it serves the trajectory stream until stopped; "
        "with --env it runs the tasks into --out.  SIGTERM checkpoints in-flight episodes "
        "and a restart continues them",
    )
    wk.add_argument("--recipe", default=None, help="recipe TOML: serve its rollouts over HTTP")
    wk.add_argument("--port", type=int, default=None, help="stream port (default: the recipe's)")
    wk.add_argument("--run-dir", default=None, help="metrics, spool and checkpoints (--recipe)")
    wk.add_argument("--ready-file", default=None, help="write {url, pid} here once serving")
    wk.add_argument("--env", default=None, help="environment name or module:Class")
    wk.add_argument("--backend", choices=["torch", "mock"], default="torch")
    wk.add_argument("--model", default=None, help="torch checkpoint dir (default: the tiny model)")
    wk.add_argument("--device", default="cpu", help="torch device of the engine (cpu, cuda)")
    wk.add_argument("--tasks", type=int, default=None, help="the first N tasks (default: all)")
    wk.add_argument("--seed", type=int, default=0, help="rollout seed")
    wk.add_argument("--out", default=None, help="trajectories file: .jsonl or .msgpack")
    wk.add_argument("--checkpoint-dir", default=None, help="where in-flight episodes go")
    wk.add_argument(
        "--no-kv", action="store_true", help="checkpoint without KV (the restart recomputes it)"
    )
    wk.add_argument("--concurrency", type=int, default=8)
    wk.add_argument("--max-tokens", type=int, default=256, help="tokens per generation")
    wk.add_argument(
        "--batch-invariant", action="store_true", help="exact continuation (slower engine)"
    )
    wk.add_argument("--mock-latency", type=float, default=0.0, help="seconds per mock reply")

    sub.add_parser("envs", help="list the built-in environments")

    sbx = sub.add_parser("sandbox", help="sandbox audit and docker sandbox housekeeping")
    sbsub = sbx.add_subparsers(dest="sandbox_command", required=True)
    for name, text in (
        ("ls", "list agentroll's containers at the daemon"),
        ("reap", "remove containers past their TTL or whose owner process is gone"),
    ):
        sp = sbsub.add_parser(name, help=text)
        sp.add_argument("--docker-host", default=None, help="daemon URL (default: $DOCKER_HOST)")
    aud = sbsub.add_parser(
        "audit", help="escape and limit probes inside a sandbox (one status line per probe)"
    )
    aud.add_argument("--backend", default="local", choices=["local", "docker"])
    aud.add_argument("--docker-host", default=None, help="daemon URL (default: $DOCKER_HOST)")
    aud.add_argument("--probe", action="append", default=None, help="run only this probe")

    run = sub.add_parser("run", help="run a recipe end to end (rollout worker + trainer)")
    run.add_argument("recipe", metavar="RECIPE", help="recipe TOML file")
    run.add_argument("--run-dir", default=None, help="run directory (default: under run.out_dir)")

    rep = sub.add_parser("report", help="table, plots and tuning advice of a run's metric trace")
    rep.add_argument(
        "run_dir", metavar="RUN_DIR", help="run directory holding *.jsonl metric files"
    )

    model = sub.add_parser("model", help="model checkpoints")
    msub = model.add_subparsers(dest="model_command", required=True)
    sizes = msub.add_parser("sizes", help="training-state vs inference-export sizes of a model")
    sizes.add_argument(
        "target",
        metavar="MODEL",
        help="checkpoint dir (with config.json) or a parameter count, e.g. 70e9",
    )
    sizes.add_argument("--dtype", default="bfloat16", help="serving dtype of the inference export")
    tiny = msub.add_parser(
        "create-tiny", help="write the project-made tiny Qwen2 checkpoint (offline)"
    )
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--hidden", type=int, default=128, help="hidden size (heads x 64)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:  # httpx logs one INFO line per request (a stream client makes many)
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        if args.command == "bench" and args.bench == "overhead":
            from agentroll.bench.overhead import main_overhead

            for name in ("episodes", "turns", "concurrency"):
                if getattr(args, name) < 1:
                    raise SystemExit(f"--{name} must be >= 1")
            main_overhead(args.episodes, args.turns, args.concurrency)
        elif args.command == "bench" and args.bench == "engine":
            from agentroll.bench.engine import main_engine

            if args.concurrency < 1 or args.max_tokens < 1:
                raise SystemExit("--concurrency and --max-tokens must be >= 1")
            main_engine(args.concurrency, args.max_tokens, args.model, args.threads)
        elif args.command == "validate":
            from agentroll.model.tiny import ensure_tiny_model
            from agentroll.validate import run_checks

            if args.backend == "vllm":
                import asyncio

                from agentroll.validate.vllm import run_vllm_checks

                results = asyncio.run(run_vllm_checks(ensure_tiny_model(args.model)))
            else:
                results = run_checks(ensure_tiny_model(args.model), device=args.device)
            for r in results:
                print(r.line(), flush=True)
            return 0 if all(r.passed for r in results) else 1
        elif args.command == "model" and args.model_command == "sizes":
            from agentroll.model.sizes import sizes_for_checkpoint, sizes_for_params

            try:
                result = sizes_for_params(int(float(args.target)), args.dtype)
            except ValueError:
                result = sizes_for_checkpoint(args.target, args.dtype)
            print(result.line())
        elif args.command == "bench" and args.bench == "pause":
            import asyncio

            from agentroll.bench.pause import format_line, run_pause_bench

            if args.replicas < 1 or args.episodes < 2 or not 0 < args.syncs < args.episodes:
                raise SystemExit("need --replicas >= 1 and 0 < --syncs < --episodes")
            figures = asyncio.run(
                run_pause_bench(
                    replicas=args.replicas,
                    episodes=args.episodes,
                    syncs=args.syncs,
                    strategy=args.strategy,
                    policy=args.policy,
                    model=args.model,
                    max_tokens=args.max_tokens,
                    seed=args.seed,
                    kind=args.kind,
                    in_flight=args.in_flight,
                    prefill_budget=args.prefill_budget,
                )
            )
            print(format_line(figures))
        elif args.command == "bench" and args.bench == "sync":
            from agentroll.bench.sync import main_sync

            if args.params < 1 or not 0 <= args.changed <= 1:
                raise SystemExit("--params must be >= 1 and --changed within [0, 1]")
            main_sync(args.params, args.changed, args.dtype)
        elif args.command == "bench" and args.bench == "stream":
            from agentroll.bench.stream import main_stream

            if args.trajectories < 1 or args.tokens < 9:
                raise SystemExit("--trajectories must be >= 1 and --tokens >= 9")
            main_stream(args.trajectories, args.tokens)
        elif args.command == "bench" and args.bench == "chaos":
            from agentroll.bench.chaos import main as main_chaos

            return main_chaos(args)
        elif args.command == "bench" and args.bench == "sandbox":
            from agentroll.bench.sandbox import main_sandbox

            for name in ("execs", "acquires", "cold_starts"):
                if getattr(args, name) < 1:
                    raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
            main_sandbox(
                args.backend,
                args.execs,
                docker_host=args.docker_host,
                acquires=args.acquires,
                cold_starts=args.cold_starts,
            )
        elif args.command == "bench" and args.bench == "vllm":
            from agentroll.bench.vllm import main_vllm

            main_vllm(args.concurrency, args.max_tokens, args.model, args.rounds)
        elif args.command == "model" and args.model_command == "create-tiny":
            from agentroll.model.tiny import create_tiny

            if args.hidden % 64 or args.hidden < 64:
                raise SystemExit("--hidden must be a positive multiple of 64 (head_dim is 64)")
            out = create_tiny(
                args.dir,
                seed=args.seed,
                layers=args.layers,
                hidden=args.hidden,
                heads=args.hidden // 64,
            )
            print(f"wrote {out}")
        elif args.command == "sandbox" and args.sandbox_command == "audit":
            from agentroll.sandbox.audit import main_audit

            return main_audit(args.backend, docker_host=args.docker_host, probes=args.probe)
        elif args.command == "sandbox":
            from agentroll.sandbox import docker as docker_sandbox

            if args.sandbox_command == "reap":
                print(f"reaped={docker_sandbox.reap(args.docker_host)}")
            else:
                for line in docker_sandbox.describe_containers(args.docker_host):
                    print(line)
        elif args.command == "run":
            from agentroll.run.loop import run_recipe

            return run_recipe(args.recipe, run_dir=args.run_dir)
        elif args.command == "report":
            from agentroll.run.report import main_report

            return main_report(args.run_dir)
        elif args.command == "worker" and args.recipe is not None:
            from agentroll.run.service import main_service

            served = main_service(
                args.recipe,
                model=args.model,
                run_dir=args.run_dir,
                checkpoint_dir=args.checkpoint_dir,
                port=args.port,
                ready_file=args.ready_file,
            )
            print(json.dumps(served), flush=True)
        elif args.command == "worker":
            from agentroll.run.worker import main_worker

            if args.env is None or args.out is None or args.checkpoint_dir is None:
                raise SystemExit(
                    "agentroll worker needs --recipe, or --env, --out and --checkpoint-dir"
                )

            summary = main_worker(
                env=args.env,
                backend=args.backend,
                model=args.model,
                device=args.device,
                num_tasks=args.tasks,
                seed=args.seed,
                out=args.out,
                checkpoint_dir=args.checkpoint_dir,
                with_kv=not args.no_kv,
                concurrency=args.concurrency,
                max_tokens=args.max_tokens,
                batch_invariant=args.batch_invariant,
                mock_latency=args.mock_latency,
            )
            print(summary.line(), flush=True)
        elif args.command == "envs":
            import pkgutil

            import agentroll.environments as builtin
            from agentroll.env import environment_class

            for mod in sorted(m.name for m in pkgutil.iter_modules(builtin.__path__)):
                cls = environment_class(mod)
                doc = (cls.__doc__ or "").strip().splitlines()
                print(f"{mod:16s} {doc[0] if doc else ''}")
    except AgentrollError as exc:
        print(f"agentroll: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
