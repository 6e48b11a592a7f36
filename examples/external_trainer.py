"""An external trainer: Hugging Face transformers + plain torch, fed by an agentroll worker.

It knows nothing of agentroll's internals except the stream client: it leases batches of
trajectories over HTTP, trains on them (a token-level policy gradient with group-normalised
advantages, importance-weighted by the rollout's behaviour logprobs), acknowledges them, and
pushes the new weights back as a delta ``WeightUpdate`` while the worker keeps generating.

    agentroll worker --recipe examples/recipes/demo.toml --run-dir /tmp/w --port 8600 &
    python examples/external_trainer.py --url http://127.0.0.1:8600 --model /tmp/w/model \
        --run-dir /tmp/w

``--model`` is the checkpoint the worker serves (its version 0).  The worker requires its
bearer token: ``--token``, else ``$AGENTROLL_STREAM_TOKEN``, else the ``stream.token`` the
worker wrote into ``--run-dir``.  Needs ``transformers``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from agentroll import StreamClient, Trajectory, WeightExporter


def advantages(batch: list[Trajectory]) -> list[float]:
    """Reward minus its group's mean, over the group's std (0 for a group of one)."""
    groups: dict[str, list[float]] = defaultdict(list)
    for t in batch:
        groups[t.group_id].append(t.reward)
    out = []
    for t in batch:
        rewards = np.asarray(groups[t.group_id])
        std = rewards.std(ddof=1) if len(rewards) > 1 else 0.0
        out.append(0.0 if std == 0 else float((t.reward - rewards.mean()) / (std + 1e-6)))
    return out


def train_step(
    model: Any, optimizer: torch.optim.Optimizer, batch: list[Trajectory], cap: float = 5.0
) -> dict[str, float]:
    """One optimizer step: -min(r, cap) * A * logp over the sampled tokens (r is the ratio
    of the current to the behaviour probability, without gradient)."""
    n = max(t.num_tokens for t in batch)
    ids = torch.zeros(len(batch), n, dtype=torch.long)
    attn = torch.zeros(len(batch), n, dtype=torch.long)
    mask = torch.zeros(len(batch), n)
    behaviour = torch.zeros(len(batch), n)
    for i, t in enumerate(batch):
        ids[i, : t.num_tokens] = torch.from_numpy(t.token_ids.astype(np.int64))
        attn[i, : t.num_tokens] = 1
        mask[i, : t.num_tokens] = torch.from_numpy(t.loss_mask.astype(np.float32))
        behaviour[i, : t.num_tokens] = torch.from_numpy(np.nan_to_num(t.logprobs))
    adv = torch.tensor(advantages(batch)).unsqueeze(1)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:]
    ratio = torch.exp(logp.detach() - behaviour[:, 1:]).clamp(max=cap)
    loss = -(ratio * adv * logp * m).sum() / m.sum().clamp(min=1)
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    rewards = [t.reward for t in batch]
    mean_ratio = float((ratio * m).sum() / m.sum().clamp(min=1))
    return {"loss": loss.item(), "reward": float(np.mean(rewards)), "ratio": mean_ratio}


async def main_async(args: argparse.Namespace) -> list[dict[str, float]]:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # the worker holds the checkpoint's tensors: export exactly those names
    with safe_open(os.path.join(args.model, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    exporter = WeightExporter(lambda: {k: v for k, v in model.state_dict().items() if k in names})
    history = []
    async with (
        # it trains on the token arrays: the trajectories' turns and messages are not decoded
        StreamClient(
            args.url, token=args.token, run_dir=args.run_dir, conversation=False
        ) as client,
        contextlib.aclosing(client.batches(max=args.batch_size, wait=5.0)) as batches,
    ):
        for step in range(args.steps):
            batch: list[Trajectory] = []
            while len(batch) < args.batch_size:
                batch.extend(await anext(batches))
            stats = await asyncio.to_thread(train_step, model, optimizer, batch)
            await client.ack(t.id for t in batch)
            await client.push_weights(exporter.export())  # a delta against the last push
            history.append(stats)
            print(
                f"step={step} version={exporter.version} "
                + " ".join(f"{k}={v:.4f}" for k, v in stats.items()),
                flush=True,
            )
    return history


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the worker's stream, http://127.0.0.1:PORT")
    p.add_argument("--model", required=True, help="the checkpoint the worker started from")
    p.add_argument("--token", help="the worker's token (default: $AGENTROLL_STREAM_TOKEN)")
    p.add_argument("--run-dir", help="the worker's run directory, holding its stream.token")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-4)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    main()
