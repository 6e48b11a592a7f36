"""Arithmetic problems solved with a ``calc`` tool that runs Python in the sandbox.

Invariants: tasks are a pure function of ``(num_tasks, seed, max_operand, traces)`` and their
answers come from the safe evaluator (``eval`` runs only inside the sandbox, in ``calc``); a bad
expression is a ``ToolError`` the model sees; the reward is 1.0 exactly when the last
``Answer: <number>`` of the final message equals the task's answer, else 0.0.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from agentroll import (
    ConfigError,
    Environment,
    Rubric,
    Sandbox,
    SandboxConfig,
    Task,
    ToolError,
    tool,
)
from agentroll.tools.calculator import evaluate

_ANSWER = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)")
_QUESTION = re.compile(r"What is (.+?)\?")
_RESULT = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
# Runs inside the sandbox, which is the security boundary; no builtins keeps it arithmetic.
_EVAL = "import sys; print(eval(sys.argv[1], {'__builtins__': {}}, {}))"


def exact_answer(completion: str, answer: object) -> float:
    """1.0 if the last ``Answer: <number>`` in ``completion`` is ``answer``, else 0.0."""
    found = _ANSWER.findall(completion)
    return float(bool(found) and found[-1] == str(answer))


def trace_shapes(path: str | Path) -> list[list[str]]:
    """The operator sequences of the questions in a JSONL file of production traces (one
    conversation ``{"messages": [...]}`` per line), e.g. ``["*", "-"]`` for ``37 * 4 - 12``."""
    shapes = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            question = next(m["content"] for m in messages if m["role"] == "user")
            if not isinstance(question, str):
                raise TypeError(f"the user message's content is {type(question).__name__}")
        except (ValueError, KeyError, StopIteration, TypeError) as exc:
            raise ConfigError(f"{path}:{n}: not a trace with a user message ({exc})") from exc
        found = _QUESTION.search(question)
        if found:
            shapes.append(re.findall(r"(?<=\s)[-+*](?=\s)", found.group(1)))
    if not shapes:
        raise ConfigError(f"{path}: no 'What is <expression>?' question in any trace")
    return shapes


def demonstration(prompt: str, turn_index: int) -> str:
    """The expert's reply to the rendered ``prompt``: call ``calc`` on the question, then
    answer with the tool's result (the supervised warm-up imitates it)."""
    if turn_index == 0:
        call = {"name": "calc", "arguments": {"expression": _QUESTION.findall(prompt)[-1]}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    return f"Answer: {_RESULT.findall(prompt)[-1]}"


class Calculator(Environment):
    """``num_tasks`` expressions like ``37 * 4 - 12`` with integer answers; with ``traces``
    (production traces, see ``trace_shapes``) the expressions take the traces' shapes with
    fresh numbers."""

    system_prompt = (
        "Solve the arithmetic problem. Evaluate expressions with the `calc` tool, then give "
        "your final answer on its own line in the form `Answer: <number>`."
    )
    max_turns = 4
    sandbox_config = SandboxConfig(timeout=5.0)
    rubric = Rubric([exact_answer])

    def __init__(
        self, num_tasks: int = 100, seed: int = 0, max_operand: int = 100, traces: str = ""
    ) -> None:
        if num_tasks < 1 or max_operand < 2:
            raise ConfigError("Calculator needs num_tasks >= 1 and max_operand >= 2")
        self.num_tasks = num_tasks
        self.seed = seed
        self.max_operand = max_operand
        self.shapes = trace_shapes(traces) if traces else None

    def tasks(self) -> list[Task]:
        rng = random.Random(self.seed)
        out = []
        for i in range(self.num_tasks):
            if self.shapes is None:
                terms = [str(rng.randint(1, self.max_operand)) for _ in range(rng.randint(2, 4))]
                ops = [rng.choice("+-*") for _ in terms[1:]]
            else:
                ops = rng.choice(self.shapes)
                terms = [str(rng.randint(1, self.max_operand)) for _ in range(len(ops) + 1)]
            expr = terms[0]
            for op, term in zip(ops, terms[1:], strict=True):
                expr += f" {op} {term}"
            prompt = f"What is {expr}?"
            out.append(
                Task(id=f"calc-{self.seed}-{i}", data={"prompt": prompt}, answer=evaluate(expr))
            )
        return out

    @tool
    async def calc(self, expression: str, sandbox: Sandbox) -> str:
        """Evaluate an arithmetic expression with Python and return the result.

        Args:
            expression: a Python arithmetic expression, e.g. "(17 + 4) * 3".
        """
        result = await sandbox.exec(["python3", "-c", _EVAL, expression])
        if result.timed_out:
            raise ToolError(f"evaluating {expression!r} took too long")
        if not result.ok:
            lines = result.stderr.strip().splitlines()
            raise ToolError(lines[-1] if lines else f"python3 exited with {result.exit_code}")
        return result.stdout.strip()
