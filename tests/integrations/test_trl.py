"""TRL's real GRPOTrainer over agentroll episodes: three steps on the tiny model on the CPU,
the backend's weights equal to the trainer's after every sync, and the completion ids TRL
trains on exactly the ids the backend sampled.  Also the environment_factory adapter."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agentroll.backends.base import GenerationChunk, GenerationRequest
from agentroll.backends.torch import TorchBackend
from agentroll.env import load_environment
from agentroll.errors import ConfigError
from agentroll.rollout.engine import RolloutConfig
from agentroll.types import SamplingParams

# a missing or broken [trl] extra skips each test with why (a failure under
# AGENTROLL_REQUIRE=trl), never a collection error that stops the whole suite
_WHY: str | None = None
try:
    import trl

    from agentroll.integrations.trl import (
        AgentrollRollout,
        agentroll_reward,
        check_trl,
        environment_factory,
        trl_dataset,
    )
except ImportError as exc:
    _WHY = f"trl is not usable here: {exc}"

pytestmark = [pytest.mark.trl, *([pytest.mark.skip(reason=_WHY)] if _WHY else [])]


class RecordingBackend(TorchBackend):
    """The built-in engine, recording what each request's prompt was and what it sampled."""

    def __init__(self, model: str) -> None:
        super().__init__(model)
        self.sampled: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        ids: list[int] = []
        async for chunk in super().generate(request):
            ids = ids[: len(ids) - chunk.rollback] + list(chunk.token_ids)
            yield chunk
        self.sampled.add((tuple(request.prompt_ids), tuple(ids)))


