"""The built-in tasks of ``code_fix`` and the runner its sandbox executes (data only).

The runner's expected values never enter the sandbox: it prints the values the calls
returned, tagged with the caller's nonce, and the host compares them.
"""

# (name, buggy source, fixed source, tests: (call, the value a correct fix returns))
TASKS: list[tuple[str, str, str, list[tuple[str, object]]]] = [
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
RUNNER = """\
import json, signal, sys
req, dumps, values = json.loads(sys.stdin.read()), json.dumps, []
if req.get("scratch"):
    import os, tempfile
    os.chdir(tempfile.mkdtemp())
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
