"""Episode checkpoints: everything an in-flight episode needs to continue elsewhere.

Role: ``EpisodeRun`` is the live state of one episode inside the rollout engine (task,
seeds, environment copy, trajectory so far, the generation in flight); ``EpisodeCheckpoint``
is its on-disk form; ``EpisodeJob`` is a sample of a started group that has no episode yet
(a stop persists these so the group is completed after the restart).  A checkpoint is taken
only at a quiescent point: at the turn gate (``phase == "turn"``: the next turn has not
started; tool results of the last turn are in) or with the generation paused in the backend
(``phase == "generating"``: ``pending`` holds the request's tokens so far, its sampler seed
and optionally its KV blocks).

Invariants: a checkpoint directory is written atomically (temp directory + rename) and
``load`` refuses a directory it cannot fully read, naming the file; the per-token arrays,
turns and messages are restored exactly, so a restored episode finishes with the same
trajectory an uninterrupted one would (seeded, weights unchanged); the sampler needs no
state beyond the seed and the token count (it is counter-based).
"""

from __future__ import annotations

import time
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np

from agentroll._fs import atomic_dir, atomic_file
from agentroll.backends.base import SamplingParams
from agentroll.trajectory_builder import TrajectoryBuilder
from agentroll.types import Message, Status, Task, Turn

if TYPE_CHECKING:
    from agentroll.env import Environment, EpisodeState
    from agentroll.sandbox.base import Sandbox

Phase = Literal["start", "turn", "generating", "tools", "scoring", "done"]
FORMAT = 1


class EpisodeRun:
    """Mutable state of one running episode (owned by its task in the rollout engine)."""

    __slots__ = (
        "builder",
        "env",
        "format_errors",
        "gen_start",
        "group_id",
        "messages",
        "next_turn",
        "pending",
        "phase",
        "prompt_len",
        "request_id",
        "restarted_turns",
        "sampling",
        "sandbox",
        "started",
        "state",
        "status",
        "stop_reason",
        "turns",
    )

    def __init__(self, env: Environment, state: EpisodeState, group_id: str, started: float):
        self.env = env
        self.state = state
        self.group_id = group_id
        self.started = started
        self.builder = TrajectoryBuilder()
        self.turns: list[Turn] = []
        self.messages: list[Message] = []
        self.status: Status = "ok"
        self.stop_reason = ""
        self.prompt_len = 0
        self.format_errors = 0
        self.next_turn = 0
        self.phase: Phase = "start"
        self.sandbox: Sandbox | None = None
        self.request_id = ""  # of the generation in flight (phase "generating")
        self.gen_start = 0
        self.sampling: SamplingParams | None = None
        self.pending: Any = None  # a RequestSnapshot to continue from (restored episodes)
        self.restarted_turns = 0  # generations regenerated because no snapshot was usable

    @property
    def episode_id(self) -> str:
        return self.state.episode_id

    def min_versions(self) -> tuple[int | None, int | None]:
        """Oldest policy and KV versions over the sampled tokens (None when none)."""
        b = self.builder
        if not len(b):
            return None, None
        sampled = np.frombuffer(b.mask, dtype=np.uint8) == 1
        if not sampled.any():
            return None, None
        pol = np.frombuffer(b.policy, dtype=np.int32)[sampled]
        kv = np.frombuffer(b.kv, dtype=np.int32)[sampled]
        return int(pol.min()), int(kv.min())


class EpisodeCheckpoint(msgspec.Struct, kw_only=True):
    """The serialisable form of an ``EpisodeRun`` (see the module docstring)."""

    format: int = FORMAT
    task: Task
    episode_id: str
    group_id: str
    sample_index: int
    seed: int
    env_name: str
    env_version: str
    env_state: dict[str, Any] = {}
    state_data: dict[str, Any] = {}
    phase: Literal["turn", "generating"]
    next_turn: int
    format_errors: int = 0
    prompt_len: int
    started_at: float
    token_ids: bytes
    logprobs: bytes
    loss_mask: bytes
    policy_version: bytes
    kv_version: bytes
    turns: list[Turn] = []
    messages: list[Message] = []
    request_id: str = ""
    gen_start: int = 0
    sampling: SamplingParams | None = None
    created_at: float = 0.0
    restarted_turns: int = 0  # generations the episode regenerated before this checkpoint
    # the generation in flight could not be snapshotted (the backend has no ``snapshot``):
    # its partial turn was dropped and the restored episode regenerates it
    dropped_generation: bool = False
    sandbox: bytes | None = None  # stored as sandbox.tar next to episode.msgpack
    pending: Any = None  # RequestSnapshot, stored under request/

    def builder(self) -> TrajectoryBuilder:
        b = TrajectoryBuilder()
        b.token_ids = array("i", self.token_ids)
        b.logprobs = array("f", self.logprobs)
        b.mask = array("B", self.loss_mask)
        b.policy = array("i", self.policy_version)
        b.kv = array("i", self.kv_version)
        n = len(b.token_ids)
        if any(len(a) != n for a in (b.logprobs, b.mask, b.policy, b.kv)):
            raise ValueError(f"checkpoint of episode {self.episode_id} has ragged token arrays")
        return b

    def save(self, path: str | Path) -> Path:
        """Write ``path/`` atomically: ``episode.msgpack``, ``sandbox.tar`` when the episode
        has a sandbox, ``request/`` when a generation is pending."""
        meta = msgspec.structs.replace(self, sandbox=None, pending=None)
        with atomic_dir(path) as tmp:
            (tmp / "episode.msgpack").write_bytes(msgspec.msgpack.encode(meta))
            if self.sandbox is not None:
                (tmp / "sandbox.tar").write_bytes(self.sandbox)
            if self.pending is not None:
                self.pending.save(tmp / "request")
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> EpisodeCheckpoint:
        """Read a checkpoint directory; raises ``ValueError`` naming what is unreadable."""
        p = Path(path)
        try:
            cp = msgspec.msgpack.decode((p / "episode.msgpack").read_bytes(), type=cls)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(
                f"episode checkpoint {p} has an unreadable episode.msgpack ({exc}); "
                "it was not written by this agentroll version or is damaged"
            ) from exc
        if cp.format != FORMAT:
            raise ValueError(f"episode checkpoint {p} has format {cp.format}; expected {FORMAT}")
        if (p / "sandbox.tar").exists():
            cp.sandbox = (p / "sandbox.tar").read_bytes()
        if (p / "request").exists():
            from agentroll.engine.engine import RequestSnapshot  # torch: only when needed

            cp.pending = RequestSnapshot.load(p / "request")
        elif cp.phase == "generating":
            raise ValueError(f"episode checkpoint {p} is mid-generation but has no request/")
        cp.builder()  # validates the arrays
        return cp


