"""Reproducible runs: what each training step trained on, and where a replay diverged.

A run writes ``trained.jsonl``: per trainer step, every trajectory it trained on as (task,
sample, reward, token ids), sorted, so two runs compare step by step whatever order their
episodes finished in.  ``first_divergence`` (pure) names the first step, trajectory and
token where two such logs differ (``agentroll run --replay RUN_DIR``, in
``agentroll.commands.run``, runs the recorded recipe again and reports it).  Invariants: a log line is flushed when its step is trained; no I/O in the
comparison.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from agentroll.errors import ConfigError
from agentroll.types import Trajectory

LOG = "trained.jsonl"


def step_record(step: int, batch: Iterable[Trajectory]) -> dict[str, Any]:
    """One line of ``trained.jsonl``: the step and its trajectories, sorted."""
    items = sorted(
        (t.task_id, t.sample_index, float(t.reward), [int(x) for x in t.token_ids]) for t in batch
    )
    return {
        "step": step,
        "trajectories": [
            {"task": task, "sample": sample, "reward": reward, "tokens": tokens}
            for task, sample, reward, tokens in items
        ],
    }


class TrainedLog:
    """Appends a ``step_record`` per trained step to ``RUN_DIR/trained.jsonl``."""

    def __init__(self, run_dir: Path) -> None:
        self._file: TextIO = (run_dir / LOG).open("a", encoding="utf-8")

    def write(self, step: int, batch: Iterable[Trajectory]) -> None:
        self._file.write(json.dumps(step_record(step, batch), separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_log(run_dir: Path) -> list[dict[str, Any]]:
    """The steps of a run's ``trained.jsonl``, in order; ``ConfigError`` if it has none."""
    path = run_dir / LOG
    if not path.is_file():
        raise ConfigError(
            f"{path} is missing: {run_dir} is not a run directory of this agentroll version "
            "(runs record what they trained on since the replay feature)"
        )
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where two runs first differ: ``step``, the ``index``-th trajectory of it (its task
    and sample in the recorded run), the first differing token position (None: the tokens
    agree and ``what`` says what differs)."""

    step: int
    index: int
    task: str
    sample: int
    token: int | None
    what: str

    def line(self) -> str:
        token = "" if self.token is None else f" token={self.token}"
        return (
            f"replay diverged step={self.step} trajectory={self.index} task={self.task} "
            f"sample={self.sample}{token} what={self.what}"
        )


def first_divergence(
    recorded: Sequence[dict[str, Any]], replayed: Sequence[dict[str, Any]]
) -> Divergence | None:
    """The first difference between two ``trained.jsonl`` logs, or None when every step
    of the shorter one matches and they have as many steps."""
    for a, b in zip(recorded, replayed, strict=False):
        step = int(a["step"])
        ta, tb = a["trajectories"], b["trajectories"]
        for i, (x, y) in enumerate(zip(ta, tb, strict=False)):
            if (x["task"], x["sample"]) != (y["task"], y["sample"]):
                return Divergence(step, i, x["task"], x["sample"], None, "task")
            if x["tokens"] != y["tokens"]:
                pos = next(
                    (
                        k
                        for k, (p, q) in enumerate(zip(x["tokens"], y["tokens"], strict=False))
                        if p != q
                    ),
                    min(len(x["tokens"]), len(y["tokens"])),
                )
                return Divergence(step, i, x["task"], x["sample"], pos, "tokens")
            if x["reward"] != y["reward"]:
                return Divergence(step, i, x["task"], x["sample"], None, "reward")
        if len(ta) != len(tb):
            i = min(len(ta), len(tb))
            extra = (ta if len(ta) > len(tb) else tb)[i]  # the first one the other lacks
            return Divergence(step, i, extra["task"], extra["sample"], None, "batch_size")
    if len(recorded) != len(replayed):
        step = min(len(recorded), len(replayed))
        return Divergence(step, 0, "", 0, None, "steps")
    return None


def version_changes(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """``name recorded -> current`` for each package whose version differs."""
    names = sorted(set(recorded) | set(current))
    return [
        f"{n} {recorded.get(n, 'absent')} -> {current.get(n, 'absent')}"
        for n in names
        if recorded.get(n) != current.get(n)
    ]


def as_dict(d: Divergence | None) -> dict[str, Any] | None:
    """The divergence as JSON fields (None stays None)."""
    if d is None:
        return None
    return {f: getattr(d, f) for f in ("step", "index", "task", "sample", "token", "what")}


__all__ = [
    "LOG",
    "Divergence",
    "TrainedLog",
    "as_dict",
    "first_divergence",
    "read_log",
    "step_record",
    "version_changes",
]
