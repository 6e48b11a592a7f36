"""Public fakes for users' tests: a scripted backend and an in-memory sandbox.

Invariants: nothing here touches the network, processes or the real clock; fakes record
what was asked of them so tests can assert on it.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Mapping
from typing import Any

from agentroll.backends.mock import MockBackend, MockResponse
from agentroll.env import Environment, EpisodeState
from agentroll.sandbox.base import Sandbox, SandboxConfig
from agentroll.types import ExecResult, Message, Task, Trajectory

ExecHandler = Callable[[str | list[str]], ExecResult]


class FakeSandbox(Sandbox):
    """Files in a dict; ``exec`` calls ``handler`` (default: exit code 0, no output).

    ``commands`` records every command; ``closed`` tells whether ``close()`` ran.
    """

    def __init__(
        self, handler: ExecHandler | None = None, config: SandboxConfig | None = None
    ) -> None:
        self.config = config or SandboxConfig()
        self.handler = handler or (lambda cmd: ExecResult(exit_code=0))
        self.files: dict[str, bytes] = {}
        self.commands: list[str | list[str]] = []
        self.closed = False

    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        max_output: int | None = None,
    ) -> ExecResult:
        self.commands.append(cmd)
        return self.handler(cmd)

    def _check(self, path: str) -> str:
        if path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"path {path!r} escapes the sandbox's working directory")
        return path

    async def read_file(self, path: str) -> bytes:
        try:
            return self.files[self._check(path)]
        except KeyError:
            raise FileNotFoundError(path) from None

    async def write_file(self, path: str, data: str | bytes) -> None:
        self.files[self._check(path)] = data.encode() if isinstance(data, str) else data

    async def snapshot(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, data in sorted(self.files.items()):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    async def restore(self, blob: bytes) -> None:
        files: dict[str, bytes] = {}
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
            for member in tar.getmembers():
                extracted = tar.extractfile(member)
                if extracted is not None:
                    files[self._check(member.name)] = extracted.read()
        self.files = files

    async def close(self) -> None:
        self.closed = True


__all__ = ["LONG_TAIL_STOP_IDS", "FakeSandbox", "LongTail", "MockBackend", "MockResponse"]


class SyntheticTrainer:
    """Stand-in for a trainer in tests and benchmarks: each ``step()`` perturbs a fraction of
    the weights of a checkpoint (seeded) and returns the ``WeightUpdate`` (a delta against
    the previous version) a real trainer would publish."""

    def __init__(self, model_dir: Any, *, fraction: float = 0.01, seed: int = 0) -> None:
        import torch

        from agentroll.engine.models import read_tensors
        from agentroll.weights.exporter import WeightExporter

        self.state = read_tensors(model_dir)
        self.fraction = fraction
        self._gen = torch.Generator().manual_seed(seed)
        self.exporter = WeightExporter(lambda: self.state)

    @property
    def version(self) -> int:
        return int(self.exporter.version)

    def step(self) -> Any:
        import torch

        for t in self.state.values():
            if not t.is_floating_point():
                continue
            mask = torch.rand(t.shape, generator=self._gen) < self.fraction
            t.add_(mask * torch.randn(t.shape, generator=self._gen) * 0.02)
        return self.exporter.export()


#: stop ids for ``LongTail`` on the tiny model: a twelfth of its 1024 ids, so a turn ends
#: after about 12 sampled tokens (geometric), never on the token budget
LONG_TAIL_STOP_IDS = tuple(range(11, 1024, 12))


class LongTail(Environment):
    """A multi-turn environment with long-tailed episode lengths, for placement benchmarks
    and checks.  No tools: the environment answers ``go on`` until the task's turns are
    used; task ``i`` has ``long_turns`` turns if ``i % every == 0``, else 1 (so some
    episodes are ``long_turns`` times the median).  Reward: 1 for an even number of ``a``
    in the replies (random on a random model: GRPO groups get non-zero advantages)."""

    system_prompt = "Write a few words each turn."
    max_turns = 64

    def __init__(self, num_tasks: int = 32, long_turns: int = 10, every: int = 8) -> None:
        self.num_tasks, self.long_turns, self.every = num_tasks, long_turns, every

    def tasks(self) -> list[Task]:
        return [
            Task(
                id=f"tail-{i}",
                data={
                    "prompt": f"task {i}",
                    "turns": self.long_turns if i % self.every == 0 else 1,
                },
            )
            for i in range(self.num_tasks)
        ]

    async def reset(self, task: Task, *, seed: int) -> list[Message]:
        self.left = int(task.data["turns"])
        return await super().reset(task, seed=seed)

    async def env_response(
        self, messages: list[Message], state: EpisodeState
    ) -> list[Message] | None:
        self.left -= 1
        return None if self.left <= 0 else [Message(role="user", content="go on")]

    async def reward(self, trajectory: Trajectory, state: EpisodeState) -> float:
        text = "".join(m.content for m in trajectory.messages if m.role == "assistant")
        return float(text.count("a") % 2 == 0)
