"""A plugin package outside agentroll, installed by tests/test_plugins.py under a temporary
directory: one backend, sandbox, tool parser and trainer algorithm, each registered as an
entry point.

Its pieces fit the built-in ``calculator`` environment: the backend answers in the
``CALL name {json}`` format of the tool parser, the sandbox (the local one, under
another name) runs the ``calc`` command, and the module-level lists record what was used.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentroll.backends.base import GenerationRequest
from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer, ParsedOutput
from agentroll.sandbox.base import SandboxConfig
from agentroll.sandbox.local import LocalSandbox
from agentroll.trainer.algorithm import Algorithm
from agentroll.types import ExecResult, ToolCall, Trajectory

REPLICAS: list[int] = []  # index of each backend the factory made
COMMANDS: list[list[str]] = []  # every command a sandbox ran
OPTIONS: list[dict[str, Any]] = []  # the options each sandbox was given
OBJECTIVE_TOKENS: list[int] = []  # loss tokens of each objective call

_QUESTION = re.compile(r"What is (.+?)\?")
_RESULT = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


# -- agentroll.backends: factory(recipe, model_dir, index) -> Backend ---------------------


def make_backend(recipe: Any, model_dir: str | Path, index: int) -> MockBackend:
    """A scripted backend: call ``calc`` on the question, then answer with its result."""
    REPLICAS.append(index)
    tok = ChatTokenizer.from_pretrained(model_dir)

    def reply(request: GenerationRequest) -> str:
        prompt = tok.decode(request.prompt_ids, skip_special_tokens=False)
        if request.turn_index == 0:
            return "CALL calc " + json.dumps({"expression": _QUESTION.findall(prompt)[-1]})
        return f"Answer: {_RESULT.findall(prompt)[-1]}"

    return MockBackend(reply, tokenizer=tok)


# -- agentroll.sandboxes: factory(config, *, episode_id) -> Sandbox -----------------------


class SubprocessSandbox(LocalSandbox):
    """The built-in local sandbox under a plugin's name, recording what it is given and runs:
    a plugin reuses what agentroll has and adds only what is its own."""

    def __init__(self, config: SandboxConfig, *, episode_id: str | None = None) -> None:
        OPTIONS.append(dict(config.options))
        super().__init__(config)

    async def exec(self, cmd: str | list[str], **kwargs: Any) -> ExecResult:
        COMMANDS.append(["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd))
        return await super().exec(cmd, **kwargs)


# -- agentroll.tool_parsers: factory() -> ToolParser ---------------------------------------


class CallLineParser:
    """One call per line: ``CALL <name> <JSON object of arguments>``; never raises."""

    def parse(self, text: str, *, call_id_prefix: str = "call") -> ParsedOutput:
        calls: list[ToolCall] = []
        errors: list[str] = []
        content: list[str] = []
        for line in text.splitlines():
            if not line.startswith("CALL "):
                content.append(line)
                continue
            name, _, raw = line.removeprefix("CALL ").partition(" ")
            try:
                arguments = json.loads(raw or "{}")
            except (ValueError, RecursionError) as exc:
                errors.append(f"arguments of {name!r} are not JSON ({exc})")
                continue
            if not name or not isinstance(arguments, dict):
                errors.append("write CALL <name> <JSON object>")
                continue
            call_id = f"{call_id_prefix}_{len(calls) + len(errors)}"
            calls.append(ToolCall(id=call_id, name=name, arguments=arguments))
        return ParsedOutput(content="\n".join(content).strip(), tool_calls=calls, errors=errors)


# -- agentroll.trainers: an Algorithm --------------------------------------------------------


def baseline_advantages(trajectories: Sequence[Trajectory]) -> np.ndarray:
    """Reward minus a fixed baseline of 0.5 (no group statistics)."""
    return np.array([t.reward - 0.5 for t in trajectories], dtype=np.float32)


def truncated_pg(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    cap: torch.Tensor | float,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A policy gradient with a truncated importance weight and no clip."""
    OBJECTIVE_TOKENS.append(len(logp))
    ratio = torch.exp(logp - behaviour_logp)
    r = ratio.detach()
    weight = torch.minimum(r, torch.as_tensor(cap, dtype=r.dtype)) / r
    return weight * ratio * advantages, r, torch.zeros_like(r, dtype=torch.bool)


ALGORITHM = Algorithm("baseline_pg", advantages=baseline_advantages, objective=truncated_pg)