def parity_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The share of even token ids: varies within a group (the untrained tiny model rarely
    solves a task), so the advantages and the weights move."""
    return [sum(1 - i % 2 for i in ids) / max(len(ids), 1) for ids in completion_ids]


@pytest.mark.slow
def test_grpo_trainer_trains_three_steps_on_agentroll_episodes(
    tiny_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    env = load_environment("calculator", num_tasks=4, seed=0)
    tasks = list(env.tasks())
    backend = RecordingBackend(str(tiny_model))
    config = RolloutConfig(
        concurrency=8, progress="off", sampling=SamplingParams(max_tokens=24, temperature=1.0)
    )
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model), padding_side="left")
    trained: list[list[list[int]]] = []
    with AgentrollRollout(env, backend, tasks=tasks, config=config) as rollout:
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[agentroll_reward, parity_reward],
            args=args,
            train_dataset=trl_dataset(tasks),
            processing_class=tokenizer,
            rollout_func=rollout,
        )
        generate = trainer._generate_and_score_completions

        def capture(inputs: Any) -> Any:
            out = generate(inputs)
            ids, mask = out["completion_ids"], out["completion_mask"]
            trained.append([row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)])
            by_id = [t.token_ids[t.prompt_len :].tolist() for t in rollout.trajectories]
            assert trained[-1] == by_id  # TRL trains on the episodes' own ids, in order
            return out

        trainer._generate_and_score_completions = capture  # type: ignore[method-assign]
        trainer.train()
        trajs = rollout.trajectories
        syncs = rollout.syncs

    logs = [h for h in trainer.state.log_history if "loss" in h]
    for h, s in zip(logs, syncs, strict=False):
        print(
            f"step={s.step} loss={h['loss']:.4g} reward={h['reward']:.4f} sync={s.kind} "
            f"bytes={s.payload_bytes} digest_match={s.trainer_digest == s.backend_digest}"
        )
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) for h in logs)
    assert all("rewards/agentroll_reward/mean" in h for h in logs)
    # one sync per rollout: the first finds the same bytes, then a delta per trained step
    assert [s.step for s in syncs] == [0, 1, 2]
    assert [s.kind for s in syncs] == ["none", "delta", "delta"]
    assert all(s.trainer_digest == s.backend_digest for s in syncs)
    assert syncs[1].payload_bytes > 0 and syncs[-1].version == 2
    # every completion token with env_mask 1 is what the backend sampled for that prompt
    assert len(trained) == 3
    for t in trajs:
        runs, start = [], None
        for i, m in enumerate([*t.loss_mask.tolist(), 0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                runs.append((start, i))
                start = None
        assert runs, "every episode sampled something"
        for a, b in runs:
            key = (tuple(t.token_ids[:a].tolist()), tuple(t.token_ids[a:b].tolist()))
            assert key in backend.sampled
        assert t.policy_version[t.loss_mask == 1].min() == 2  # sampled after the last sync


def test_prompts_not_in_groups_are_refused(tiny_model: Path) -> None:
    env = load_environment("calculator", num_tasks=2, seed=0)

    class Trainer:
        num_generations = 2
        model = type("M", (), {"training": True})()

    with AgentrollRollout(env, str(tiny_model), sync_weights=False) as rollout:
        with pytest.raises(ConfigError, match="not a multiple of num_generations=2"):
            rollout(["a", "b", "c"], Trainer())
        with pytest.raises(ConfigError, match="not one prompt repeated"):
            rollout(["a", "b"], Trainer())


def test_the_supported_range_is_checked() -> None:
    assert check_trl() == trl.__version__


def test_environment_factory_runs_the_tools_and_scores_the_answer() -> None:
    import inspect

    from transformers.utils import get_json_schema

    env = load_environment("calculator", num_tasks=2, seed=0)
    known, other = list(env.tasks())
    cls, reward, close = environment_factory(env, tasks=[known])
    try:
        schema = get_json_schema(cls.calc)  # what TRL shows the model
        assert schema["function"]["name"] == "calc"
        assert "expression" in schema["function"]["parameters"]["properties"]
        assert inspect.signature(cls.calc).parameters["expression"].annotation is str
        a, b = cls(), cls()
        a.reset(prompt=known.data["prompt"], task_id=known.id)  # the task, found by id
        b.reset(prompt=other.data["prompt"], answer=other.answer)  # a row of fields
        values = [
            e.calc(expression=t.data["prompt"].split("What is ")[-1].rstrip("?"))
            for e, t in ((a, known), (b, other))
        ]
        assert values == [str(known.answer), str(other.answer)]  # run in their sandboxes
        assert "ZeroDivisionError" in a.calc(expression="1/0")  # an error is text the model sees
        right = [[{"role": "assistant", "content": f"Answer: {v}"}] for v in values]
        wrong = [{"role": "assistant", "content": "Answer: 0.5"}]
        prompts = [known.data["prompt"], other.data["prompt"], known.data["prompt"]]
        assert reward(prompts, [*right, wrong], [a, b, a]) == [1.0, 1.0, 0.0]
    finally:
        close()


@pytest.mark.slow
def test_environment_factory_under_grpo_trainers_own_loop(tiny_model: Path, tmp_path: Path) -> None:
    """TRL builds the model's tool list from the class (calc only: nothing else it exposes is
    taken for a tool), resets one instance per rollout and scores with the reward function.
    The untrained tiny model seldom calls a tool; the tool path is the test above."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen2_5_chat_template

    env = load_environment("calculator", num_tasks=4, seed=0)
    tasks = list(env.tasks())
    cls, reward, close = environment_factory(env, tasks=tasks)
    resets: list[str] = []
    reset = cls.reset

    def counting(self: Any, **row: Any) -> None:
        resets.append(row["task_id"])
        reset(self, **row)

    cls.reset = counting
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model), padding_side="left")
    tokenizer.chat_template = qwen2_5_chat_template  # one TRL can parse tool calls from
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=2,
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=24,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    try:
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(str(tiny_model)),
            reward_funcs=[reward],
            args=args,
            train_dataset=trl_dataset(tasks),
            processing_class=tokenizer,
            environment_factory=cls,
        )
        trainer.train()
    finally:
        close()
    assert [m.__name__ for ms in trainer._env_tools.values() for m in ms] == ["calc"]
    assert len(resets) == 8 and set(resets) <= {t.id for t in tasks}
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all("rewards/calculator_reward/mean" in h for h in logs)


def test_a_backend_on_other_weights_gets_a_full_update_first(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The backend loaded another checkpoint than the one TRL trains: the first sync finds
    the digests differ, pushes a full update, and only then do they match."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from agentroll.model.tiny import create_tiny

    other = create_tiny(tmp_path / "other", seed=7)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model))
    trainer = SimpleNamespace(
        state=SimpleNamespace(global_step=0),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        model=model,
    )
    env = load_environment("calculator", num_tasks=1, seed=0)
    with AgentrollRollout(env, str(other)) as rollout:
        rollout._sync(trainer)
        rollout._sync(trainer)  # once per trainer step: nothing more to do
    [sync] = rollout.syncs
    assert sync.kind == "full" and sync.payload_bytes > 0
    assert sync.trainer_digest == sync.backend_digest
