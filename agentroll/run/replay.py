"""Reproducible runs: what each training step trained on, and where a replay diverged.

A run writes ``trained.jsonl``: per trainer step, every trajectory it trained on as (task,
sample, reward, token ids), sorted, so two runs compare step by step whatever order their
episodes finished in.  ``first_divergence`` (pure) names the first step, trajectory and
token where two such logs differ; ``agentroll run --replay RUN_DIR`` runs the recorded
recipe again (its resolved ``recipe.toml``, seeds and a check of ``versions.json``) and
reports it.  Invariants: a log line is flushed when its step is trained; no I/O in the
comparison.
"""

from __future__ import annotations

import json
import time
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


def replay(run_dir: str | Path, *, out_dir: str | Path | None = None) -> int:
    """``agentroll run --replay RUN_DIR``: run the recorded recipe again into ``out_dir``
    (default: beside it), compare what each step trained on; 0 if the runs agree, 1 at the
    first divergence (printed, and written to ``replay.json``)."""
    import asyncio
    import sys

    from agentroll.run.loop import run_recipe_async
    from agentroll.run.recipe import load_recipe, package_versions

    src = Path(run_dir)
    if not (src / "recipe.toml").is_file():
        raise ConfigError(f"{src} holds no recipe.toml: pass the directory of a run")
    recorded = read_log(src)
    versions_path = src / "versions.json"
    recorded_versions = json.loads(versions_path.read_text()) if versions_path.is_file() else {}
    changes = version_changes(recorded_versions, package_versions())
    for change in changes:
        print(f"replay: version differs: {change}", file=sys.stderr)
    recipe = load_recipe(src / "recipe.toml")
    dest = (
        Path(out_dir) if out_dir else src.with_name(f"{src.name}-replay-{time.strftime('%H%M%S')}")
    )
    asyncio.run(run_recipe_async(recipe, src / "recipe.toml", run_dir=dest))
    found = first_divergence(recorded, read_log(dest))
    summary = {
        "recorded": str(src),
        "replayed": str(dest),
        "steps": len(recorded),
        "versions_changed": changes,
        "divergence": _as_dict(found),
    }
    (dest / "replay.json").write_text(json.dumps(summary, indent=2) + "\n")
    if found is None:
        print(f"replay identical steps={len(recorded)} run_dir={dest}")
        return 0
    print(f"{found.line()} run_dir={dest}")
    return 1


def _as_dict(d: Divergence | None) -> dict[str, Any] | None:
    if d is None:
        return None
    return {f: getattr(d, f) for f in ("step", "index", "task", "sample", "token", "what")}


__all__ = [
    "LOG",
    "Divergence",
    "TrainedLog",
    "first_divergence",
    "read_log",
    "replay",
    "step_record",
    "version_changes",
]
