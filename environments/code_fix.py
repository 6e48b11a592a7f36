"""Fix a small buggy Python function; the reward is the fraction of its unit tests passed.

Invariants: tasks are built in; the candidate is the last ```python block of the final
message, else the ``solution.py`` the model wrote; each test is a call whose expected value
stays on the host: the sandbox's ``python3 -I`` process (a per-test alarm, a whole-run
timeout) only reports the values the calls returned, so a candidate that takes it over
scores only by producing the right values; a crash, hang or exit fails what it stops.
``run_tests`` (pure) runs the same tests on code the model passes, in a scratch directory.
"""

from __future__ import annotations

import json
import re
import secrets

from agentroll import Environment, EpisodeState, Sandbox, SandboxConfig, Task, Trajectory, tool
from agentroll.environments._code_fix_data import RUNNER, TASKS
from agentroll.tools.files import read_file, write_file
from agentroll.tools.python_exec import python_exec

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


class CodeFix(Environment):
    """Repair one of a handful of buggy functions so that its unit tests pass."""

    system_prompt = (
        "Fix the bug in the given Python function. You may test code with the tools. End "
        "with the complete fixed function in a ```python block."
    )
    max_turns = 6
    sandbox_config = SandboxConfig(timeout=20.0)
    extra_tools = (python_exec, read_file, write_file)
    test_timeout = 10.0  # seconds for the whole test run
    test_alarm = 2  # seconds per test (and for defining the candidate)

    def tasks(self) -> list[Task]:
        return [
            Task(
                id=f"code_fix-{name}",
                data={
                    "prompt": f"Fix this function:\n```python\n{buggy}```",
                    "tests": [call for call, _ in tests],
                    "expected": [value for _, value in tests],
                },
                answer=fixed,
            )
            for name, buggy, fixed, tests in TASKS
        ]

    async def candidate(self, trajectory: Trajectory, sandbox: Sandbox) -> str | None:
        """The code to test: the final message's last python block, else ``solution.py``."""
        final = next((m for m in reversed(trajectory.messages) if m.role == "assistant"), None)
        blocks = _BLOCK.findall(final.content) if final else []
        if blocks:
            return str(blocks[-1])
        try:
            return (await sandbox.read_file("solution.py")).decode("utf-8", "replace")
        except (FileNotFoundError, IsADirectoryError, ValueError):
            return None

    async def run_candidate(
        self, sandbox: Sandbox, code: str, calls: list[str], *, scratch: bool = False
    ) -> tuple[list[object], bool]:
        """The values the test ``calls`` return for ``code`` (fewer when it stopped early)
        and whether the run hit the whole-run timeout.  ``scratch``: run in a new directory,
        so the code neither reads nor writes the working directory's files by their names."""
        nonce = secrets.token_hex(16)
        request = {
            "code": code,
            "calls": calls,
            "nonce": nonce,
            "alarm": self.test_alarm,
            "scratch": scratch,
        }
        result = await sandbox.exec(
            ["python3", "-I", "-c", RUNNER], stdin=json.dumps(request), timeout=self.test_timeout
        )
        values: list[object] = []
        for line in result.stdout.splitlines():
            tag, _, rest = line.partition(" ")
            if tag == nonce:
                try:
                    values = [json.loads(text) for text in json.loads(rest)][: len(calls)]
                except (ValueError, TypeError):
                    values = []
        return values, result.timed_out

    @tool(pure=True)
    async def run_tests(self, code: str, state: EpisodeState, sandbox: Sandbox) -> str:
        """Run the task's unit tests on a version of the function; says which pass.

        Args:
            code: the complete Python source of the function (and anything it needs).
        """
        calls: list[str] = state.task.data["tests"]
        expected: list[object] = state.task.data["expected"]
        values, timed_out = await self.run_candidate(sandbox, code, calls, scratch=True)
        if timed_out:
            # not a ToolError: a slow machine is no property of the code, so it is not cached
            raise RuntimeError(f"the test run took longer than {self.test_timeout} s")
        lines, passed = [], 0
        for i, call in enumerate(calls):
            got = values[i] if i < len(values) else None
            ok = i < len(values) and _same(got, expected[i])
            passed += ok
            # the returned value, never the expected one (which stays on the host)
            lines.append(f"{'pass' if ok else 'FAIL'}: {call} returned {json.dumps(got)}")
        return f"{passed}/{len(calls)} tests pass\n" + "\n".join(lines)

    async def reward(self, trajectory: Trajectory, state: EpisodeState) -> float:
        calls: list[str] = state.task.data["tests"]
        expected: list[object] = state.task.data["expected"]
        sandbox = state.sandbox
        code = None if sandbox is None else await self.candidate(trajectory, sandbox)
        if sandbox is None or code is None:
            return 0.0
        values, _ = await self.run_candidate(sandbox, code, calls)
        return sum(map(_same, values, expected)) / len(calls)


def _same(got: object, want: object) -> bool:
    """Equal as values, with booleans never equal to numbers (True is not 1)."""
    return got is want if isinstance(got, bool) or isinstance(want, bool) else got == want
