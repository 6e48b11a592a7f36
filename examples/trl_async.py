"""TRL's AsyncGRPOTrainer trained from an agentroll worker's trajectory stream.

The worker runs the episodes (multi-turn, tools, sandboxes) and serves finished groups; TRL
leases them through ``AgentrollRolloutWorker``, trains, and pushes its weights back as delta
``WeightUpdate``s through ``AgentrollWeightTransfer`` (digest checked after every push).

    agentroll worker --recipe examples/recipes/demo.toml --run-dir /tmp/w --port 8600 &
    python examples/trl_async.py --url http://127.0.0.1:8600 --model /tmp/w/model \
        --run-dir /tmp/w --steps 3

``--model`` is the checkpoint the worker serves.  Needs ``pip install 'agentroll[trl]'``.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the worker's stream, http://127.0.0.1:PORT")
    p.add_argument("--model", required=True, help="the checkpoint the worker started from")
    p.add_argument("--run-dir", help="the worker's run directory, holding its stream.token")
    p.add_argument("--token", help="the worker's token (default: $AGENTROLL_STREAM_TOKEN)")
    p.add_argument("--out", default="trl-async-out", help="TRL's output directory")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="samples per optimizer step")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--cpu", action="store_true", help="train on a CPU-only torch")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from agentroll.integrations.trl_async import (
        AgentrollRolloutWorker,
        AgentrollWeightTransfer,
        digest_lines,
    )
    from agentroll.integrations.trl_cpu import cpu_training

    transfer = AgentrollWeightTransfer(args.url, token=args.token, run_dir=args.run_dir)
    worker = AgentrollRolloutWorker(
        args.url, token=args.token, run_dir=args.run_dir, weight_transfer=transfer
    )
    config = AsyncGRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        bf16=not args.cpu,
        use_cpu=args.cpu,
        gradient_checkpointing=False,
        token_budget=0,  # fixed-count micro-batches: there is no vLLM server to ask
        report_to="none",
        save_strategy="no",
        logging_steps=1,
    )
    with cpu_training() if args.cpu else contextlib.nullcontext():
        trainer = AsyncGRPOTrainer(
            model=args.model,
            args=config,
            # the prompts come from the worker's environment; TRL requires a dataset anyway
            train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]]}),
            rollout_worker=worker,
            weight_transfer=transfer,
        )
        trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h and "reward" in h]
    for i, h in enumerate(steps, 1):
        print(f"step={i} loss={h['loss']:.4e} reward={h['reward']:.4f}", flush=True)
    print("\n".join(digest_lines(transfer.history)), flush=True)
    return steps


if __name__ == "__main__":
    main()
