"""``agentroll run``: the whole loop (tiny model, warm-up, worker process, HTTP stream,
trainer, delta syncs) on a few steps, and the run directory it leaves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agentroll.cli import main

REPO = Path(__file__).resolve().parents[2]
RECIPE = f"""
[run]
name = "t"
steps = 3
timeout = 300.0
[environment]
name = "calculator"
kwargs = {{ num_tasks = 64, max_operand = 9, traces = "{REPO}/examples/data/calculator_traces.jsonl" }}
[warmup]
steps = 2
expert = "agentroll.environments.calculator:demonstration"
tasks = 16
batch_size = 8
"""


@pytest.mark.slow
def test_run_writes_a_complete_run_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], small_fleet_toml: str
) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE + small_fleet_toml)
    run_dir = tmp_path / "run"
    assert main(["run", str(recipe), "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    line = re.search(r"^report steps=(\d+) .* episodes_restarted=(\d+) lost=(\d+) ", out, re.M)
    assert line is not None, out
    assert line.groups() == ("3", "0", "0")
    for name in ("recipe.toml", "versions.json", "seeds.json", "trainer.jsonl", "worker.jsonl"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "report.json").is_file() and (run_dir / "reward.png").is_file()
    steps = [json.loads(x) for x in (run_dir / "trainer.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert [s["version"] for s in steps] == [1, 2, 3]
    for s in steps:  # the staleness bound held for every batch
        assert s["trajectories"] == 8
        assert all(int(k) <= 1 for k in s["staleness"])
    # the worker took every pushed version
    syncs = [json.loads(x) for x in (run_dir / "worker.jsonl").read_text().splitlines()]
    assert [s["version"] for s in syncs if s["kind"] == "sync"] == [1, 2, 3]
    # the worker stopped on SIGTERM cleanly, after checkpointing what was in flight
    runs = [json.loads(x) for x in (run_dir / "run.jsonl").read_text().splitlines()]
    end = next(r for r in runs if r["kind"] == "run" and r["event"] == "end")
    assert end["worker_exit_code"] == 0
    assert "checkpointed" in (run_dir / "worker.log").read_text()
    # `agentroll report` reads the same directory again
    assert main(["report", str(run_dir)]) == 0
    # what each step trained on is recorded, and a replay says where it diverged (the
    # asynchronous loop is not deterministic: episodes finish in their own order)
    from agentroll.run.replay import read_log

    assert [(s["step"], len(s["trajectories"])) for s in read_log(run_dir)] == [
        (0, 8),
        (1, 8),
        (2, 8),
    ]
    capsys.readouterr()
    code = main(["run", "--replay", str(run_dir), "--run-dir", str(tmp_path / "replay")])
    out = capsys.readouterr().out
    assert code in (0, 1) and re.search(r"^replay (identical|diverged) ", out, re.M), out
    summary = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert summary["steps"] == 3 and (summary["divergence"] is None) == (code == 0)


def test_lost_counts_leased_trajectories_as_still_held() -> None:
    """Trajectories leased but not yet acknowledged are in the spool, not lost."""
    from agentroll.run.loop import lost_count

    status = {
        "stream": {"published": 10, "restored": 2, "acked": 6, "dropped_stale": 1},
        "buffer": {"queued": 2, "leased": 3},
        "spool": {"records": 5},
    }
    assert lost_count(status) == 0
    status["spool"]["records"] = 4  # one durable trajectory is gone from the spool
    assert lost_count(status) == 1
