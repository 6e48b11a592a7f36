"""``agentroll gateway --recipe``: sessions through the built-in engine reach a trainer
through the durable stream, exactly as the gateway captured them."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from agentroll.run.gateway import serve_recipe_gateway
from agentroll.run.recipe import parse_recipe
from agentroll.stream.client import StreamClient

RECIPE = """
[backend]
kind = "torch"
[gateway]
idle_timeout = 60
max_tokens = 8
[buffer]
max_staleness = "none"
"""


async def test_gateway_sessions_reach_the_stream(tiny_model: Path, tmp_path: Path) -> None:
    recipe = parse_recipe(RECIPE)
    stop = asyncio.Event()
    urls: list[str] = []
    ready = asyncio.Event()

    def on_ready(url: str, stream_url: str) -> None:
        urls.extend([url, stream_url])
        ready.set()

    server = asyncio.create_task(
        serve_recipe_gateway(
            recipe, model_dir=tiny_model, run_dir=tmp_path, stop=stop, ready=on_ready
        )
    )
    await asyncio.wait_for(ready.wait(), 120)
    url, stream_url = urls
    async with httpx.AsyncClient(timeout=60) as http:
        sid = (await http.post(f"{url}/sessions", json={"task_id": "t"})).json()["id"]
        chat = f"{url}/sessions/{sid}/v1/chat/completions"
        messages = [{"role": "user", "content": "hello"}]
        replies = []
        for _ in range(2):
            reply = (await http.post(chat, json={"messages": messages, "seed": 3})).json()
            replies.append(reply)
            messages += [reply["choices"][0]["message"], {"role": "user", "content": "more"}]
        await http.post(f"{url}/sessions/{sid}/reward", json={"reward": 0.5})
        assert (await http.post(f"{url}/sessions/{sid}/end")).json()["samples"] == 1
    client = StreamClient(stream_url, run_dir=tmp_path)
    batch = await client.lease(8, wait=10)
    assert batch is not None and len(batch.trajectories) == 1
    traj = batch.trajectories[0]
    await client.ack([traj.id])
    stop.set()
    await asyncio.wait_for(server, 60)
    assert traj.reward == 0.5 and not traj.forks and len(traj.turns) == 2
    ids = traj.token_ids.tolist()
    for reply, turn in zip(replies, traj.turns, strict=True):
        # the reply's prompt is a prefix; its sampled ids are the trajectory's, in place
        prompt = reply["prompt_token_ids"]
        assert ids[: len(prompt)] == prompt and turn.gen_start == len(prompt)
        choice = reply["choices"][0]
        assert ids[turn.gen_start : turn.gen_end] == choice["token_ids"]
        np.testing.assert_allclose(
            traj.logprobs[turn.gen_start : turn.gen_end], choice["token_logprobs"], rtol=1e-6
        )
    assert int(traj.loss_mask.sum()) == sum(t.gen_end - t.gen_start for t in traj.turns)


@pytest.mark.slow
def test_agentroll_gateway_serves_until_sigterm(tiny_model: Path, tmp_path: Path) -> None:
    """The CLI: serves, says where (ready file), answers a call, stops on SIGTERM with a
    summary line, the session it left open published as abandoned."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE)
    ready = tmp_path / "ready.json"
    cmd = [sys.executable, "-m", "agentroll.cli", "gateway", "--recipe", str(recipe)]
    cmd += ["--model", str(tiny_model), "--run-dir", str(tmp_path), "--ready-file", str(ready)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():  # the process writes it once both servers listen
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "agentroll gateway did not get ready"
            time.sleep(0.05)
        url = json.loads(ready.read_text())["url"]
        sid = httpx.post(f"{url}/sessions", json={"task_id": "cli"}).json()["id"]
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            headers={"authorization": f"Bearer {sid}"},
            json={"messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
        assert reply.status_code == 200 and reply.json()["choices"][0]["token_ids"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["calls"] == 1 and summary["abandoned"] == 1
    assert summary["sessions"] == 1 and summary["sessions_live"] == 0
