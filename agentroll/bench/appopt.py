"""``agentroll bench appopt``: application-level rollout optimisations, with against without.

The same episodes of ``code_fix`` (a scripted agent on the real token path and the real
sandbox: it runs the tests on the original code, then on its candidate, then answers) run
with and without each optimisation, alternately, ``--pairs`` times in one run; the speedup
is the median of the per-pair episodes/s ratios (``ratio_min``/``ratio_max``: its range).
Its verdict is the optimisation's validate verdict on the bench's own episodes.
``tool_cache``: the scripted agent on the mock backend; the same tool results and rewards
per (task, sample) as without, the two-sample tests passing, no tool found impure.
``sandbox_prewarm``: the scripted agent, the next group's sandboxes kept started ahead;
the same tool results and rewards per (task, sample).
``group_prefix_sharing``: the tiny model on the built-in engine (batch-invariant); the
same tokens and logprobs per (task, sample) as without, and ``prefill_saved`` (the share
of prompt tokens no prefill computed: forked, or served by the prefix cache) against its
target ``(n - 1) / n``; ``prefill_saved_without`` is the prefix cache's alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentroll.bench.pairs import DEFAULT_PAIRS, alternate_async, check_pairs, paired_ratio
from agentroll.errors import ConfigError

#: ``--record`` writes a row per optimisation ("appopt:tool_cache", ...)
ROW_KEY = "opt"
#: optimisations this benchmark measures, and those it cannot measure yet (not built)
BUILT = ("tool_cache", "group_prefix_sharing", "early_group_cutoff", "sandbox_prewarm")
NOT_BUILT: tuple[str, ...] = ()
ENVS = ("code_fix",)
#: group_prefix_sharing runs the model itself, on any of these (calculator: a prompt per
#: group, where the prefix cache cannot stand in for the sharing)
MODEL_ENVS = ("code_fix", "calculator")
#: the chance the scripted agent's candidate is the correct fix (else it retries the bug)
P_FIXED = 0.7
#: early_group_cutoff's workload: the chance each task's candidate is the fix (some tasks
#: always solved or never, as a policy's easy and hard tasks), the share of episodes that
#: straggle, and the extra run_tests turns a straggler takes
DIFFICULTY = {
    "code_fix-mean": 1.0,
    "code_fix-factorial": 1.0,
    "code_fix-is_palindrome": 0.0,
    "code_fix-fizzbuzz": 0.7,
    "code_fix-last_word": 0.5,
}
P_STRAGGLE, STRAGGLE_TURNS = 0.25, 3
CUTOFF = 0.75


def _hermes(name: str, **arguments: Any) -> str:
    payload = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{payload}\n</tool_call>"


def code_fix_agent(
    tok: Any, tasks: list[Any], seed: int, *, long_tail: bool = False
) -> Callable[[Any], str]:
    """The scripted policy: ``run_tests`` on the task's code, ``run_tests`` on its candidate
    (the fix with chance ``P_FIXED``, else the original code; drawn from the episode's seed,
    so a (task, sample) picks the same in every run), then the candidate as its answer.  The
    task is read once per episode from the decoded prompt.  ``long_tail``: the fix's chance
    is the task's ``DIFFICULTY``, and a ``P_STRAGGLE`` share of episodes runs the tests
    ``STRAGGLE_TURNS`` more times before answering."""
    buggy: dict[str, str] = {}
    for t in tasks:
        found = re.search(r"```python\n(.*)```", t.data["prompt"], re.DOTALL)
        if found is None:
            raise ConfigError(f"task {t.id} has no ```python block: not a code_fix task")
        buggy[t.id] = found[1]
    of_episode: dict[str, tuple[Any, str, int]] = {}

    def respond(request: Any) -> str:
        if request.episode_id not in of_episode:
            text = tok.decode(list(request.prompt_ids), skip_special_tokens=False)
            task = next(t for t in tasks if buggy[t.id] in text)
            # turn 0's sampling seed is the episode's own (episode_seed of task and sample)
            rng = random.Random(f"{seed}:{request.sampling.seed}")
            p_fixed = DIFFICULTY.get(task.id, P_FIXED) if long_tail else P_FIXED
            pick = task.answer if rng.random() < p_fixed else buggy[task.id]
            extra = STRAGGLE_TURNS if long_tail and rng.random() < P_STRAGGLE else 0
            of_episode[request.episode_id] = (task, pick, extra)
        task, candidate, extra = of_episode[request.episode_id]
        if request.turn_index == 0:
            return _hermes("run_tests", code=buggy[task.id])
        if request.turn_index <= 1 + extra:
            return _hermes("run_tests", code=candidate)
        of_episode.pop(request.episode_id)
        return f"The fix:\n```python\n{candidate}```"

    return respond


@dataclass(frozen=True, slots=True)
class AppOptBenchConfig:
    """The options of ``agentroll bench appopt``."""

    env: str = "code_fix"
    episodes: int = 256
    samples: int = 8
    concurrency: int = 8
    pairs: int = DEFAULT_PAIRS
    opts: tuple[str, ...] = BUILT
    seed: int = 0

    def __post_init__(self) -> None:
        scripted = [o for o in self.opts if o != "group_prefix_sharing"]
        if self.env not in (ENVS if scripted else MODEL_ENVS):
            raise ConfigError(
                f"--env {self.env!r}: the scripted agent of {', '.join(scripted)} exists for "
                f"{ENVS}; --opt group_prefix_sharing alone also runs on {MODEL_ENVS}"
                if scripted
                else f"--env {self.env!r}: use one of {MODEL_ENVS}"
            )
        for name in ("episodes", "samples", "concurrency"):
            if (value := getattr(self, name)) < 1:
                raise ConfigError(f"--{name} must be >= 1 (got {value}); pass a positive count")
        check_pairs(self.pairs)
        for opt in self.opts:
            if opt in NOT_BUILT:
                raise ConfigError(f"--opt {opt}: this optimisation is not built yet")
            if opt not in BUILT:
                raise ConfigError(f"--opt {opt!r}: unknown optimisation; known: {', '.join(BUILT)}")


@dataclass(frozen=True, slots=True)
class Side:
    """One run's figures: episodes/s, tool calls, cache hits, and per (task, sample) the
    tool results and reward of each episode (sorted)."""

    episodes_per_s: float
    calls: int
    hits: int
    impure: tuple[str, ...]
    seen: list[tuple[Any, ...]]
    trajectories: list[Any]
    shared_tokens: int = 0
    prompt_tokens: int = 0
    prompt_computed: int = 0
    cut: int = 0
    generated: int = 0


async def run_side(
    config: AppOptBenchConfig, *, tool_cache: bool = False, opt: str = "tool_cache", on: bool = True
) -> Side:
    """The bench's episodes once, on a fresh engine (and a fresh cache): ``tool_cache``
    with or without the cache (``tool_cache``); ``group_prefix_sharing`` with or without
    it (``on``)."""
    from agentroll.backends.base import SamplingParams
    from agentroll.backends.mock import MockBackend
    from agentroll.backends.torch import TorchBackend
    from agentroll.env import load_environment
    from agentroll.model.tiny import ensure_tiny_model
    from agentroll.model.tokenizer import tiny_chat_tokenizer
    from agentroll.rollout.engine import RolloutConfig, RolloutEngine

    tok = tiny_chat_tokenizer()
    env = load_environment(config.env)
    tasks = list(env.tasks())
    groups = max(1, config.episodes // config.samples)
    chosen = [tasks[i % len(tasks)] for i in range(groups)]
    on_model = opt == "group_prefix_sharing"
    long_tail = opt == "early_group_cutoff"
    backend: Any = (
        TorchBackend(
            str(ensure_tiny_model()),
            batch_invariant=True,
            kv_cache_mb=64,
            max_num_seqs=max(8, config.concurrency),
            share_group_prefill=on,
        )
        if on_model
        else MockBackend(
            code_fix_agent(tok, tasks, config.seed, long_tail=long_tail), tokenizer=tok
        )
    )
    cfg = RolloutConfig(
        concurrency=config.concurrency,
        samples_per_task=config.samples,
        # the tiny model's turns: short, so the prompts' prefill is a visible share
        sampling=SamplingParams(max_tokens=16 if on_model else 1024),
        seed=config.seed,
        tool_cache=tool_cache and opt == "tool_cache",
        group_cutoff=CUTOFF if long_tail and on else 0.0,
        prewarm_sandboxes=opt == "sandbox_prewarm" and on,
        keep_messages=False,
        progress="off",
    )
    out = []
    async with backend, RolloutEngine(backend, env, cfg, tokenizer=tok) as engine:
        start = time.perf_counter()
        out = [t async for t in engine.run(chosen)]
        elapsed = time.perf_counter() - start
        stats = engine.tool_cache.stats() if engine.tool_cache is not None else {}
        sched = backend.engine.scheduler if on_model else None
        shared = sched.num_shared_tokens if sched is not None else 0
        prompts = (sched.num_prompt_tokens, sched.num_prompt_computed) if sched else (0, 0)
    failed = [t for t in out if t.status == "failed"]
    if failed:
        raise RuntimeError(
            f"{len(failed)} of {len(out)} bench episodes failed (first: {failed[0].error}); "
            "the figure would be meaningless: check that `agentroll sandbox check` passes"
        )
    seen = sorted(
        (
            t.task_id,
            t.sample_index,
            tuple(r.content for turn in t.turns for r in turn.tool_results),
            t.reward,
            tuple(t.token_ids.tolist()) if on_model else (),
            t.logprobs.tobytes() if on_model else b"",  # bytes: NaN (not sampled) == NaN
        )
        for t in out
    )
    return Side(
        episodes_per_s=len(out) / elapsed,
        calls=sum(len(turn.tool_results) for t in out for turn in t.turns),
        # hits: tool-cache hits, or episodes whose sandbox was started ahead (pre-warm)
        hits=int(stats.get("hits", 0)) + engine.stats["prewarmed_sandboxes"],
        impure=tuple(stats.get("impure", ())),
        seen=seen,
        trajectories=out,
        shared_tokens=shared,
        prompt_tokens=prompts[0],
        prompt_computed=prompts[1],
        cut=sum(t.status == "cut" for t in out),
        generated=sum(int(t.num_generated) for t in out),
    )


def verdict(with_: Side, without: Side, opt: str = "tool_cache") -> tuple[bool, str]:
    """The validate verdict on the bench's episodes.  ``early_group_cutoff``: GRPO
    advantages and rewards keep their distribution (the validate check's tests), and the
    episodes not cut are the same on both sides.  Otherwise: the same tool results, rewards
    (and tokens) per (task, sample), the distribution tests passing, no impure tool."""
    from agentroll.validate.recipe import advantage_series, ks_compare, ks_series

    if opt == "early_group_cutoff":
        # a (task, sample) recurs across groups of one task: compare as multisets, where
        # each cut episode accounts for one entry of the side without
        missing = Counter(with_.seen) - Counter(without.seen)
        differ = max(0, sum(missing.values()) - with_.cut)

        ks_ok, _ = ks_series(
            advantage_series(with_.trajectories), advantage_series(without.trajectories)
        )
        return differ == 0 and ks_ok, f"differ={differ} cut={with_.cut}"
    differ = sum(a != b for a, b in zip(with_.seen, without.seen, strict=True))
    ks_ok, _ = ks_compare(with_.trajectories, without.trajectories)
    ok = differ == 0 and ks_ok and not with_.impure
    return ok, f"differ={differ} impure={','.join(with_.impure) or 'none'}"


def prefill_target(config: AppOptBenchConfig) -> float:
    """The share of first-turn prompt prefill group sharing must save: ``(n - 1) / n``."""
    return (config.samples - 1) / config.samples


async def measure(config: AppOptBenchConfig, opt: str, say: Callable[[str], None]) -> str:
    """The result line of ``opt``: ``config.pairs`` alternating runs with and without."""

    async def side(i: int, on: bool) -> Side:
        s = await run_side(config, tool_cache=on, opt=opt, on=on)
        what = "with" if on else "without"
        say(f"{opt} pair {i + 1}/{config.pairs}: {what} {s.episodes_per_s:.1f} episodes/s")
        return s

    sides = await alternate_async(lambda i: side(i, True), lambda i: side(i, False), config.pairs)
    ratio = paired_ratio([(a.episodes_per_s, b.episodes_per_s) for a, b in sides])
    ok, why = verdict(*sides[-1], opt=opt)
    mid = len(sides) // 2
    saved = ""
    if opt == "group_prefix_sharing":

        def saved_share(s: Side) -> float:
            return 1 - s.prompt_computed / max(1, s.prompt_tokens)

        with_ = sorted(saved_share(a) for a, _ in sides)[mid]
        without = sorted(saved_share(b) for _, b in sides)[mid]
        target = prefill_target(config)
        ok = ok and with_ >= target
        saved = (
            f" prefill_saved={with_:.3f} prefill_saved_without={without:.3f} target={target:.3f}"
        )
    hits = sorted(a.hits for a, _ in sides)[mid]
    tokens_saved = sorted(a.shared_tokens for a, _ in sides)[mid]
    if opt == "early_group_cutoff":  # tokens the cut stragglers did not generate
        tokens_saved = sorted(b.generated - a.generated for a, b in sides)[mid]
    eps_with = sorted(a.episodes_per_s for a, _ in sides)[mid]
    eps_without = sorted(b.episodes_per_s for _, b in sides)[mid]
    last = sides[-1][1]
    return (
        f"opt={opt} speedup={ratio.ratio:.2f} tokens_saved={tokens_saved} hits={hits} "
        f"verdict={'pass' if ok else 'fail'} ratio_min={ratio.ratio_min:.2f} "
        f"ratio_max={ratio.ratio_max:.2f} pairs={ratio.pairs} "
        f"episodes={len(last.trajectories)} tool_calls={last.calls} "
        f"with_eps={eps_with:.1f} without_eps={eps_without:.1f} {why}{saved}"
    )


# -- command line --------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--env",
        default="code_fix",
        help=f"one of {', '.join(ENVS)} ({', '.join(MODEL_ENVS)} for group_prefix_sharing alone)",
    )
    parser.add_argument("--episodes", type=int, default=256, help="episodes per side per pair")
    parser.add_argument("--samples", type=int, default=8, help="samples per task (group size)")
    parser.add_argument("--concurrency", type=int, default=8, help="episodes in flight")
    parser.add_argument("--pairs", type=int, default=DEFAULT_PAIRS, help="with/without pairs")
    parser.add_argument(
        "--opt",
        action="append",
        default=None,
        help=f"an optimisation to measure (repeatable; default: all built: {', '.join(BUILT)})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def main(args: argparse.Namespace) -> int:
    """CLI entry: one result line per optimisation."""
    config = AppOptBenchConfig(
        env=args.env,
        episodes=args.episodes,
        samples=args.samples,
        concurrency=args.concurrency,
        pairs=args.pairs,
        opts=tuple(args.opt or BUILT),
        seed=args.seed,
    )

    def say(text: str) -> None:
        if not args.quiet:
            print(f"bench appopt: {text}", file=sys.stderr, flush=True)

    if NOT_BUILT:
        say(f"not built yet, so not measured: {', '.join(NOT_BUILT)}")
    for opt in config.opts:
        print(asyncio.run(measure(config, opt, say)), flush=True)
    return 0


__all__ = ["AppOptBenchConfig", "add_arguments", "code_fix_agent", "main", "measure", "verdict"]
