"""Guess a secret integer from "higher"/"lower" feedback: multi-turn without tools.

Invariants: the secret is a pure function of the episode seed (``secret_for``); each reply's
last integer is a guess; a correct guess ends the episode (``env_response`` returns None);
reward is 0 unless solved, else 1 plus a bonus that shrinks linearly with the turns used;
``state_dict()`` holds everything needed to resume an episode.
"""

from __future__ import annotations

import random
import re
from typing import Any

from agentroll import ConfigError, Environment, EpisodeState, Message, Task, Trajectory

_INT = re.compile(r"-?\d+")


class GuessNumber(Environment):
    """Find a secret in ``[low, high]`` in at most ``max_turns`` guesses."""

    system_prompt = (
        "Play a guessing game. Reply with a single integer, your guess. After a wrong guess "
        "you are told `higher` or `lower`."
    )
    max_turns = 8
    speed_bonus = 0.5  # reward for solving on the first turn is 1 + speed_bonus

    def __init__(self, num_tasks: int = 50, low: int = 1, high: int = 100) -> None:
        if num_tasks < 1 or low >= high:
            raise ConfigError("GuessNumber needs num_tasks >= 1 and low < high")
        self.num_tasks = num_tasks
        self.low = low
        self.high = high

    def tasks(self) -> list[Task]:
        prompt = f"I picked an integer from {self.low} to {self.high}. Guess it."
        return [Task(id=f"guess-{i}", data={"prompt": prompt}) for i in range(self.num_tasks)]

    def secret_for(self, seed: int) -> int:
        return random.Random(seed).randint(self.low, self.high)

    async def reset(self, task: Task, *, seed: int) -> list[Message]:
        self.secret = self.secret_for(seed)
        self.guesses: list[int] = []
        return await super().reset(task, seed=seed)

    @property
    def is_solved(self) -> bool:
        return bool(self.guesses) and self.guesses[-1] == self.secret

    async def env_response(
        self, messages: list[Message], state: EpisodeState
    ) -> list[Message] | None:
        found = _INT.findall(messages[-1].content)
        if not found:
            text = f"Reply with a single integer from {self.low} to {self.high}."
            return [Message(role="user", content=text)]
        self.guesses.append(int(found[-1]))
        if self.is_solved:
            return None
        text = "higher" if self.guesses[-1] < self.secret else "lower"
        return [Message(role="user", content=text)]

    async def reward(self, trajectory: Trajectory, state: EpisodeState) -> dict[str, float]:
        if not self.is_solved:
            return {"solved": 0.0, "speed": 0.0}
        unused = self.max_turns - len(trajectory.turns)
        return {"solved": 1.0, "speed": self.speed_bonus * unused / max(self.max_turns - 1, 1)}

    def state_dict(self) -> dict[str, Any]:
        return {"secret": self.secret, "guesses": list(self.guesses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.secret = int(state["secret"])
        self.guesses = [int(g) for g in state["guesses"]]
