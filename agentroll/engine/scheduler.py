"""Continuous batching: which sequences compute how many tokens in the next model step.
Invariants: a step never exceeds ``max_num_batched_tokens`` tokens or ``max_num_seqs``
sequences; FCFS by arrival (decodes first, then prefill chunks); a PAUSED sequence is never
scheduled and keeps its blocks; KV pressure preempts the latest arrival by recompute, never an
error; a sequence that cannot fit even alone is rejected on its own. Same calls, same schedule.
Group sharing: fresh prompts identical to one being prefilled wait for it and then fork its
KV, sampling their first token from its logits (one prefill per group of samples).
Pure and synchronous: no torch, no asyncio, no I/O.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import attrgetter

from agentroll.engine.block_manager import BlockManager
from agentroll.engine.sequence import FinishReason, Sequence, SequenceStatus
from agentroll.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Static scheduling limits; ``max_model_len`` (optional) is the model's context length."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_blocks: int = 1024
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    enable_group_sharing: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: set it to a positive integer")
        max_len = self.max_model_len
        if max_len is not None and not 1 <= max_len <= self.num_blocks * self.block_size:
            need = -(-max_len // self.block_size)
            raise ConfigError(
                f"max_model_len={max_len}: set it to None or a positive integer that the KV pool "
                f"can hold (num_blocks={self.num_blocks} x block_size={self.block_size}): lower "
                f"it, or raise num_blocks to >= {need}"
            )


@dataclass(slots=True)
class ScheduledSeq:
    """Compute the KV of tokens ``[start, start + num_new_tokens)`` of ``seq`` in this step.
    When ``samples`` is true the chunk ends the sequence: the engine takes the logits of its
    last position and samples one token. A decode (``is_prefill`` false) computes only the
    last sampled token; a prefill computes prompt tokens, or recomputes after preemption."""

    seq: Sequence
    num_new_tokens: int
    is_prefill: bool
    start: int = field(init=False)
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass(slots=True)
class Fork:
    """``seq`` (a fresh prompt equal to ``leader``'s) starts from the KV ``leader``'s prompt
    computes in this step: it shares the full blocks, gets ``copy[1]`` as its copy of the
    partial last block ``copy[0]`` (None: no partial block), and samples its first token
    from ``leader``'s last logits."""

    leader: Sequence
    seq: Sequence
    copy: tuple[int, int] | None


@dataclass(slots=True)
class Rejection:
    """A sequence that can never be scheduled; it is FINISHED and holds no blocks."""

    seq: Sequence
    reason: str


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # back to WAITING, KV dropped
    rejected: list[Rejection] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


_by_arrival = attrgetter("arrival")


class Scheduler:
    """Owns the queues (waiting, running, paused) and the block manager.

    A step: ``out = schedule()``, the model computes ``out.scheduled``, ``postprocess(out,
    sampled)`` before the next ``schedule``. New KV is computed under ``weights_version``.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting: list[Sequence] = []  # arrival order
        self.running: list[Sequence] = []  # arrival order
        self.paused: dict[str, Sequence] = {}
        self.weights_version = 0
        self.num_preemptions = 0
        self._seqs: dict[str, Sequence] = {}  # every unfinished sequence
        self._rejected: list[Rejection] = []  # reported by the next schedule()
        self._next_arrival = 0
        # group sharing: the prompt key of each unfinished sequence, the sequence whose
        # prompt of a key is being prefilled, and the prompt tokens forks did not compute
        self._prompt_key: dict[str, int] = {}
        self._prefilling: dict[int, Sequence] = {}
        self.num_shared_tokens = 0
        self.num_prompt_tokens = 0  # of every sequence added fresh
        self.num_prompt_computed = 0  # of those, tokens prefill steps computed

    def get(self, seq_id: str) -> Sequence:
        """The unfinished sequence ``seq_id``; raises KeyError if there is none."""
        return self._seqs[seq_id]

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    def has_work(self) -> bool:
        """Whether ``schedule`` may return something; paused sequences alone are no work."""
        return bool(self.waiting or self.running or self._rejected)

    def _check_fresh(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence id {seq.seq_id!r} is already in the scheduler")
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"{seq!r} is not a fresh WAITING sequence without blocks")

    def _rejection_reason(self, seq: Sequence) -> str | None:
        cfg = self.config
        if cfg.max_model_len is not None and seq.num_tokens > cfg.max_model_len:
            return (
                f"{seq.num_tokens} tokens exceed the model's context length "
                f"max_model_len={cfg.max_model_len}; shorten the prompt"
            )
        needed = seq.num_blocks_needed(cfg.block_size)
        if needed > cfg.num_blocks:
            return (
                f"{seq.num_tokens} tokens need {needed} KV blocks but the pool has "
                f"num_blocks={cfg.num_blocks}; raise num_blocks or shorten the request"
            )
        if not self._may_chunk(seq) and seq.num_tokens > cfg.max_num_batched_tokens:
            return (
                f"a prompt of {seq.num_tokens} tokens exceeds max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens}; raise it or enable chunked prefill"
            )
        return None

    def add(self, seq: Sequence) -> bool:
        """Queue a fresh sequence (WAITING, no blocks, nothing computed) for prefill under the
        current weights version; assigns ``seq.arrival``. Returns False if it can never run:
        it is then FINISHED (REJECTED) and reported in the next ``SchedulerOutput.rejected``.
        Raises ValueError for a duplicate id or a sequence that is not fresh."""
        self._check_fresh(seq)
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        seq.drop_kv(self.weights_version)
        reason = self._rejection_reason(seq)
        if reason is not None:
            self._finish(seq, FinishReason.REJECTED)
            self._rejected.append(Rejection(seq, reason))
            return False
        self._seqs[seq.seq_id] = seq
        self.num_prompt_tokens += seq.num_prompt_tokens
        if self.config.enable_group_sharing and seq.num_generated == 0:
            self._prompt_key[seq.seq_id] = hash(tuple(seq.token_ids))
        self._enqueue(seq, SequenceStatus.WAITING)
        return True

    def add_with_kv(self, seq: Sequence, num_computed_tokens: int, *, paused: bool = False) -> bool:
        """Admit a restored sequence whose first ``num_computed_tokens`` tokens have KV in a
        snapshot, with its versions: fresh blocks for all its tokens, RUNNING (or PAUSED); the
        caller writes the KV into the first blocks of ``seq.block_table`` before the next step.
        New KV is computed under ``weights_version`` (``keep``). Returns False, changing
        nothing, if the free blocks do not suffice now. Raises ValueError for a bad count, a
        duplicate id, KV newer than the current weights or a sequence that can never fit."""
        self._check_fresh(seq)
        if not 0 < num_computed_tokens < seq.num_tokens:
            raise ValueError(
                f"num_computed_tokens={num_computed_tokens} must be between 1 and "
                f"{seq.num_tokens - 1} (the last token is computed by the next step)"
            )
        if seq.kv_version > self.weights_version:
            raise ValueError(
                f"{seq.seq_id!r}: its KV was computed under weights version {seq.kv_version}, "
                f"newer than the scheduler's {self.weights_version}; load those weights first"
            )
        reason = self._rejection_reason(seq)
        if reason is not None:
            raise ValueError(f"{seq.seq_id!r} can never be scheduled: {reason}")
        if not self.block_manager.can_allocate(seq, use_prefix_cache=False):
            return False
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        self.block_manager.allocate(seq, use_prefix_cache=False)
        seq.kv_version = self.weights_version
        seq.num_computed_tokens = num_computed_tokens
        self.block_manager.mark_computed(seq)
        self._seqs[seq.seq_id] = seq
        self._enqueue(seq, SequenceStatus.PAUSED if paused else SequenceStatus.RUNNING)
        return True

    def schedule(self) -> SchedulerOutput:
        """This step's work, each group in arrival order within the budgets: decodes, then the
        remaining prefill chunks of running sequences, then admissions from the waiting queue."""
        cfg = self.config
        out = SchedulerOutput(rejected=self._rejected)
        self._rejected = []
        budget = cfg.max_num_batched_tokens

        def full() -> bool:
            return budget == 0 or len(out.scheduled) >= cfg.max_num_seqs

        running = SequenceStatus.RUNNING
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for seq in self.running:
            num_new = len(seq.token_ids) - seq.num_computed_tokens
            if num_new == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                decodes.append(seq)
            elif num_new > 0:
                prefills.append(seq)
        # Decodes: one token each.  One whose blocks already hold all its tokens and that is
        # within the context needs no block (the common case, inlined); any other goes
        # through _reserve, which may preempt later arrivals (they are then skipped here by
        # their status) or reject it.
        bs, max_len = cfg.block_size, cfg.max_model_len
        for seq in decodes:
            if full():
                break
            if seq.status is not running:
                continue  # preempted above
            n = len(seq.token_ids)
            if (len(seq.block_table) * bs < n or (max_len is not None and n > max_len)) and (
                not self._reserve(seq, out)
            ):
                continue
            out.scheduled.append(ScheduledSeq(seq, 1, is_prefill=False))
            budget -= 1
        for seq in prefills:
            if full():
                break
            if seq.status is not running:
                continue  # preempted or rejected above
            num_new = seq.num_uncomputed_tokens
            if num_new > budget:
                if not self._may_chunk(seq):
                    continue
                num_new = budget
            if not self._reserve(seq, out):
                continue
            out.scheduled.append(item := ScheduledSeq(seq, num_new, is_prefill=True))
            budget -= num_new
            self._share(item, out)

        index = 0  # the head of the queue, past sequences waiting for a twin's prefill
        while index < len(self.waiting) and not full() and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[index]
            if self._waits_for_twin(seq):
                index += 1
                continue
            reason = self._rejection_reason(seq)
            if reason is not None:
                self._reject(seq, reason, out)
                continue
            num_new = seq.num_tokens - self.block_manager.num_cached_tokens(seq)
            if num_new > budget and not self._may_chunk(seq):
                break  # FCFS: nobody overtakes the head of the queue
            if not self.block_manager.can_allocate(seq):
                break
            self.waiting.pop(index)
            seq.num_computed_tokens = self.block_manager.allocate(seq)
            self._enqueue(seq, SequenceStatus.RUNNING)
            num_new = min(num_new, budget)
            out.scheduled.append(item := ScheduledSeq(seq, num_new, is_prefill=True))
            budget -= num_new
            self._share(item, out)
        return out

    # -- group sharing -------------------------------------------------------------------------

    def _twin_of(self, seq: Sequence, other: Sequence) -> bool:
        """Whether ``other`` is a fresh prompt with ``seq``'s tokens under its kv_version."""
        return (
            other is not seq
            and other.num_generated == 0
            and other.kv_version == seq.kv_version
            and other.token_ids == seq.token_ids
        )

    def _waits_for_twin(self, seq: Sequence) -> bool:
        """A fresh prompt equal to one whose prefill is under way waits to fork its KV."""
        key = self._prompt_key.get(seq.seq_id)
        leader = self._prefilling.get(key) if key is not None else None
        if leader is None:
            return False
        if (
            leader.status is SequenceStatus.RUNNING
            and leader.num_computed_tokens < leader.num_tokens
            and self._twin_of(leader, seq)
            and seq.num_computed_tokens == 0
        ):
            return True
        if leader.status is not SequenceStatus.RUNNING or leader.num_generated:
            del self._prefilling[key]  # type: ignore[arg-type]
        return False

    def _share(self, item: ScheduledSeq, out: SchedulerOutput) -> None:
        """After scheduling a fresh prompt's prefill chunk: if it is the last, fork the
        waiting twins of the prompt onto its KV; else mark it as the prompt's prefill."""
        seq = item.seq
        if seq.num_generated == 0:
            self.num_prompt_computed += item.num_new_tokens
        key = self._prompt_key.get(seq.seq_id)
        if key is None or seq.num_generated or not seq.is_kv_uniform:
            return
        if not item.samples:
            self._prefilling.setdefault(key, seq)
            return
        if self._prefilling.get(key) is seq:
            del self._prefilling[key]
        manager = self.block_manager
        twins = [w for w in self.waiting if self._prompt_key.get(w.seq_id) == key]
        for twin in twins:
            if len(self.running) >= self.config.max_num_seqs or not manager.can_fork(seq):
                break
            if not self._twin_of(seq, twin) or twin.num_computed_tokens:
                continue
            self.waiting.remove(twin)
            copy = manager.fork(seq, twin)
            twin.num_computed_tokens = twin.num_tokens
            self._enqueue(twin, SequenceStatus.RUNNING)
            out.forks.append(Fork(seq, twin, copy))
            self.num_shared_tokens += twin.num_tokens

    def _may_chunk(self, seq: Sequence) -> bool:
        # a recomputation (after preemption or `recompute`) is chunked even when prompts are
        # not: it was admitted once, so pool pressure must never turn into a rejection
        return self.config.enable_chunked_prefill or seq.num_generated > 0

    def _reserve(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Cover all of ``seq``'s tokens with blocks, preempting the latest unscheduled arrivals;
        False if ``seq`` itself was preempted (it waits) or rejected (it cannot fit alone)."""
        reason = self._rejection_reason(seq)
        if reason is not None:
            self._reject(seq, reason, out)
            return False
        while not self.block_manager.can_append(seq):
            # a fork of this step is never a victim: its partial block is copied after it
            scheduled = {item.seq.seq_id for item in out.scheduled}
            scheduled.update(fork.seq.seq_id for fork in out.forks)
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled), seq)
            self._preempt(victim, out)
            if victim is seq:
                return False
        self.block_manager.append_slot(seq)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        # recompute, not swap: the KV is dropped and the sequence is prefilled again later
        self._dequeue(seq)
        self.block_manager.free(seq)
        seq.drop_kv(self.weights_version)
        self._enqueue(seq, SequenceStatus.WAITING)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def postprocess(
        self, output: SchedulerOutput, sampled: Mapping[str, int | None]
    ) -> list[Sequence]:
        """Apply a computed step: advance ``num_computed_tokens``, cache newly full blocks and
        append ``sampled[seq_id]`` to each item that ``samples`` (missing or None: nothing).
        Sequences reaching ``max_tokens`` or ``max_model_len`` finish (LENGTH) and are returned;
        stop tokens are the engine's to ``finish``. Items whose sequence finished or lost its KV
        since ``schedule`` are skipped; one paused meanwhile is updated."""
        finished: list[Sequence] = []
        max_len = self.config.max_model_len
        bs = self.config.block_size
        for item in output.scheduled:
            seq = item.seq
            if not seq.block_table or seq.num_computed_tokens != item.start:
                continue  # finished, preempted or made to recompute since schedule()
            seq.num_computed_tokens += item.num_new_tokens
            if seq.num_computed_tokens // bs > len(seq.block_hashes):  # a block filled up
                self.block_manager.mark_computed(seq)
            if not item.samples:
                continue
            token_id = sampled.get(seq.seq_id)
            if token_id is not None and not seq.reached_max_tokens():  # max_tokens=0: scoring
                seq.token_ids.append(token_id)
            if seq.reached_max_tokens() or (max_len is not None and len(seq.token_ids) >= max_len):
                self._finish(seq, FinishReason.LENGTH)
                finished.append(seq)
        for fork in output.forks:
            seq = fork.seq
            if not seq.block_table or seq.num_computed_tokens != len(seq.token_ids):
                continue  # finished, preempted or made to recompute since schedule()
            token_id = sampled.get(seq.seq_id)
            if token_id is not None and not seq.reached_max_tokens():
                seq.token_ids.append(token_id)
            if seq.reached_max_tokens() or (max_len is not None and len(seq.token_ids) >= max_len):
                self._finish(seq, FinishReason.LENGTH)
                finished.append(seq)
        return finished

    def finish(self, seq_id: str, reason: FinishReason = FinishReason.STOP) -> Sequence | None:
        """Finish ``seq_id`` and free its blocks (full computed ones stay cached). Returns the
        sequence, or None if it is unknown or already finished."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self._finish(seq, reason)
        return seq

    def abort(self, seq_id: str) -> Sequence | None:
        """Finish ``seq_id`` as ABORT; None if it is unknown or already finished."""
        return self.finish(seq_id, FinishReason.ABORT)

    def pause(self, seq_id: str) -> Sequence:
        """Take ``seq_id`` out of scheduling, keeping its blocks and computed KV (no-op if
        paused). Raises KeyError if it is unknown or finished."""
        seq = self.get(seq_id)
        self._dequeue(seq)
        self._enqueue(seq, SequenceStatus.PAUSED)
        return seq

    def resume(self, seq_id: str) -> Sequence:
        """Put a paused sequence back: RUNNING on its kept KV if it holds blocks, else
        WAITING (no-op if not paused). Raises KeyError if it is unknown or finished."""
        seq = self.get(seq_id)
        if seq.status is not SequenceStatus.PAUSED:
            return seq
        self._dequeue(seq)
        self._enqueue(seq, SequenceStatus.RUNNING if seq.block_table else SequenceStatus.WAITING)
        return seq

    def pause_all(self) -> list[Sequence]:
        """Pause every running and waiting sequence; returns them in arrival order."""
        seqs = sorted(self.running + self.waiting, key=_by_arrival)
        return [self.pause(seq.seq_id) for seq in seqs]

    def resume_all(self) -> list[Sequence]:
        """Resume every paused sequence; returns them in arrival order."""
        seqs = sorted(self.paused.values(), key=_by_arrival)
        return [self.resume(seq.seq_id) for seq in seqs]

    def recompute(self, seq_id: str) -> Sequence:
        """Drop ``seq_id``'s KV so that it is prefilled again (prompt + generated) under the
        current weights: the ``recompute`` resume policy. A running sequence goes back to
        WAITING; a paused one stays PAUSED without blocks. Raises KeyError if unknown."""
        seq = self.get(seq_id)
        self.block_manager.free(seq)
        seq.drop_kv(self.weights_version)
        if seq.status is SequenceStatus.RUNNING:
            self._dequeue(seq)
            self._enqueue(seq, SequenceStatus.WAITING)
        return seq

    def set_weights_version(self, version: int) -> None:
        """New KV is computed under ``version`` from now on. Sequences keep the KV they hold
        (``min_kv_version`` unchanged: the ``keep`` policy; call ``recompute`` for the other).
        Call while no step is in flight. Raises ValueError if ``version`` goes backwards."""
        if version < self.weights_version:
            raise ValueError(
                f"weights version {version} is older than the current {self.weights_version}"
            )
        self.weights_version = version
        for seq in self._seqs.values():
            seq.kv_version = version
            if not seq.has_kv:
                seq.min_kv_version = version

    def _reject(self, seq: Sequence, reason: str, out: SchedulerOutput) -> None:
        self._finish(seq, FinishReason.REJECTED)
        out.rejected.append(Rejection(seq, reason))

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if self._seqs.pop(seq.seq_id, None) is not None:
            self._dequeue(seq)
        key = self._prompt_key.pop(seq.seq_id, None)
        if key is not None and self._prefilling.get(key) is seq:
            del self._prefilling[key]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_computed_tokens = 0

    def _dequeue(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.PAUSED:
            del self.paused[seq.seq_id]

    def _enqueue(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        if status is SequenceStatus.RUNNING:
            insort(self.running, seq, key=_by_arrival)
        elif status is SequenceStatus.WAITING:
            insort(self.waiting, seq, key=_by_arrival)
        elif status is SequenceStatus.PAUSED:
            self.paused[seq.seq_id] = seq
