"""Episode checkpoints: everything an in-flight episode needs to continue elsewhere.

Invariants: a checkpoint is taken only at a quiescent point and its directory is written
atomically; every file is framed and checksummed, and a file that fails any check is
refused with a ``CheckpointError`` naming it, nothing of it used; a restored episode
finishes with the same trajectory an uninterrupted one would (seeded, weights unchanged).
"""

from __future__ import annotations

import asyncio
import struct
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np
import xxhash

from agentroll._fs import atomic_dir, atomic_file
from agentroll.backends.base import SamplingParams
from agentroll.errors import CheckpointError
from agentroll.rollout.builder import TrajectoryBuilder
from agentroll.types import (
    Fork,
    Message,
    Status,
    Task,
    Trajectory,
    Turn,
    decode_msgpack,
    encode_msgpack,
)

if TYPE_CHECKING:
    from agentroll.env import Environment, EpisodeState
    from agentroll.sandbox.base import Sandbox

Phase = Literal["start", "turn", "generating", "tools", "scoring", "done"]
FORMAT = 2  # of EpisodeCheckpoint; 2: framed files, job.msgpack, checksums of the files beside
FRAME_VERSION = 1
_MAGIC = b"AGRLCKPT"
_HEAD = struct.Struct("<8s4sHQ")  # magic, kind, frame version, payload length
_DIGEST = 16  # bytes of xxh3-128 (of head and payload), between the head and the payload
# the kinds of record a frame holds: a file renamed into another's place is refused too
_EPISODE, _JOB, _JOBS, _FINISHED = b"EPIS", b"EJOB", b"JOBS", b"DONE"
EPISODE_FILE, JOB_FILE, SANDBOX_FILE = "episode.msgpack", "job.msgpack", "sandbox.tar"
_RESTART = "nothing of it is used; a resuming worker or service restarts this episode from its task"
_STOPPED = "nothing of it is used; the stopped run cannot continue without it"


def frame(kind: bytes, payload: bytes) -> bytes:
    """``payload`` behind the checkpoint header.

    The header is magic, kind, frame version and payload length, followed by the xxh3-128 of
    header and payload.  Every checkpoint file (``episode.msgpack``, ``job.msgpack``,
    ``unstarted.msgpack``, ``finished.msgpack``) is framed, and ``episode.msgpack`` holds the
    xxh3-128 of every file beside it (``sandbox.tar``, ``request/``).
    """
    head = _HEAD.pack(_MAGIC, kind, FRAME_VERSION, len(payload))
    digest = xxhash.xxh3_128(head)
    digest.update(payload)
    return head + digest.digest() + payload


def unframe(kind: bytes, data: bytes) -> bytes:
    """The payload ``frame(kind, payload)`` wrapped; ``ValueError`` saying which check
    failed (no header, another kind or version, wrong length, checksum mismatch)."""
    start = _HEAD.size + _DIGEST
    if not data:
        raise ValueError("it is empty (truncated)")
    if data[: len(_MAGIC)] != _MAGIC[: len(data)]:
        raise ValueError("it has no checkpoint header (written by an older agentroll, or damaged)")
    if len(data) < start:
        raise ValueError(f"it has {len(data)} bytes, fewer than its {start}-byte header")
    _, got, version, length = _HEAD.unpack_from(data)
    if version != FRAME_VERSION:
        raise ValueError(f"its frame version is {version}; this agentroll reads {FRAME_VERSION}")
    if got != kind:
        raise ValueError(f"it holds a {got!r} record where a {kind!r} one belongs")
    if len(data) - start != length:
        raise ValueError(
            f"it has {len(data) - start} payload bytes where its header says {length} "
            "(truncated or appended to)"
        )
    view = memoryview(data)
    digest = xxhash.xxh3_128(view[: _HEAD.size])
    digest.update(view[start:])
    if digest.digest() != data[_HEAD.size : start]:
        raise ValueError("its xxh3-128 checksum does not match (its bytes changed after writing)")
    return data[start:]


def _refused(path: Path, problem: str, consequence: str = _RESTART) -> CheckpointError:
    return CheckpointError(path, f"checkpoint file {path} is refused: {problem}; {consequence}")


