import asyncio
import threading
from typing import Any

import pytest

import agentroll
from agentroll.env import (
    Environment,
    EpisodeState,
    Rubric,
    call_hook,
    environment_class,
    load_environment,
    tool,
)
from agentroll.errors import ConfigError
from agentroll.types import ExecResult, Task, Trajectory


class Shapes(Environment):
    @tool
    def area(
        self, width: float, height: float = 1.0, unit: str = "m", state: EpisodeState | None = None
    ) -> str:
        """Area of a rectangle.

        Args:
            width: the width, in units
            height: the height; defaults to 1
                and may span lines
        Returns:
            the area
        """
        return f"{width * height}{unit}"

    @tool(name="tag", description="Tag things.", timeout=2)
    async def tag_things(self, tags: list[str], weights: dict[str, int] | None = None) -> list[str]:
        return sorted(tags)


def test_schema_comes_from_signature_and_docstring() -> None:
    specs = {s.name: s for s in Shapes().tool_specs}
    area = specs["area"]
    assert area.description == "Area of a rectangle."
    props = area.parameters["properties"]
    assert set(props) == {"width", "height", "unit"}  # injected `state` is hidden
    assert props["width"] == {"type": "number", "description": "the width, in units"}
    assert props["height"]["default"] == 1.0 and "may span lines" in props["height"]["description"]
    assert area.parameters["required"] == ["width"]
    assert area.parameters["additionalProperties"] is False
    tag = specs["tag"]
    assert tag.description == "Tag things."
    assert tag.parameters["properties"]["tags"] == {"type": "array", "items": {"type": "string"}}
    assert Shapes._tools["tag"].timeout == 2
    assert tag.to_openai()["function"]["name"] == "tag"


def test_validation_messages_are_for_the_model() -> None:
    t = Shapes._tools["area"]
    assert t.validate({"width": 2}) == {"width": 2, "height": 1.0, "unit": "m"}
    for bad, fragment in [
        ({}, "missing required field `width`"),
        ({"width": "2"}, "Expected `float`"),
        ({"width": 1, "depth": 2}, "unknown field `depth`"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            t.validate(bad)


def test_tool_methods_still_call_like_methods() -> None:
    assert Shapes().area(2.0, 3.0) == "6.0m"


def test_tools_that_need_a_sandbox_need_sandbox_config() -> None:
    with pytest.raises(ConfigError, match="sandbox_config"):

        class NoBox(Environment):
            @tool
            def run(self, cmd: str, sandbox: Any) -> str:
                """Run."""
                return ""


def test_varargs_tools_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"\*args"):
        tool(lambda *a: None)


async def test_sync_hooks_run_off_the_event_loop() -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def hook(x: int) -> int:
        seen.append(threading.get_ident())
        return x + 1

    assert await call_hook(hook, 1) == 2
    assert seen and seen[0] != loop_thread

    async def ahook(x: int) -> int:
        await asyncio.sleep(0)
        return x * 2

    assert await call_hook(ahook, 4) == 8


async def test_rubric_passes_the_arguments_each_function_asks_for() -> None:
    def exact(completion: str, answer: Any) -> float:
        return float(completion == answer)

    async def length(trajectory: Trajectory) -> float:
        return trajectory.num_tokens / 10

    rubric = Rubric([exact, length], [1.0, 0.5])
    from agentroll.types import Message

    traj = Trajectory(
        id="e",
        task_id="t",
        group_id="g",
        token_ids=[1, 2, 3, 4],
        logprobs=[0.0] * 4,
        loss_mask=[0] * 4,
        policy_version=[0] * 4,
        kv_version=[0] * 4,
        messages=[Message(role="assistant", content="7")],
    )
    state = EpisodeState(Task(id="t", answer="7"), seed=0, episode_id="e")
    scores = await rubric.score(Shapes(), traj, state, None)
    assert scores == {"exact": 1.0, "length": 0.4}
    assert rubric.combine(scores) == pytest.approx(1.2)


def test_rubric_rejects_unknown_arguments_and_bad_weights() -> None:
    def odd(foo: int) -> float:
        return 0.0

    with pytest.raises(ConfigError, match="one weight per"):
        Rubric([odd], [1.0, 2.0])


def test_registry() -> None:
    env = load_environment("calculator", num_tasks=3)
    assert env.name == "calculator" and len(list(env.tasks())) == 3
    assert (
        environment_class("agentroll.environments.guess_number:GuessNumber").name == "guess_number"
    )
    with pytest.raises(ConfigError, match="no environment named 'nope'"):
        load_environment("nope")
    assert agentroll.load_environment is load_environment


def test_spawn_is_a_per_episode_copy() -> None:
    env = Shapes()
    env.shared = [1]  # type: ignore[attr-defined]
    copy = env.spawn()
    copy.per_episode = 5  # type: ignore[attr-defined]
    assert not hasattr(env, "per_episode") and copy.shared is env.shared  # type: ignore[attr-defined]


def test_default_names_and_reset() -> None:
    class MyMazeEnv(Environment):
        system_prompt = "sys"

    assert MyMazeEnv.name == "my_maze"
    msgs = asyncio.run(MyMazeEnv().reset(Task(id="t", data={"prompt": "hi"}), seed=0))
    assert [(m.role, m.content) for m in msgs] == [("system", "sys"), ("user", "hi")]
    with pytest.raises(ConfigError, match="override reset"):
        asyncio.run(MyMazeEnv().reset(Task(id="t"), seed=0))


def test_exec_results_are_formatted_for_the_model() -> None:
    from agentroll.env import format_tool_output

    assert format_tool_output(ExecResult(exit_code=0)) == "(no output)"
    assert "[exit code 3]" in format_tool_output(ExecResult(exit_code=3, stderr="bad"))
    assert format_tool_output({"a": 1}) == '{"a": 1}'
