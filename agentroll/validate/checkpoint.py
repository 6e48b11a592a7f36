"""The ``episode_checkpoint_parity`` check: episodes killed mid-generation and mid-tool-call
finish in a new process exactly as uninterrupted runs do (seeded, weights unchanged).
Invariant: the signal moment is chosen from the reference (>= ``MARGIN`` tokens still to
come), so machine load cannot change the outcome.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from agentroll.backends.base import (
    GenerationChunk,
    GenerationRequest,
    ResumePolicy,
    SamplingParams,
)
from agentroll.backends.torch import TorchBackend
from agentroll.chat import TOOL_PARSERS, ParsedOutput
from agentroll.env import Environment, EpisodeState
from agentroll.rollout.engine import RolloutConfig
from agentroll.sandbox.base import Sandbox, SandboxConfig
from agentroll.tool import tool
from agentroll.types import Message, Task, ToolCall, Trajectory
from agentroll.validate.common import CheckResult

PARSER = "every-turn"
# a stop set of 23 of the tiny model's 1024 ids: turns of ~45 tokens, most ending in "stop"
STOP_IDS = tuple(range(100, 1000, 40))
MIN_TOKENS, MARGIN = 3, 16  # signal after >= MIN_TOKENS of a turn with >= MARGIN still to come
HOLD_LIMIT = 30.0  # seconds a held tool call waits for the pause at most
WORKER_TIMEOUT = 300.0  # seconds each worker process may take
PROBE_MAX_TOKENS = 64
#: where a fitted stop set ends the first turns (sampled tokens): long enough to be
#: signalled in the middle of, short enough to end in "stop"
FIT_WINDOW = (MIN_TOKENS + MARGIN + 4, PROBE_MAX_TOKENS - 8)
_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF


class EveryTurnCalls:
    """A tool parser that reads every assistant turn as one call of ``work``: the tiny random
    model cannot write tool-call syntax, yet the check needs real tool calls."""

    def parse(self, text: str, *, call_id_prefix: str = "call") -> ParsedOutput:
        call = ToolCall(id=f"{call_id_prefix}_0", name="work", arguments={"n": len(text) % 10})
        return ParsedOutput(content=text.strip(), tool_calls=[call], errors=[])


def probe_config(
    *, concurrency: int = 3, seed: int = 0, stop_ids: tuple[int, ...] = STOP_IDS
) -> RolloutConfig:
    """The rollout settings of the check (registers the ``every-turn`` tool parser);
    ``stop_ids`` end a turn (``probe_stop_ids`` fits them to a model)."""
    TOOL_PARSERS.setdefault(PARSER, EveryTurnCalls())
    return RolloutConfig(
        concurrency=concurrency,
        seed=seed,
        progress="off",
        tool_parser=PARSER,
        # EOS ignored: a trained model would end its turns early, and the check needs
        # turns long enough to be signalled in the middle of
        sampling=SamplingParams(
            temperature=1.0, max_tokens=PROBE_MAX_TOKENS, stop_token_ids=stop_ids, ignore_eos=True
        ),
    )


class CheckpointProbe(Environment):
    """Every turn calls ``work``, which appends a line to ``log.txt`` in the sandbox and
    counts its calls in per-episode state; the reward is the log's line count.  With
    ``hold`` set, the first call of the run awaits ``hold()`` before returning."""

    name = "checkpoint_probe"
    max_turns = 4
    sandbox_config = SandboxConfig(use_bwrap=False)  # only files: no command runs

    def __init__(
        self, num_tasks: int = 4, hold: Callable[[], Awaitable[Any]] | None = None
    ) -> None:
        self.num_tasks = num_tasks
        self.hold = hold
        self.held: list[str] = []  # episodes whose call was held (shared by every copy)
        self.calls = 0

    def tasks(self) -> list[Task]:
        return [
            Task(id=f"probe-{i}", data={"prompt": f"Count to {i + 3}."})
            for i in range(self.num_tasks)
        ]

    async def reset(self, task: Task, *, seed: int) -> list[Message]:
        self.calls = 0
        return await super().reset(task, seed=seed)

    @tool
    async def work(self, n: int, sandbox: Sandbox, state: EpisodeState) -> str:
        """Record one step.

        Args:
            n: any number.
        """
        self.calls += 1
        try:
            log = (await sandbox.read_file("log.txt")).decode()
        except FileNotFoundError:
            log = ""
        log += f"{state.turn}:{n}\n"
        await sandbox.write_file("log.txt", log)
        if self.hold is not None and not self.held:
            self.held.append(state.episode_id)
            async with asyncio.timeout(HOLD_LIMIT):
                await self.hold()
        return f"step {self.calls}: {len(log.splitlines())} lines"

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = int(state["calls"])

    async def reward(self, trajectory: Trajectory, state: EpisodeState) -> float:
        assert state.sandbox is not None
        try:
            log = await state.sandbox.read_file("log.txt")
        except FileNotFoundError:  # the first turn ran out of tokens: no call was made
            return 0.0
        return float(len(log.decode().splitlines()))


class ProbeBackend(TorchBackend):
    """A ``TorchBackend`` that awaits ``on_chunk(request, tokens_so_far)`` after each chunk
    of a fresh generation has been taken by its consumer, and sets ``paused_event`` (when
    given) once paused."""

    on_chunk: Callable[[GenerationRequest, int], Awaitable[None]] | None = None
    paused_event: asyncio.Event | None = None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        n = 0
        async for chunk in super().generate(request):
            n += len(chunk.token_ids) - chunk.rollback
            yield chunk
            if self.on_chunk is not None:
                await self.on_chunk(request, n)

    async def pause(self, policy: ResumePolicy = "keep") -> None:
        await super().pause(policy)
        if self.paused_event is not None:
            self.paused_event.set()


def fit_stop_ids(
    sequences: list[list[int]], window: tuple[int, int] = FIT_WINDOW
) -> tuple[int, ...]:
    """A stop set under which each of ``sequences`` (a model's first turns sampled with no
    stop set, the same seeds) would end inside ``window``: ids never sampled before the
    window's start in any of them, one per sequence from its window, where there is one.
    Seeded sampling makes a turn identical up to its first stop id, so the fit is exact
    for those turns; later turns, in other contexts, end about as often."""
    lo, hi = window
    early = {t for seq in sequences for t in seq[:lo]}
    chosen: list[int] = []
    for seq in sequences:
        if any(t in chosen for t in seq[lo:hi]):
            continue
        pick = next((t for t in seq[lo:hi] if t not in early), None)
        if pick is not None:
            chosen.append(pick)
    # a sequence with no stop yet would end on the token budget (the episode then ends):
    # give it the latest id that stops no long turn early
    long_early = {t for seq in sequences if _first(seq, chosen) >= lo for t in seq[:lo]}
    for seq in sequences:
        if _first(seq, chosen) < len(seq):
            continue
        pick = next((t for t in reversed(seq[:hi]) if t not in long_early), None)
        if pick is not None:
            chosen.append(pick)
    return tuple(sorted(set(chosen)))


def _first(seq: list[int], stops: list[int]) -> int:
    """Where ``seq`` first samples one of ``stops`` (its length when it never does)."""
    return next((i for i, t in enumerate(seq) if t in stops), len(seq))


async def probe_stop_ids(model: Path, device: str = "cpu") -> tuple[int, ...]:
    """``STOP_IDS`` where they give the model's probe turns long enough to pause in the
    middle of (a random model's turns are ~45 tokens); else a stop set fitted to the model
    (a trained model samples a few ids often and ends early on the fixed set)."""
    from agentroll.rollout.engine import RolloutEngine

    async def first_turns(stop_ids: tuple[int, ...]) -> list[list[int]]:
        backend = ProbeBackend(model, batch_invariant=True, device=device)
        config = probe_config(stop_ids=stop_ids)
        async with backend, RolloutEngine(backend, CheckpointProbe(), config) as engine:
            out = [t async for t in engine.run()]
        return [
            t.token_ids[t.turns[0].gen_start : t.turns[0].gen_end].tolist() for t in out if t.turns
        ]

    fixed = await first_turns(STOP_IDS)
    if sum(len(s) >= FIT_WINDOW[0] for s in fixed) * 2 >= len(fixed):
        return STOP_IDS
    return fit_stop_ids(await first_turns(()))


def turn_lengths(trajectories: list[Trajectory]) -> dict[int, int]:
    """Sampled tokens of every turn, keyed by the turn's sampling seed (unique per turn)."""
    return {
        (t.seed + turn.index) & _SEED_MASK: turn.gen_end - turn.gen_start
        for t in trajectories
        for turn in t.turns
    }


def is_mid_generation(lengths: dict[int, int], request: GenerationRequest, n: int) -> bool:
    """Whether ``request`` has ``n >= MIN_TOKENS`` tokens and, by the reference, at least
    ``MARGIN`` more to come: a pause soon after finds it still generating."""
    seed = request.sampling.seed
    return seed is not None and n >= MIN_TOKENS and lengths.get(seed, 0) - n >= MARGIN


def same_trajectory(a: Trajectory, b: Trajectory) -> bool:
    """Equal in everything a trainer reads (timings aside)."""
    import numpy as np

    def turns(t: Trajectory) -> list[Any]:
        return [
            (
                u.index,
                u.gen_start,
                u.gen_end,
                u.env_end,
                u.finish_reason,
                u.text,
                u.tool_calls,
                [(r.call_id, r.name, r.content, r.error) for r in u.tool_results],
            )
            for u in t.turns
        ]

    return (
        a.task_id == b.task_id
        and a.seed == b.seed
        and (a.status, a.stop_reason, a.error) == (b.status, b.stop_reason, b.error)
        and (a.reward, a.rewards, a.prompt_len) == (b.reward, b.rewards, b.prompt_len)
        and all(
            np.array_equal(getattr(a, f), getattr(b, f), equal_nan=f == "logprobs")
            for f in ("token_ids", "logprobs", "loss_mask", "policy_version", "kv_version")
        )
        and a.messages == b.messages
        and turns(a) == turns(b)
    )


# -- the worker processes ----------------------------------------------------------------------


def _worker_process(mode: str, model: str, device: str, workdir: str) -> int:
    """``first``: run until a generation is mid-way while a tool call is held, then SIGTERM
    this process; ``resume``: continue from the checkpoints.  Prints the worker's line."""
    from agentroll.run.worker import run_worker_sync

    work = Path(workdir)
    backend = ProbeBackend(model, batch_invariant=True, device=device)
    env = CheckpointProbe()
    stop_ids = tuple(json.loads((work / "stop_ids.json").read_text()))
    if mode == "first":
        lengths = {int(k): v for k, v in json.loads((work / "lengths.json").read_text()).items()}
        fired = False

        paused = backend.paused_event = asyncio.Event()

        async def on_chunk(request: GenerationRequest, n: int) -> None:
            nonlocal fired
            if not fired and env.held and is_mid_generation(lengths, request, n):
                fired = True
                os.kill(os.getpid(), signal.SIGTERM)

        env.hold, backend.on_chunk = paused.wait, on_chunk
    result = run_worker_sync(
        env,
        backend,
        out=work / "out.jsonl",
        checkpoint_dir=work / "checkpoints",
        config=probe_config(stop_ids=stop_ids),
    )
    (work / f"{mode}.json").write_text(json.dumps({"held": env.held, "line": result.line()}))
    print(result.line(), flush=True)
    return 0


async def _reference(
    model: Path, device: str, workdir: Path, stop_ids: tuple[int, ...]
) -> list[Trajectory]:
    from agentroll.run.worker import read_trajectories, run_worker

    await run_worker(
        CheckpointProbe(),
        ProbeBackend(model, batch_invariant=True, device=device),
        out=workdir / "reference.jsonl",
        checkpoint_dir=workdir / "reference-checkpoints",
        config=probe_config(stop_ids=stop_ids),
        stop_signals=(),
    )
    return read_trajectories(workdir / "reference.jsonl")


def check_episode_checkpoint_parity(model: Path, device: str = "cpu") -> CheckResult:
    """Kill a worker (SIGTERM) while one episode is mid-generation and one mid-tool-call,
    continue in a new process, and compare with an uninterrupted run.

    A reference run here, a worker process that SIGTERMs itself while one episode is
    generating and another's tool call is held open, a second process continuing from the
    checkpoints; trajectories compared.
    """
    from agentroll.rollout.checkpoint import load_checkpoints
    from agentroll.run.worker import read_trajectories

    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="agentroll-cp-check-") as tmp:
        work = Path(tmp)
        stop_ids = asyncio.run(probe_stop_ids(model, device))
        (work / "stop_ids.json").write_text(json.dumps(list(stop_ids)))
        reference = asyncio.run(_reference(model, device, work, stop_ids))
        (work / "lengths.json").write_text(json.dumps(turn_lengths(reference)))
        cmd = [sys.executable, "-m", "agentroll.validate.checkpoint"]

        def worker(mode: str) -> subprocess.CompletedProcess[str]:
            try:
                return subprocess.run(
                    [*cmd, mode, str(model), device, tmp],
                    capture_output=True,
                    text=True,
                    timeout=WORKER_TIMEOUT,
                )
            except subprocess.TimeoutExpired as exc:
                return subprocess.CompletedProcess(
                    exc.cmd, 124, "", f"timed out after {exc.timeout}s"
                )

        first = worker("first")
        held = (
            json.loads((work / "first.json").read_text())["held"] if first.returncode == 0 else []
        )
        try:
            checkpoints = load_checkpoints(work / "checkpoints")
        except ValueError as exc:
            checkpoints, figures["load_error"] = [], json.dumps(str(exc))
        mid_gen = sum(
            cp.phase == "generating" and len(cp.builder()) > cp.gen_start for cp in checkpoints
        )
        # the held call finished during the pause: its result is in the checkpoint
        mid_tool = sum(
            cp.phase == "turn" and cp.episode_id in held and bool(cp.turns[-1].tool_results)
            for cp in checkpoints
        )
        second = worker("resume")
        got = read_trajectories(work / "out.jsonl") if second.returncode == 0 else []
        by_task = {t.task_id: t for t in reference}
        identical = sum(same_trajectory(by_task[t.task_id], t) for t in got if t.task_id in by_task)
        cp_dir = work / "checkpoints"
        left = [p.name for p in cp_dir.iterdir()] if cp_dir.exists() else []
        figures |= {
            "stop_set": "fixed" if stop_ids == STOP_IDS else f"fitted({len(stop_ids)})",
            "episodes": len(reference),
            "checkpointed": len(checkpoints),
            "mid_generation": mid_gen,
            "mid_tool_call": mid_tool,
            "identical": f"{identical}/{len(reference)}",
            "written": len(got),
            "checkpoints_left": len(left),
        }
        for name, proc in (("first", first), ("resume", second)):
            if proc.returncode != 0:
                figures[f"{name}_error"] = json.dumps(proc.stderr.strip().splitlines()[-1:])
    ok = (
        first.returncode == 0
        and second.returncode == 0
        and mid_gen >= 1
        and mid_tool >= 1
        and identical == len(reference) == len(got)
        and not left
    )
    return CheckResult("episode_checkpoint_parity", ok, figures)


if __name__ == "__main__":
    sys.exit(_worker_process(*sys.argv[1:5]))