def _read_record(path: Path, kind: bytes, typ: Any, consequence: str) -> Any:
    """The ``typ`` record framed in ``path``; ``CheckpointError`` naming it otherwise."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _refused(path, f"it cannot be read ({exc})", consequence) from exc
    try:
        return decode_msgpack(unframe(kind, data), typ)
    except (msgspec.MsgspecError, ValueError) as exc:
        raise _refused(path, str(exc), consequence) from exc


def _file_digest(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


class EpisodeRun:
    """Mutable state of one running episode (owned by its task in the rollout engine)."""

    __slots__ = (
        "builder",
        "cut_timer",
        "earlier",
        "env",
        "forks",
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
        # expires to stop the episode as a straggler of a decided group (not paused: a
        # pause freezes the episode's own timeout, never this one)
        self.cut_timer: asyncio.Timeout | None = None
        self.restarted_turns = 0  # generations regenerated because no snapshot was usable
        # samples before the current one (a template rewrote history: the episode forked)
        self.earlier: list[Trajectory] = []
        self.forks: list[Fork] = []  # how the current sample began, when it is not the first

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
    """The serialisable form of an ``EpisodeRun``.

    ``EpisodeRun`` is the live state of one episode inside the rollout engine (task, seeds,
    environment copy, trajectory so far, the generation in flight); this is its on-disk form.
    The per-token arrays, turns and messages are restored exactly, and the sampler needs no
    state beyond the seed and the token count.
    """

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
    earlier: list[Trajectory] = []  # samples the episode forked away from, finished
    forks: list[Fork] = []  # how the current sample began

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

    def job(self) -> EpisodeJob:
        """The sample this episode runs, to restart it under its id (``scan_checkpoints``)."""
        return EpisodeJob(
            task=self.task,
            sample_index=self.sample_index,
            group_id=self.group_id,
            episode_id=self.episode_id,
        )

    def save(self, path: str | Path) -> Path:
        """Write ``path/`` atomically: ``episode.msgpack`` and ``job.msgpack`` (framed),
        ``sandbox.tar`` when the episode has a sandbox, ``request/`` when a generation is
        pending; ``episode.msgpack`` holds the xxh3-128 of the last two."""
        meta = msgspec.structs.replace(self, sandbox=None, pending=None)
        with atomic_dir(path) as tmp:
            files: dict[str, str] = {}
            if self.sandbox is not None:
                (tmp / SANDBOX_FILE).write_bytes(self.sandbox)
                files[SANDBOX_FILE] = xxhash.xxh3_128_hexdigest(self.sandbox)
            if self.pending is not None:
                self.pending.save(tmp / "request")
                for f in sorted((tmp / "request").rglob("*")):
                    if f.is_file():
                        files[f.relative_to(tmp).as_posix()] = _file_digest(f)
            (tmp / JOB_FILE).write_bytes(frame(_JOB, encode_msgpack(self.job())))
            stored = _Stored(checkpoint=meta, files=files)
            (tmp / EPISODE_FILE).write_bytes(frame(_EPISODE, encode_msgpack(stored)))
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> EpisodeCheckpoint:
        """Read a checkpoint directory, verifying every file's checksum; raises
        ``CheckpointError`` naming the first file that is missing, corrupt, truncated or
        unframed (nothing of the checkpoint is used then)."""
        p = Path(path)
        stored: _Stored = _read_record(p / EPISODE_FILE, _EPISODE, _Stored, _RESTART)
        cp = stored.checkpoint
        if cp.format != FORMAT:
            raise _refused(p / EPISODE_FILE, f"it has format {cp.format}; expected {FORMAT}")
        if _read_record(p / JOB_FILE, _JOB, EpisodeJob, _RESTART) != cp.job():
            raise _refused(p / JOB_FILE, f"it names another sample than {EPISODE_FILE}")
        for rel, digest in stored.files.items():
            file = p / rel
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise _refused(p / EPISODE_FILE, f"it lists a file outside {p}: {rel!r}")
            try:
                data = file.read_bytes() if rel == SANDBOX_FILE else None
                got = xxhash.xxh3_128_hexdigest(data) if data is not None else _file_digest(file)
            except OSError as exc:
                raise _refused(file, f"it cannot be read ({exc})") from exc
            if got != digest:
                raise _refused(file, "its xxh3-128 checksum does not match the one recorded")
            if data is not None:
                cp.sandbox = data
        if any(rel.startswith("request/") for rel in stored.files):
            from agentroll.engine.snapshot import RequestSnapshot  # torch: only when needed

            try:
                cp.pending = RequestSnapshot.load(p / "request")
            except ValueError as exc:
                raise _refused(p / "request", str(exc)) from exc
        elif cp.phase == "generating":
            raise _refused(p / EPISODE_FILE, "it is mid-generation but lists no request/")
        try:
            cp.builder()  # validates the arrays
        except ValueError as exc:
            raise _refused(p / EPISODE_FILE, str(exc)) from exc
        return cp


class _Stored(msgspec.Struct, kw_only=True):
    """The payload of ``episode.msgpack``: the checkpoint without its blobs, and the
    xxh3-128 (hex) of each file beside it by its path relative to the directory."""

    checkpoint: EpisodeCheckpoint
    files: dict[str, str] = {}


class EpisodeJob(msgspec.Struct, kw_only=True, frozen=True):
    """A sample of an admitted group that has no episode to continue: it never started (no
    worker was free yet) or started after the stop's checkpoint and was cancelled with it.
    The next run starts it afresh (same seed: ``task.id`` and ``sample_index``), without
    admission, so that its group is completed rather than left waiting for it forever.
    ``episode_id`` is set when the sample restarts an episode whose checkpoint was refused:
    the episode keeps that id (its checkpoint directory's name) and counts the restart in
    ``restarted_turns``."""

    task: Task
    sample_index: int
    group_id: str
    episode_id: str = ""


@dataclass(frozen=True)
class CorruptCheckpoint:
    """A checkpoint directory ``scan_checkpoints`` refused: ``error`` names the file and
    why; ``job`` is the sample to restart from its task (``episode_id`` is the directory's
    name), or None when neither ``job.msgpack`` nor ``episode.msgpack`` is intact."""

    path: Path
    error: CheckpointError
    job: EpisodeJob | None


def save_jobs(path: str | Path, jobs: list[EpisodeJob]) -> None:
    """Write ``jobs`` to ``path`` (framed) atomically and durably."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(frame(_JOBS, encode_msgpack(jobs)))


def load_jobs(path: str | Path) -> list[EpisodeJob]:
    """The jobs ``save_jobs`` wrote; ``CheckpointError`` naming the file when it is
    unreadable, corrupt, truncated or unframed."""
    jobs: list[EpisodeJob] = _read_record(Path(path), _JOBS, list[EpisodeJob], _STOPPED)
    return jobs


def save_finished(path: str | Path, trajectories: list[Trajectory]) -> None:
    """Write the finished ``trajectories`` a stop holds to ``path`` (framed), atomically
    and durably."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(frame(_FINISHED, encode_msgpack(trajectories)))


def load_finished(path: str | Path) -> list[Trajectory]:
    """The trajectories ``save_finished`` wrote; ``CheckpointError`` naming the file when
    it is unreadable, corrupt, truncated or unframed."""
    trajs: list[Trajectory] = _read_record(Path(path), _FINISHED, list[Trajectory], _STOPPED)
    return trajs


def _restart_job(path: Path) -> EpisodeJob | None:
    """The sample of the refused checkpoint ``path``: from ``job.msgpack``, else from an
    intact ``episode.msgpack`` (another file was the damaged one); None when neither is."""
    job: EpisodeJob
    try:
        job = _read_record(path / JOB_FILE, _JOB, EpisodeJob, "")
    except CheckpointError:
        try:
            job = _read_record(path / EPISODE_FILE, _EPISODE, _Stored, "").checkpoint.job()
        except CheckpointError:
            return None
    return msgspec.structs.replace(job, episode_id=path.name)


def scan_checkpoints(
    directory: str | Path,
) -> tuple[list[EpisodeCheckpoint], list[CorruptCheckpoint]]:
    """Every episode checkpoint under ``directory`` (temp leftovers ignored), ordered by
    episode id: those that load, and those refused (``CorruptCheckpoint``: the file, why,
    and the sample to restart).  Reads only; the caller decides what to remove.

    A file that fails any check (unframed files included) is refused: nothing of it is used,
    and the ``CorruptCheckpoint`` tells the caller which sample to restart from its task
    instead (``job.msgpack``).
    """
    d = Path(directory)
    good: list[EpisodeCheckpoint] = []
    bad: list[CorruptCheckpoint] = []
    if not d.is_dir():
        return good, bad
    for p in sorted(d.iterdir()):
        if not p.is_dir() or p.name.startswith("."):
            continue
        if not ((p / EPISODE_FILE).exists() or (p / JOB_FILE).exists()):
            continue
        try:
            good.append(EpisodeCheckpoint.load(p))
        except CheckpointError as exc:
            bad.append(CorruptCheckpoint(p, exc, _restart_job(p)))
    return good, bad


def load_checkpoints(directory: str | Path) -> list[EpisodeCheckpoint]:
    """Every episode checkpoint under ``directory`` (temp leftovers ignored), ordered by
    episode id; raises the ``CheckpointError`` of the first one refused."""
    good, bad = scan_checkpoints(directory)
    if bad:
        raise bad[0].error
    return good


def make_checkpoint(
    run: EpisodeRun, *, sandbox_blob: bytes | None, pending: Any
) -> EpisodeCheckpoint:
    """The checkpoint of ``run`` at a quiescent point.

    A quiescent point is the turn gate (``phase == "turn"``: the next turn has not started; tool
    results of the last turn are in) or a generation paused in the backend (``phase ==
    "generating"``: ``pending`` holds the request's tokens so far, its sampler seed and
    optionally its KV blocks).  The directory is written atomically (temp directory + rename).
    """
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
        earlier=list(run.earlier),
        forks=list(run.forks),
    )


__all__ = [
    "CorruptCheckpoint",
    "EpisodeCheckpoint",
    "EpisodeJob",
    "EpisodeRun",
    "load_checkpoints",
    "load_finished",
    "load_jobs",
    "make_checkpoint",
    "save_finished",
    "save_jobs",
    "scan_checkpoints",
]
