"""examples/external_trainer.py against a real worker: a transformers model trained from the
stream alone, its weights pushed back as deltas the worker applies mid-run."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from agentroll.run.metrics import read_trace
from agentroll.run.recipe import parse_recipe
from agentroll.run.service import RolloutService

REPO = Path(__file__).resolve().parents[1]
RECIPE = """
[environment]
name = "calculator"
kwargs = { num_tasks = 32, max_operand = 9 }
"""


@pytest.mark.slow
async def test_external_trainer_trains_from_the_stream(
    tiny_model: Path, tmp_path: Path, small_fleet_toml: str
) -> None:
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("ext", REPO / "examples" / "external_trainer.py")
    assert spec is not None and spec.loader is not None
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)

    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    service = RolloutService(
        parse_recipe(RECIPE + small_fleet_toml), model_dir=tiny_model, run_dir=tmp_path
    )
    task = asyncio.create_task(service.serve(stop, ready=ready.set_result))
    try:
        url = await asyncio.wait_for(asyncio.shield(ready), 60)
        args = ext.parse_args(
            [
                *("--url", url, "--model", str(tiny_model), "--steps", "2", "--batch-size", "8"),
                *("--run-dir", str(tmp_path)),  # where the worker wrote its stream.token
            ]
        )
        history = await ext.main_async(args)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert len(history) == 2
    # transformers scores the engine's samples as the engine did: the first ratio is 1
    assert history[0]["ratio"] == pytest.approx(1.0, abs=1e-3)
    assert [s.version for s in read_trace(tmp_path).syncs] == [1, 2]