class EpisodeJob(msgspec.Struct, kw_only=True, frozen=True):
    """A sample of an admitted group that has no episode to continue: it never started (no
    worker was free yet) or started after the stop's checkpoint and was cancelled with it.
    The next run starts it afresh (same seed: ``task.id`` and ``sample_index``), without
    admission, so that its group is completed rather than left waiting for it forever."""

    task: Task
    sample_index: int
    group_id: str


def save_jobs(path: str | Path, jobs: list[EpisodeJob]) -> None:
    """Write ``jobs`` to ``path`` atomically and durably."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(msgspec.msgpack.encode(jobs))


def load_jobs(path: str | Path) -> list[EpisodeJob]:
    """The jobs ``save_jobs`` wrote; ``ValueError`` naming the file when it is unreadable."""
    p = Path(path)
    try:
        return msgspec.msgpack.decode(p.read_bytes(), type=list[EpisodeJob])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(
            f"{p} (the samples a stop left unstarted) is unreadable ({exc}); "
            "it was not written by this agentroll version or is damaged"
        ) from exc


def load_checkpoints(directory: str | Path) -> list[EpisodeCheckpoint]:
    """Every complete episode checkpoint under ``directory`` (temp leftovers ignored),
    ordered by episode id."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return [
        EpisodeCheckpoint.load(p)
        for p in sorted(d.iterdir())
        if p.is_dir() and not p.name.startswith(".") and (p / "episode.msgpack").exists()
    ]


def make_checkpoint(
    run: EpisodeRun, *, sandbox_blob: bytes | None, pending: Any
) -> EpisodeCheckpoint:
    """The checkpoint of ``run`` at a quiescent point (see the module docstring)."""
    if run.phase not in ("turn", "generating"):
        raise ValueError(f"episode {run.episode_id} is not quiescent (phase {run.phase!r})")
    b, st = run.builder, run.state
    if run.phase == "turn" and run.pending is not None:
        # restored mid-generation and checkpointed again before its generation continued:
        # the snapshot it was restored from is still the pending generation
        pending = run.pending
    generating = run.phase == "generating" or pending is not None
    n = len(b)
    dropped = generating and pending is None
    if dropped:  # the backend cannot snapshot: redo the turn
        n = run.gen_start
        generating = False
    return EpisodeCheckpoint(
        task=st.task,
        episode_id=st.episode_id,
        group_id=run.group_id,
        sample_index=st.sample_index,
        seed=st.seed,
        env_name=run.env.name,
        env_version=run.env.version,
        env_state=run.env.state_dict(),
        state_data=dict(st.data),
        phase="generating" if generating else "turn",
        next_turn=run.next_turn,
        format_errors=run.format_errors,
        prompt_len=run.prompt_len,
        started_at=run.started,
        token_ids=b.token_ids[:n].tobytes(),
        logprobs=b.logprobs[:n].tobytes(),
        loss_mask=b.mask[:n].tobytes(),
        policy_version=b.policy[:n].tobytes(),
        kv_version=b.kv[:n].tobytes(),
        turns=list(run.turns),
        messages=list(run.messages),
        request_id=run.request_id if generating else "",
        gen_start=run.gen_start if generating else 0,
        sampling=run.sampling if generating else None,
        created_at=time.time(),
        restarted_turns=run.restarted_turns,
        dropped_generation=dropped,
        sandbox=sandbox_blob,
        pending=pending if generating else None,
    )


__all__ = ["EpisodeCheckpoint", "EpisodeRun", "load_checkpoints", "make_checkpoint"]
