"""TRL's AsyncGRPOTrainer trained from an agentroll worker's stream, its weights pushed back.

The real trainer for 3 steps on CPU against ``agentroll worker`` (tiny model, built-in
engine, calculator), the worker killed with SIGKILL after step 1 and restarted: nothing is
handed to TRL twice, nothing acknowledged comes back, nothing taken and unacknowledged is
lost, and after every push the worker's digest is the trainer's.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# a missing [trl] extra skips with why (a failure under AGENTROLL_REQUIRE=trl)
_WHY: str | None = None
try:
    import trl  # noqa: F401
except ImportError as exc:
    _WHY = f"trl is not usable here: {exc}"
pytestmark = [pytest.mark.trl, pytest.mark.slow, *([pytest.mark.skip(reason=_WHY)] if _WHY else [])]

REPO = Path(__file__).resolve().parents[2]
RECIPE = """
[environment]
name = "digits_env:Digits"
kwargs = { num_tasks = 16, max_operand = 9 }
[backend]
replicas = 1
kv_cache_mb = 16
max_num_seqs = 16
prefill_budget = 256
[sampling]
max_tokens = 24
[rollout]
concurrency = 8
samples_per_task = 2
[sync]
policy = "keep"
[buffer]
max_staleness = "none"
lease_ttl = 2.0
[trainer]
batch_size = 4
"""


# The calculator with a reward the untrained tiny model earns in part (its reply's length, which
# varies between samples), so groups have non-zero advantages and the pushes changed bytes.
DIGITS_ENV = """
from agentroll import Rubric
from environments.calculator import Calculator

def length_share(completion: str, answer: object) -> float:
    return min(len(completion), 200) / 200

class Digits(Calculator):
    rubric = Rubric([length_share])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_worker(recipe: Path, model: Path, run_dir: Path, port: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "agentroll.cli", "worker", "--recipe", str(recipe)]
    cmd += ["--model", str(model), "--run-dir", str(run_dir), "--port", str(port)]
    cmd += ["--ready-file", str(run_dir / "ready.json")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(recipe.parent), str(REPO)])}
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )


def _wait_ready(proc: subprocess.Popen[str], ready: Path, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while not ready.exists():  # written once the stream is served
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "agentroll worker did not get ready"
        time.sleep(0.05)
    return str(json.loads(ready.read_text())["url"])


async def _offered_again(url: str, run_dir: Path, seconds: float) -> set[str]:
    """Ids the worker offers a fresh consumer within ``seconds`` (not acknowledged)."""
    from agentroll.stream.client import StreamClient

    ids: set[str] = set()
    deadline = time.monotonic() + seconds
    async with StreamClient(url, run_dir=run_dir, conversation=False) as client:
        while time.monotonic() < deadline:
            batch = await client.lease(256, wait=0.5)
            if batch is not None:
                ids.update(t.id for t in batch.trajectories)
    return ids


def test_async_grpo_trains_from_the_stream_across_a_worker_kill(
    tiny_model: Path, tmp_path: Path
) -> None:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from agentroll.integrations.trl_async import (
        AgentrollRolloutWorker,
        AgentrollWeightTransfer,
        digest_lines,
    )
    from agentroll.integrations.trl_cpu import cpu_training

    recipe, run_dir, port = tmp_path / "worker.toml", tmp_path / "worker", _free_port()
    recipe.write_text(RECIPE)
    (tmp_path / "digits_env.py").write_text(DIGITS_ENV)
    run_dir.mkdir()
    procs = [_start_worker(recipe, tiny_model, run_dir, port)]
    try:
        url = _wait_ready(procs[0], run_dir / "ready.json")
        transfer = AgentrollWeightTransfer(url, run_dir=run_dir, policy="recompute")
        worker = AgentrollRolloutWorker(url, run_dir=run_dir, weight_transfer=transfer)

        class KillWorker(TrainerCallback):
            """After step 1: SIGKILL the worker and start it again on the same port."""

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.global_step == 1:
                    procs[0].send_signal(signal.SIGKILL)
                    procs[0].wait(timeout=30)
                    (run_dir / "ready.json").unlink()
                    procs.append(_start_worker(recipe, tiny_model, run_dir, port))

        config = AsyncGRPOConfig(
            output_dir=str(tmp_path / "trl"),
            max_steps=3,
            per_device_train_batch_size=4,
            learning_rate=1e-3,
            bf16=False,
            gradient_checkpointing=False,
            token_budget=0,  # fixed-count micro-batches: no vLLM server to ask for max_model_len
            max_staleness=100,  # everything taken is trained: the test audits ids
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            use_cpu=True,
            disable_tqdm=True,
        )
        with cpu_training():
            trainer = AsyncGRPOTrainer(
                model=str(tiny_model),
                args=config,
                # the prompts come from the agentroll worker; TRL requires a dataset anyway
                train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]]}),
                callbacks=[KillWorker()],
                rollout_worker=worker,
                weight_transfer=transfer,
            )
            trainer.train()
        url = _wait_ready(procs[-1], run_dir / "ready.json")
        offered = asyncio.run(_offered_again(url, run_dir, seconds=4.0))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    steps = [h for h in trainer.state.log_history if "loss" in h and "reward" in h]
    pushes = transfer.history
    for i, h in enumerate(steps):
        print(
            f"step={i + 1} loss={h['loss']:.3e} grad_norm={h['grad_norm']:.3e} reward={h['reward']:.4f}"
        )
    print("\n".join(digest_lines(pushes)))
    assert len(steps) == 3 and all(math.isfinite(h["loss"]) for h in steps)
    assert any(h["reward"] > 0 for h in steps) and any(h["grad_norm"] > 0 for h in steps)
    # cold sync (full) + one per step (deltas), and a full update for the restarted worker
    # (back at its checkpoint): sent when the rollout thread reconnected or at the next sync
    assert all(p.digest_match for p in pushes)
    assert pushes[0].kind == "full" and [p.kind for p in pushes].count("full") == 2
    assert len(pushes) in (4, 5) and pushes[-1].version == pushes[0].version + 3
    assert any(p.kind == "delta" and p.payload_bytes > 0 for p in pushes)  # trained bytes
    assert len(procs) == 2  # the kill happened (the rollout thread may not have noticed it)
    # nothing handed to the trainer twice, across the kill
    assert len(worker.taken) == len(set(worker.taken)) >= 12
    acked, taken = set(worker.acked), set(worker.taken)
    assert acked and acked <= taken
    # an acknowledged trajectory left the spool; a taken, unacknowledged one was not lost
    assert not offered & acked
    assert taken - acked <= offered
    # each push paused the worker's generations under the transfer's own resume policy
    events = [json.loads(line) for line in (run_dir / "worker.jsonl").read_text().splitlines()]
    syncs = [e for e in events if e.get("kind") == "sync"]
    assert syncs and {e["policy"] for e in syncs} == {"recompute"}
