"""verifiers environments (defined here with the installed verifiers API) run by the rollout
engine through the gateway: the rubric's reward lands on each trajectory, the tokens are the
ones the backend sampled, groups come out whole, and a verifiers environment that raises
fails its episode as data."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agentroll.backends.base import GenerationChunk, GenerationRequest
from agentroll.backends.mock import MockBackend
from agentroll.chat import ChatTokenizer
from agentroll.errors import ConfigError
from agentroll.rollout.engine import RolloutConfig, RolloutEngine
from agentroll.stream.spool import Spool
from agentroll.types import Trajectory, decode_msgpack

# a missing or broken [verifiers] extra skips each test with why (a failure under
# AGENTROLL_REQUIRE=verifiers), never a collection error that stops the whole suite
_WHY: str | None = None
try:
    import datasets
    import verifiers as vf

    from agentroll.integrations.verifiers import VerifiersEnvironment
except ImportError as exc:
    _WHY = f"verifiers is not usable here: {exc}"

pytestmark = [pytest.mark.verifiers, *([pytest.mark.skip(reason=_WHY)] if _WHY else [])]

ROWS = [("2 + 3", "5"), ("4 + 4", "8"), ("7 + 1", "8")]  # the model slips on the 7


# -- the verifiers environment ------------------------------------------------------------------


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def final_text(completion: list[Any]) -> str:
    return str(completion[-1].content or "") if completion else ""


def exact_answer(completion: list[Any], answer: str) -> float:
    """1 when the last reply ends with the answer."""
    return float(final_text(completion).strip().endswith(answer))


def used_tool(completion: list[Any]) -> float:
    """1 when the model called a tool."""
    return float(any(getattr(m, "tool_calls", None) for m in completion))


def math_env(*funcs: Any, weights: list[float] | None = None, **kwargs: Any) -> Any:
    """A verifiers ToolEnv over a three-row dataset built in memory."""
    dataset = datasets.Dataset.from_list(
        [{"question": f"What is {q}?", "answer": a} for q, a in ROWS]
    )
    rubric = vf.Rubric(funcs=list(funcs), weights=weights)
    return vf.ToolEnv(dataset=dataset, tools=[add], rubric=rubric, max_turns=4, **kwargs)


# -- a scripted model whose every generation is recorded -----------------------------------------


def solve(tok: ChatTokenizer, request: GenerationRequest) -> str:
    """Call ``add`` on the question, then answer with its result (one too many for 7)."""
    text = tok.decode(request.prompt_ids, skip_special_tokens=False)
    if request.turn_index == 0:
        a, b = re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1]
        call = {"name": "add", "arguments": {"a": int(a), "b": int(b)}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    result = int(re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)[-1])
    slip = "What is 7 + 1?" in text
    return f"The answer is {result + slip}"


class Recording(MockBackend):
    """A MockBackend that keeps each request's prompt and the ids and logprobs it sampled."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sampled: list[tuple[list[int], list[int], list[float]]] = []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        ids: list[int] = []
        lps: list[float] = []
        async with contextlib.aclosing(super().generate(request)) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                ids += chunk.token_ids
                lps += chunk.logprobs
                yield chunk
        self.sampled.append((list(request.prompt_ids), ids, lps))


def assert_token_exact(trajs: list[Trajectory], sampled: list[Any]) -> None:
    """Every turn holds exactly the ids (and logprobs) one backend call sampled after a
    prompt that is the trajectory before it; every request is a prefix of a trajectory."""
    all_ids = [t.token_ids.tolist() for t in trajs]
    for prompt, _, _ in sampled:
        assert any(ids[: len(prompt)] == prompt for ids in all_ids), "a prompt is no prefix"
    for traj, ids in zip(trajs, all_ids, strict=True):
        assert traj.turns and traj.turns[0].gen_start == traj.prompt_len > 0
        mask = np.zeros(len(ids), dtype=np.uint8)
        for turn in traj.turns:
            gs, ge = turn.gen_start, turn.gen_end
            mask[gs:ge] = 1
            calls = [(p, s, lp) for p, s, lp in sampled if p == ids[:gs] and s == ids[gs:ge]]
            assert calls, f"turn {turn.index}: no backend call sampled tokens [{gs}, {ge})"
            np.testing.assert_array_equal(
                traj.logprobs[gs:ge], np.array(calls[0][2], dtype=np.float32)
            )
        np.testing.assert_array_equal(traj.loss_mask, mask)
        assert traj.num_generated == int(mask.sum()) > 0


# -- tests --------------------------------------------------------------------------------------


