"""The example environments end to end: MockBackend + tiny tokenizer + local sandbox."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import agentroll.environments
from agentroll.backends.base import GenerationRequest
from agentroll.backends.mock import MockBackend
from agentroll.env import Environment, load_environment
from agentroll.model.tokenizer import tiny_chat_tokenizer
from agentroll.rollout.engine import RolloutConfig, RolloutEngine, episode_seed
from agentroll.tools.calculator import evaluate
from agentroll.types import Task, Trajectory, decode_msgpack, encode_msgpack

TOK = tiny_chat_tokenizer()
EXPECTED_TOOLS = {
    "calculator": {"calc"},
    "guess_number": set(),
    "code_fix": {"python_exec", "read_file", "write_file", "run_tests"},
}


def tool_call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def decoded(request: GenerationRequest) -> str:
    return TOK.decode(request.prompt_ids, skip_special_tokens=False)


async def rollout(
    env: Environment, tasks: list[Task], script: Any, **config: Any
) -> list[Trajectory]:
    backend = MockBackend(script, tokenizer=TOK)
    cfg = RolloutConfig(progress="off", **config)
    async with RolloutEngine(backend, env, cfg, tokenizer=TOK) as engine:
        trajs = [t async for t in engine.run(tasks)]
    return sorted(trajs, key=lambda t: (t.task_id, t.sample_index))


# -- every environment ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED_TOOLS))
def test_environment_loads_by_name_with_unique_tasks(name: str) -> None:
    env = load_environment(name)
    assert env.name == name
    tasks = list(env.tasks())
    assert tasks
    assert len({t.id for t in tasks}) == len(tasks)
    assert all(isinstance(t.data["prompt"], str) and t.data["prompt"] for t in tasks)


@pytest.mark.parametrize("name", sorted(EXPECTED_TOOLS))
def test_tool_schemas_are_complete_and_hide_injected_parameters(name: str) -> None:
    env = load_environment(name)
    assert {s.name for s in env.tool_specs} == EXPECTED_TOOLS[name]
    for spec in env.tool_specs:
        params = spec.parameters
        assert spec.description
        assert params["type"] == "object"
        assert params["properties"]
        assert not {"sandbox", "state"} & set(params["properties"])
        assert set(params["required"]) == set(params["properties"])
        assert all(
            p["type"] == "string" and p["description"] for p in params["properties"].values()
        )


def test_every_example_environment_is_short() -> None:
    files = list(Path(agentroll.environments.__file__).parent.glob("*.py"))
    assert len(files) > 3
    for f in files:
        assert len(f.read_text().splitlines()) < 150, f"{f.name} has 150 lines or more"


# -- calculator ---------------------------------------------------------------------------------


def expression_of(task: Task) -> str:
    return str(re.fullmatch(r"What is (.+)\?", task.data["prompt"]).group(1))  # type: ignore[union-attr]


def test_calculator_tasks_are_a_pure_function_of_the_seed() -> None:
    first = load_environment("calculator", num_tasks=20, seed=3).tasks()
    assert first == load_environment("calculator", num_tasks=20, seed=3).tasks()
    assert first != load_environment("calculator", num_tasks=20, seed=4).tasks()
    for task in first:
        assert isinstance(task.answer, int)
        assert task.answer == evaluate(expression_of(task)) == eval(expression_of(task))


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"messages": 5}',
        '{"messages": [{"role": "assistant", "content": "x"}]}',
        '{"messages": [{"role": "user", "content": 7}]}',  # a TypeError out of re before
    ],
)
def test_a_malformed_trace_names_its_line(tmp_path: Path, line: str) -> None:
    from agentroll.errors import ConfigError

    traces = tmp_path / "t.jsonl"
    traces.write_text('{"messages": [{"role": "user", "content": "What is 1 + 2?"}]}\n' + line)
    with pytest.raises(ConfigError, match=r"t\.jsonl:2: not a trace"):
        load_environment("calculator", num_tasks=2, traces=str(traces))


@pytest.mark.parametrize(("slip", "reward"), [(0, 1.0), (1, 0.0), (None, 0.0)])
async def test_calculator_rewards_exactly_the_right_answer(slip: int | None, reward: float) -> None:
    env = load_environment("calculator", num_tasks=3, seed=1)
    tasks = env.tasks()
    by_expr = {expression_of(t): t for t in tasks}

    def script(request: GenerationRequest) -> str:
        text = decoded(request)
        if request.turn_index == 0:
            return tool_call("calc", expression=re.findall(r"What is (.+?)\?", text)[-1])
        result = int(re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)[-1])
        return "I do not know." if slip is None else f"So:\nAnswer: {result + slip}"

    trajs = await rollout(env, tasks, script)
    assert len(trajs) == len(tasks)
    for traj in trajs:
        task = next(t for t in tasks if t.id == traj.task_id)
        assert by_expr[expression_of(task)] is task
        assert traj.status == "ok", traj.error
        assert traj.stop_reason == "no_tool_call"
        assert traj.turns[0].tool_results[0].content == str(task.answer)  # computed in the sandbox
        assert traj.reward == reward
        assert traj.rewards == {"exact_answer": reward}


async def test_calculator_bad_expressions_are_errors_the_model_sees() -> None:
    env = load_environment("calculator", num_tasks=1)
    script = [
        tool_call("calc", expression="2 +"),
        tool_call("calc", expression="__import__('os').getcwd()"),
        tool_call("calc", expression=""),
        "Answer: 0",
    ]
    (traj,) = await rollout(env, env.tasks(), script)
    assert traj.status == "ok", traj.error
    results = [turn.tool_results[0] for turn in traj.turns[:3]]
    assert all(r.error == "tool_error" and r.content.startswith("Error: ") for r in results)
    assert "SyntaxError" in results[0].content
    assert "NameError" in results[1].content  # no builtins inside the evaluator
    assert len(traj.turns) == 4


# -- guess_number ----------------------------------------------------------------------------


def bisect(request: GenerationRequest) -> str:
    """A policy that halves the interval using the feedback in its prompt."""
    text = decoded(request)
    lo, hi = 1, 100
    guesses = re.findall(r"<\|im_start\|>assistant\n(-?\d+)<\|im_end\|>", text)
    feedback = re.findall(r"<\|im_start\|>user\n(higher|lower)<\|im_end\|>", text)
    assert len(guesses) == len(feedback) == request.turn_index
    for guess, hint in zip(guesses, feedback, strict=True):
        lo, hi = (int(guess) + 1, hi) if hint == "higher" else (lo, int(guess) - 1)
    return str((lo + hi) // 2)


async def test_guess_number_bisection_finds_every_secret() -> None:
    env = load_environment("guess_number", num_tasks=12)
    trajs = await rollout(env, list(env.tasks()), bisect, samples_per_task=2)
    secrets = set()
    for traj in trajs:
        secret = env.secret_for(traj.seed)  # type: ignore[attr-defined]
        secrets.add(secret)
        turns = len(traj.turns)
        assert traj.status == "ok" and traj.stop_reason == "no_tool_call", traj.error
        assert traj.turns[-1].text == str(secret)
        assert turns <= 7
        assert traj.reward == pytest.approx(1.0 + 0.5 * (8 - turns) / 7)
    assert len(secrets) > 6  # the secret varies with the episode seed


async def test_guess_number_rewards_a_faster_solution_more() -> None:
    env = load_environment("guess_number", num_tasks=1)
    (task,) = env.tasks()
    secret = env.secret_for(episode_seed(0, task.id, 0))  # type: ignore[attr-defined]
    assert secret != 50  # so bisection, which starts at 50, needs more than one turn
    (lucky,) = await rollout(env, [task], [f"Is it {secret}?"])
    (searched,) = await rollout(env, [task], bisect)
    assert len(lucky.turns) == 1
    assert lucky.rewards == {"solved": 1.0, "speed": 0.5}
    assert 1.0 <= searched.reward < lucky.reward == 1.5


async def test_guess_number_wrong_guesses_score_zero_after_max_turns() -> None:
    env = load_environment("guess_number", num_tasks=1)
    (traj,) = await rollout(env, env.tasks(), ["no idea", "0"])
    feedback = [m.content for m in traj.messages if m.role == "user"][1:]
    assert feedback[0] == "Reply with a single integer from 1 to 100."
    assert feedback[1:] == ["higher"] * 7  # the last one is in messages, not in the tokens
    assert (traj.status, traj.stop_reason, len(traj.turns)) == ("truncated", "max_turns", 8)
    assert traj.reward == 0.0


async def test_guess_number_state_dict_round_trips_and_episodes_do_not_share_it() -> None:
    env = load_environment("guess_number", num_tasks=1)
    (task,) = env.tasks()
    first, second = env.spawn(), env.spawn()
    await first.reset(task, seed=11)
    await second.reset(task, seed=12)
    first.guesses.append(5)  # type: ignore[attr-defined]
    assert second.guesses == []  # type: ignore[attr-defined]
    state = decode_msgpack(encode_msgpack(first.state_dict()), dict[str, Any])
    restored = env.spawn()
    restored.load_state_dict(state)
    assert (
        restored.state_dict()
        == first.state_dict()
        == {"secret": env.secret_for(11), "guesses": [5]}
    )  # type: ignore[attr-defined]


# -- code_fix ---------------------------------------------------------------------------------


def code_block(code: str) -> str:
    return f"Here is the fix:\n```python\n{code}```"


def by_task(choose: Callable[[Task], str]) -> Callable[[GenerationRequest], str]:
    """A script that answers ``choose(task)`` for the task whose function is in the prompt."""
    tasks = load_environment("code_fix").tasks()

    def script(request: GenerationRequest) -> str:
        text = decoded(request)
        (task,) = [t for t in tasks if t.answer.split("(")[0] + "(" in text]
        return choose(task)

    return script


async def test_code_fix_correct_fix_scores_one_and_the_bug_less() -> None:
    env = load_environment("code_fix")
    tasks = list(env.tasks())
    fixed = await rollout(env, tasks, by_task(lambda t: code_block(t.answer)))
    assert [(t.status, t.reward) for t in fixed] == [("ok", 1.0)] * len(tasks)
    buggy_code = {
        t.id: re.search(r"```python\n(.*)```", t.data["prompt"], re.DOTALL)[1] for t in tasks
    }  # type: ignore[index]
    buggy = await rollout(env, tasks, by_task(lambda t: code_block(buggy_code[t.id])))
    assert all(t.status == "ok" for t in buggy)
    # partial credit: the fraction of tests each original bug still passes
    assert {t.task_id.removeprefix("code_fix-"): t.reward for t in buggy} == pytest.approx(
        {
            "mean": 0.0,
            "factorial": 2 / 3,
            "is_palindrome": 2 / 3,
            "fizzbuzz": 3 / 4,
            "last_word": 2 / 3,
        }
    )


async def test_code_fix_accepts_a_solution_written_with_the_tools() -> None:
    env = load_environment("code_fix")
    task = env.tasks()[0]
    script = [
        tool_call("write_file", path="solution.py", content=task.answer),
        tool_call("python_exec", code=f"{task.answer}\nprint({task.data['tests'][0]} == 2)"),
        "I wrote solution.py.",
    ]
    (traj,) = await rollout(env, [task], script)
    assert traj.turns[1].tool_results[0].content.strip() == "True"
    assert (traj.status, traj.reward) == ("ok", 1.0)


async def test_code_fix_run_tests_reports_each_test_and_is_served_from_the_cache() -> None:
    env = load_environment("code_fix")
    task = env.tasks()[0]  # mean: the bug divides by len - 1
    buggy = re.search(r"```python\n(.*)```", task.data["prompt"], re.DOTALL)[1]  # type: ignore[index]
    writes = "open('solution.py', 'w').write('x = 1')\n"
    script = [
        tool_call("run_tests", code=buggy),
        tool_call("run_tests", code=writes + task.answer),
        tool_call("read_file", path="solution.py"),
        code_block(task.answer),
    ]
    trajs = await rollout(
        env, [task] * 3, script, tool_cache=True, tool_cache_verify=0.0, concurrency=1
    )
    for traj in trajs:
        first, second, read = (t.tool_results[0] for t in traj.turns[:3])
        assert first.content.startswith("0/3 tests pass\nFAIL: mean([1, 2, 3]) returned 3.0")
        assert second.content.splitlines()[0] == "3/3 tests pass"
        assert read.error is not None  # the tested code ran in a scratch directory
        assert (traj.status, traj.reward) == ("ok", 1.0)
    assert env.tools["run_tests"].pure
    # the first episode ran both; later ones were served (the first two hits verified)
    cached = [[t.tool_results[0].cached for t in traj.turns[:2]] for traj in trajs]
    assert cached[0] == [False, False] and sum(map(sum, cached)) == 2


@pytest.mark.parametrize(
    "answer",
    [
        "No code, sorry.",
        code_block("def mean(xs) return 0\n"),
        code_block("print('0' * 32, 3)\nimport sys\nsys.exit(0)\n"),
        code_block("import os\nos._exit(0)\n"),
        code_block("while True:\n    pass\n"),
        # a candidate that takes over the runner: it knows the nonce and the calls, not the
        # expected values (they stay on the host)
        code_block(
            "import __main__, json, os\nreq = __main__.req\n"
            "print(req['nonce'], json.dumps(['true'] * len(req['calls'])))\nos._exit(0)\n"
        ),
        code_block(
            "import __main__, os\nreq = __main__.req\n"
            "print(req['nonce'], len(req['calls']))\nos._exit(0)\n"
        ),
    ],
    ids=["no-code", "syntax-error", "fake-result", "hard-exit", "hang", "forged", "forged-count"],
)
async def test_code_fix_scores_zero_for_missing_broken_or_cheating_code(answer: str) -> None:
    env = load_environment("code_fix")
    env.test_timeout = 0.5  # type: ignore[attr-defined]
    (traj,) = await rollout(env, [env.tasks()[0]], [answer])
    assert traj.status == "ok", traj.error
    assert traj.reward == 0.0
