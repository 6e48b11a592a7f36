"""Replay's comparison on synthetic logs: identical runs, and the first differing step,
trajectory and token named; the log written per step; bad run directories."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from agentroll.commands.run import replay
from agentroll.errors import ConfigError
from agentroll.run.replay import (
    TrainedLog,
    first_divergence,
    read_log,
    step_record,
    version_changes,
)
from agentroll.types import Trajectory


def traj(task: str, sample: int, tokens: list[int], reward: float = 1.0) -> Trajectory:
    t = Trajectory(id=f"{task}-{sample}", task_id=task, group_id="g", sample_index=sample)
    t.token_ids = np.asarray(tokens, dtype=np.int32)
    t.reward = reward
    return t


LOG = [
    step_record(0, [traj("b", 0, [1, 2, 3]), traj("a", 1, [4, 5])]),
    step_record(1, [traj("c", 0, [6, 7, 8, 9])]),
]


def test_records_are_sorted_so_finishing_order_does_not_matter() -> None:
    again = step_record(0, [traj("a", 1, [4, 5]), traj("b", 0, [1, 2, 3])])
    assert again == LOG[0] and [t["task"] for t in again["trajectories"]] == ["a", "b"]
    assert first_divergence(LOG, copy.deepcopy(LOG)) is None


def test_the_first_difference_is_named() -> None:
    other = copy.deepcopy(LOG)
    other[1]["trajectories"][0]["tokens"][2] = 99
    d = first_divergence(LOG, other)
    assert d is not None and (d.step, d.index, d.task, d.token, d.what) == (1, 0, "c", 2, "tokens")
    assert d.line() == "replay diverged step=1 trajectory=0 task=c sample=0 token=2 what=tokens"
    other = copy.deepcopy(LOG)
    other[0]["trajectories"][1]["tokens"].append(7)  # b's tokens run on: differs at the end
    d = first_divergence(LOG, other)
    assert d is not None and (d.index, d.token) == (1, 3)
    other = copy.deepcopy(LOG)
    other[0]["trajectories"][0]["reward"] = 0.0
    assert first_divergence(LOG, other).what == "reward"  # type: ignore[union-attr]
    other = copy.deepcopy(LOG)
    other[0]["trajectories"][0]["task"] = "z"
    assert first_divergence(LOG, other).what == "task"  # type: ignore[union-attr]
    assert first_divergence(LOG, LOG[:1]).what == "steps"  # type: ignore[union-attr]
    shorter = copy.deepcopy(LOG)
    del shorter[0]["trajectories"][1]
    d = first_divergence(LOG, shorter)
    assert d is not None and (d.what, d.index, d.task) == ("batch_size", 1, "b")


def test_the_log_is_written_a_line_per_step(tmp_path: Path) -> None:
    log = TrainedLog(tmp_path)
    log.write(0, [traj("b", 0, [1, 2, 3]), traj("a", 1, [4, 5])])
    assert read_log(tmp_path) == [LOG[0]]  # flushed: readable before the run ends
    log.write(1, [traj("c", 0, [6, 7, 8, 9])])
    log.close()
    assert read_log(tmp_path) == LOG
    assert json.loads((tmp_path / "trained.jsonl").read_text().splitlines()[1])["step"] == 1


def test_version_changes_name_each_package() -> None:
    assert version_changes({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}) == [
        "b 2 -> 3",
        "c absent -> 4",
    ]


def test_a_directory_that_is_not_a_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no recipe\.toml"):
        replay(tmp_path)
    (tmp_path / "recipe.toml").write_text("")
    with pytest.raises(ConfigError, match=r"trained\.jsonl is missing"):
        replay(tmp_path)
