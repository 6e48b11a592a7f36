"""A gateway session (one episode of an outside agent) and the groups sessions belong to.

Invariants: an ended session becomes one ``Trajectory`` per sample that generated, all with
the session's rewards; a group is released once, when its last member ended (``group_size``
members, or every member created under it when no size was given); an abandoned session is
data (``status="abandoned"``), not lost.
"""

from __future__ import annotations

import math
import time
from typing import Any

from agentroll.chat import ChatTokenizer
from agentroll.gateway.capture import Capture
from agentroll.gateway.wire import MessageMemo
from agentroll.types import Status, Task, Trajectory, new_id, now


class Session:
    """One agent episode: its capture, rewards and lifecycle."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        task: Task,
        group_id: str,
        sample_index: int,
        seed: int,
        metadata: dict[str, Any],
        clock: float,
    ) -> None:
        self.id = new_id()
        self.task = task
        self.group_id = group_id or self.id
        self.sample_index = sample_index
        self.seed = seed
        self.metadata = metadata
        self.capture = Capture(tokenizer)
        self.messages = MessageMemo()  # the last call's messages, checked
        self.rewards: dict[str, float] = {}
        self.reward: float | None = None
        self.started_at = now()
        self.last_active = clock
        self.in_flight: dict[str, Any] = {}  # request id -> its call (cancelled at end)
        self.ended = False
        self.status: Status = "ok"
        self.stop_reason = ""
        self.unparsed_tool_calls = 0
        self.gen_seconds = 0.0

    def set_reward(self, reward: float | None, rewards: dict[str, float] | None) -> None:
        """A scalar, or named rewards (their sum is the reward); ``ValueError`` if not
        finite."""
        named = dict(rewards or {})
        values = [*named.values(), *([reward] if reward is not None else [])]
        if not values or not all(math.isfinite(v) for v in values):
            raise ValueError("give a finite reward, or rewards as {name: finite number}")
        self.rewards = named or {"reward": float(reward or 0.0)}
        self.reward = float(reward) if reward is not None else float(sum(named.values()))

    def trajectories(self, *, backend: str, keep_messages: bool) -> list[Trajectory]:
        """One trajectory per sample that generated at least one token."""
        out = []
        finished = now()
        cap = self.capture
        for sample in cap.samples:
            if not sample.turns:
                continue
            superseded = any(
                s.fork is not None and s.fork.from_sample == sample.index and s.fork.reason != "n"
                for s in cap.samples
            )
            traj = sample.builder.fill(
                Trajectory(
                    id=self.id if sample.index == 0 else f"{self.id}-{sample.index}",
                    task_id=self.task.id,
                    group_id=self.group_id,
                    sample_index=self.sample_index,
                    seed=self.seed,
                    env_name="gateway",
                    backend=backend,
                    status=self.status,
                    stop_reason="forked" if superseded else self.stop_reason,
                    prompt_len=sample.prompt_len,
                    turns=list(sample.turns),
                    messages=list(sample.history) if keep_messages else [],
                    forks=[sample.fork] if sample.fork is not None else [],
                    started_at=self.started_at,
                    finished_at=finished,
                    reward=self.reward or 0.0,
                    rewards=dict(self.rewards),
                    metrics={
                        "calls": float(cap.calls),
                        "forks": float(cap.num_forks),
                        "mismatched_tokens": float(cap.mismatched_tokens),
                        "unparsed_tool_calls": float(self.unparsed_tool_calls),
                        "gen_seconds": sum(t.gen_seconds for t in sample.turns),
                    },
                )
            )
            end = sample.turns[-1].gen_end  # a call in flight at the end is not part of it
            if end < traj.num_tokens:
                for name in ("token_ids", "logprobs", "loss_mask", "policy_version", "kv_version"):
                    setattr(traj, name, getattr(traj, name)[:end].copy())
            out.append(traj)
        return out


class Group:
    """Sessions released together (the samples of one task)."""

    __slots__ = ("ended", "members", "size", "trajectories")

    def __init__(self, size: int) -> None:
        self.size = size
        self.members = 0
        self.ended = 0
        self.trajectories: list[Trajectory] = []

    def join(self) -> int:
        """A new member; returns its sample index."""
        self.members += 1
        return self.members - 1

    def full(self) -> bool:
        return self.size > 0 and self.members >= self.size

    def complete(self) -> bool:
        return self.ended >= (self.size or self.members)


def session_clock() -> float:
    return time.monotonic()


__all__ = ["Group", "Session", "session_clock"]
