"""Fix a small buggy Python function; the reward is the fraction of its unit tests passed.

Invariants: tasks are built in; the candidate is the last ```python block of the final
message, else the ``solution.py`` the model wrote; each test is a call whose expected value
stays on the host: the sandbox's ``python3 -I`` process (a per-test alarm, a whole-run
timeout) only reports the values the calls returned, so a candidate that takes it over
scores only by producing the right values; a crash, hang or exit fails what it stops.
"""

from __future__ import annotations

import json
import re
import secrets

from agentroll import Environment, EpisodeState, Sandbox, SandboxConfig, Task, Trajectory
from agentroll.tools.files import read_file, write_file
from agentroll.tools.python_exec import python_exec

# (name, buggy source, fixed source, tests: (call, the value a correct fix returns))
_TASKS: list[tuple[str, str, str, list[tuple[str, object]]]] = [
    (
        "mean",
        "def mean(xs):\n    return sum(xs) / (len(xs) - 1)\n",
        "def mean(xs):\n    return sum(xs) / len(xs)\n",
        [("mean([1, 2, 3])", 2), ("mean([4])", 4), ("mean([2, 4])", 3)],
    ),
    (
        "factorial",
        "def factorial(n):\n    out = 1\n    for i in range(1, n):\n        out *= i\n    return out\n",
        "def factorial(n):\n    out = 1\n    for i in range(1, n + 1):\n        out *= i\n    return out\n",
        [("factorial(0)", 1), ("factorial(1)", 1), ("factorial(5)", 120)],
    ),
    (
        "is_palindrome",
        "def is_palindrome(s):\n    return s.lower() == s[::-1]\n",
        "def is_palindrome(s):\n    return s.lower() == s.lower()[::-1]\n",
        [
            ("is_palindrome('abba')", True),
            ("is_palindrome('Racecar')", True),
            ("is_palindrome('abc')", False),
        ],
    ),
    (
        "fizzbuzz",
        "def fizzbuzz(n):\n    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    return str(n)\n",
        "def fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:\n        return 'Fizz'\n    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)\n",
        [
            ("fizzbuzz(9)", "Fizz"),
            ("fizzbuzz(10)", "Buzz"),
            ("fizzbuzz(30)", "FizzBuzz"),
            ("fizzbuzz(7)", "7"),
        ],
    ),
    (
        "last_word",
        "def last_word(s):\n    return s.split(' ')[-1]\n",
        "def last_word(s):\n    words = s.split()\n    return words[-1] if words else ''\n",
        [("last_word('hello world')", "world"), ("last_word('a b  ')", "b"), ("last_word('')", "")],
    ),
]

# Runs the candidate and prints the values the calls returned (null where one failed).
_RUNNER = """\
import json, signal, sys
req, dumps, values = json.loads(sys.stdin.read()), json.dumps, []
def on_alarm(*_): raise TimeoutError("took too long")
signal.signal(signal.SIGALRM, on_alarm)
namespace = {"__name__": "solution"}
try:
    signal.alarm(req["alarm"])
    exec(compile(req["code"], "solution.py", "exec"), namespace)
    for call in req["calls"]:
        signal.alarm(req["alarm"])
        try: values.append(dumps(eval(call, dict(namespace))))
        except Exception: values.append("null")
except BaseException: pass
signal.alarm(0)
print(req["nonce"], dumps(values))
"""
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
            for name, buggy, fixed, tests in _TASKS
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

    async def reward(self, trajectory: Trajectory, state: EpisodeState) -> float:
        calls: list[str] = state.task.data["tests"]
        expected: list[object] = state.task.data["expected"]
        sandbox = state.sandbox
        code = None if sandbox is None else await self.candidate(trajectory, sandbox)
        if sandbox is None or code is None:
            return 0.0
        nonce = secrets.token_hex(16)
        request = {"code": code, "calls": calls, "nonce": nonce, "alarm": self.test_alarm}
        result = await sandbox.exec(
            ["python3", "-I", "-c", _RUNNER], stdin=json.dumps(request), timeout=self.test_timeout
        )
        values: list[object] = []
        for line in result.stdout.splitlines():
            tag, _, rest = line.partition(" ")
            if tag == nonce:
                try:
                    values = [json.loads(text) for text in json.loads(rest)][: len(calls)]
                except (ValueError, TypeError):
                    values = []
        return sum(map(_same, values, expected)) / len(calls)


def _same(got: object, want: object) -> bool:
    """Equal as values, with booleans never equal to numbers (True is not 1)."""
    return got is want if isinstance(got, bool) or isinstance(want, bool) else got == want