async def test_rubric_rewards_land_on_token_exact_trajectories(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    env = VerifiersEnvironment(math_env(exact_answer, used_tool, weights=[1.0, 0.5]))
    backend = Recording(lambda r: solve(tok, r), tokenizer=tok)
    config = RolloutConfig(samples_per_task=2, concurrency=4, progress="off")
    async with backend, RolloutEngine(backend, env, config, tokenizer=tok) as engine:
        groups = [g async for g in engine.run_groups()]
    trajs = [t for g in groups for t in g]
    assert len(groups) == 3 and all(len(g) == 2 for g in groups)
    for group in groups:
        assert [t.sample_index for t in group] == [0, 1]
        assert len({t.task_id for t in group}) == len({t.group_id for t in group}) == 1
    for t in trajs:
        assert t.status == "ok" and t.error is None and not t.forks, t.error
        assert len(t.turns) == 2 and t.metrics["verifiers_turns"] == 2.0
        right = t.task_id != "2"  # row 2 asks 7 + 1, which the model gets wrong
        assert t.rewards["exact_answer"] == float(right)
        assert t.rewards["used_tool"] == 1.0
        assert t.rewards["add_calls"] == 1.0  # ToolEnv's own metrics, weight 0
        assert t.reward == pytest.approx(float(right) + 0.5)
        # the tool ran in verifiers and its output is in the tokens the trainer sees
        reply = tok.decode(t.token_ids[t.turns[0].gen_end : t.turns[0].env_end].tolist())
        assert str(add(*map(int, re.findall(r"\d+", ROWS[int(t.task_id)][0])))) in reply
    assert len(backend.sampled) == 12
    assert_token_exact(trajs, backend.sampled)
    # the episodes reach a spool (what the stream serves) like any other
    with Spool(tmp_path) as spool:
        spool.append_many(trajs)
        spool.flush()
    with Spool(tmp_path) as spool:
        back = {r.id: decode_msgpack(r.data, Trajectory) for r in spool.pending()}
    assert sorted(back) == sorted(t.id for t in trajs)
    for t in trajs:
        assert back[t.id].reward == t.reward and back[t.id].rewards == t.rewards
        np.testing.assert_array_equal(back[t.id].token_ids, t.token_ids)


async def test_group_reward_functions_score_whole_groups(tok: ChatTokenizer) -> None:
    """A verifiers group reward function sees every sample of a row at once; the engine
    releases each group together, with verifiers' weighted reward."""
    seen: list[int] = []

    def group_size(states: list[Any]) -> list[float]:
        seen.append(len(states))
        return [float(len(states))] * len(states)

    env = VerifiersEnvironment(math_env(exact_answer, group_size, weights=[1.0, 0.25]))
    assert env.group_scoring
    backend = MockBackend(lambda r: solve(tok, r), tokenizer=tok)
    config = RolloutConfig(samples_per_task=3, concurrency=2, progress="off")
    async with backend, RolloutEngine(backend, env, config, tokenizer=tok) as engine:
        trajs = [t async for t in engine.run()]
    assert seen == [3, 3, 3]
    for k in range(0, 9, 3):  # run() hands out a group at once, in sample order
        group = trajs[k : k + 3]
        assert len({t.group_id for t in group}) == 1
        assert [t.sample_index for t in group] == [0, 1, 2]
    for t in trajs:
        right = float(t.task_id != "2")
        assert t.status == "ok", t.error
        assert t.rewards["group_size"] == 3.0 and t.rewards["exact_answer"] == right
        assert t.reward == pytest.approx(right + 0.75)
    assert not env._unscored  # every rolled-out state was scored once


async def test_a_raising_verifiers_env_fails_its_episodes_as_data(tok: ChatTokenizer) -> None:
    """A rollout that raises and a reward function that raises (verifiers alone would log
    it and score 0): each fails only its own episodes, with the reason; the others are
    scored as usual."""

    def picky(completion: list[Any], answer: str) -> float:
        if answer == "5":
            raise ValueError("cannot score a five")
        return exact_answer(completion, answer)

    class Crashing(vf.ToolEnv):  # type: ignore[misc,name-defined]
        async def setup_state(self, state: Any) -> Any:
            if "4 + 4" in str(state["prompt"]):
                raise RuntimeError("the environment broke")
            return state

    dataset = datasets.Dataset.from_list(
        [{"question": f"What is {q}?", "answer": a} for q, a in ROWS]
    )
    vf_env = Crashing(
        dataset=dataset,
        tools=[add],
        rubric=vf.Rubric(funcs=[picky]),
        max_turns=4,
    )
    env = VerifiersEnvironment(vf_env)
    backend = MockBackend(lambda r: solve(tok, r), tokenizer=tok)
    config = RolloutConfig(samples_per_task=2, concurrency=6, progress="off")
    async with backend, RolloutEngine(backend, env, config, tokenizer=tok) as engine:
        trajs = [t async for t in engine.run()]
    by_row: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_row.setdefault(t.task_id, []).append(t)
    assert sorted(by_row) == ["0", "1", "2"] and all(len(v) == 2 for v in by_row.values())
    for t in by_row["0"]:  # the reward function raised: failed, its tokens kept
        assert t.status == "failed"
        assert "reward function picky raised ValueError: cannot score a five" in (t.error or "")
        assert len(t.turns) == 2 and t.num_generated > 0
    for t in by_row["1"]:  # the rollout raised before the model was called
        assert t.status == "failed" and "RuntimeError: the environment broke" in (t.error or "")
    for t in by_row["2"]:
        assert t.status == "ok" and t.error is None
        assert t.reward == t.rewards["picky"] == 0.0


async def test_a_verifiers_error_in_the_state_and_a_hang_fail_as_data(tok: ChatTokenizer) -> None:
    """A tool error verifiers keeps in its state (a ``stop_errors`` type) fails the episode
    with the chain of causes; a sync tool that blocks verifiers' loop ends at the engine's
    episode timeout, on time."""

    def divide(a: int, b: int) -> float:
        """Divide a by b.

        Args:
            a: The dividend.
            b: The divisor.
        """
        return a / b

    dataset = datasets.Dataset.from_list([{"question": "What is 1 / 0?", "answer": "x"}])
    vf_env = vf.ToolEnv(
        dataset=dataset,
        tools=[divide],
        rubric=vf.Rubric(funcs=[exact_answer]),
        stop_errors=[ZeroDivisionError],
    )
    call = '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
    backend = MockBackend([call, "done"], tokenizer=tok)
    config = RolloutConfig(progress="off")
    async with backend, RolloutEngine(backend, VerifiersEnvironment(vf_env), config) as engine:
        (t,) = [t async for t in engine.run()]
    assert t.status == "failed" and len(t.turns) == 1
    assert "ToolCallError" in (t.error or "") and "ZeroDivisionError" in (t.error or "")

    def slow_add(a: int, b: int) -> int:
        """Add two integers, slowly (verifiers calls sync tools on its event loop).

        Args:
            a: The first integer.
            b: The second integer.
        """
        time.sleep(1.5)
        return a + b

    stuck = vf.ToolEnv(dataset=dataset, tools=[slow_add], rubric=vf.Rubric(funcs=[exact_answer]))
    call = '<tool_call>{"name": "slow_add", "arguments": {"a": 1, "b": 0}}</tool_call>'
    config = RolloutConfig(episode_timeout=0.3, progress="off")
    backend = MockBackend([call, "done"], tokenizer=tok)
    async with backend, RolloutEngine(backend, VerifiersEnvironment(stuck), config) as engine:
        started = time.monotonic()
        (t,) = [t async for t in engine.run()]
        # the blocked verifiers loop stalls neither the engine nor its timeout
        assert time.monotonic() - started < 1.2
    assert t.status == "failed" and "EpisodeTimeout" in (t.error or "")


def test_bad_input_is_refused_with_what_to_do() -> None:
    with pytest.raises(ConfigError, match="needs a verifiers Environment"):
        VerifiersEnvironment(object())
    with pytest.raises(ConfigError, match="could not load environment 'no-such-env'"):
        VerifiersEnvironment.load("no-such-env")


def test_missing_verifiers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentroll.errors import MissingDependencyError
    from agentroll.integrations import verifiers as adapter

    monkeypatch.setitem(sys.modules, "verifiers", None)  # import verifiers -> ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'agentroll\[verifiers\]'"):
        adapter.VerifiersEnvironment(object())


def test_agentroll_does_not_import_verifiers() -> None:
    import subprocess

    code = "import sys, agentroll, agentroll.integrations; print('verifiers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


async def test_on_the_built_in_engine(tiny_model: Path) -> None:
    """The tiny model (random text) through a SingleTurnEnv: verifiers' reward is on each
    trajectory, the tokens are the ones the engine sampled, and a reply cut at
    ``max_tokens`` (verifiers: ``is_truncated``) is a truncated episode, still scored."""
    from agentroll.backends.torch import TorchBackend

    def length(completion: list[Any]) -> float:
        return float(len(final_text(completion)))

    dataset = datasets.Dataset.from_list([{"question": "hello", "answer": "x"}])
    vf_env = vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[length]))
    env = VerifiersEnvironment(vf_env, sampling_args={"max_tokens": 8})
    backend = TorchBackend(tiny_model)
    sampled: list[Any] = []
    inner = backend.generate

    async def generate(request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        ids: list[int] = []
        lps: list[float] = []
        async with contextlib.aclosing(inner(request)) as chunks:  # type: ignore[type-var]
            async for chunk in chunks:
                ids, lps = ids + list(chunk.token_ids), lps + list(chunk.logprobs)
                yield chunk
        sampled.append((list(request.prompt_ids), ids, lps))

    backend.generate = generate  # type: ignore[method-assign]
    config = RolloutConfig(samples_per_task=2, progress="off")
    async with backend, RolloutEngine(backend, env, config) as engine:
        trajs = [t async for t in engine.run()]
    assert len(trajs) == 2 and len(sampled) == 2
    for t in trajs:
        assert t.status == "truncated" and t.error is None, t.error
        assert t.turns[0].gen_end - t.turns[0].gen_start == 8
        text = t.messages[-1].content if t.messages else ""
        assert t.reward == t.rewards["length"] == float(len(text)) > 0
    assert_token_exact(trajs, sampled)


def test_the_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "verifiers_env.py"
    spec = importlib.util.spec_from_file_location("verifiers_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    out = capsys.readouterr().out
    assert "mean reward" in out and "failed=0" in out
