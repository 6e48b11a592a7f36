"""One request's state as the scheduler and the block manager see it: a plain mutable record.

Invariants: ``token_ids`` is prompt + generated so far and only grows at the end; the first
``num_computed_tokens`` tokens have their KV in the blocks of ``block_table`` (in order,
``block_size`` tokens per block); ``min_kv_version <= kv_version``, equal while every cached
KV entry of the sequence was computed under the weights version new KV is computed under.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life; only the scheduler changes it."""

    WAITING = "waiting"  # queued for (re)admission; holds no blocks
    RUNNING = "running"  # admitted; holds blocks for all its tokens
    PAUSED = "paused"  # out of scheduling; keeps its blocks and computed KV
    FINISHED = "finished"  # done, aborted or rejected; holds no blocks


class FinishReason(enum.Enum):
    """Why a sequence finished."""

    STOP = "stop"  # the engine saw a stop token or string
    LENGTH = "length"  # ``max_tokens`` or the model's context length was reached
    ABORT = "abort"  # the caller aborted it
    REJECTED = "rejected"  # it can never be scheduled (see ``SchedulerOutput.rejected``)


@dataclass(slots=True, eq=False)
class Sequence:
    """A request's tokens and KV bookkeeping.

    ``num_computed_tokens`` counts the leading tokens whose KV is in the cache. After a step
    that reaches the end of the sequence the engine samples one token, so an unfinished
    sequence normally has exactly one uncomputed token (the last sampled one) between steps.

    ``kv_version`` is the weights version that new KV of this sequence is computed under (the
    scheduler's current weights version); ``min_kv_version`` is the oldest weights version
    among the KV entries it holds, which is the ``kv_version`` a sampled token records. The
    two differ only after a ``keep`` resume across a weight update.

    ``block_table`` and ``block_hashes`` belong to the block manager: ``block_hashes[i]`` is
    the prefix-cache key of the full, computed block ``i`` (empty when caching is off, and not
    extended while ``min_kv_version != kv_version``).
    """

    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int = -1  # -1: every token given is prompt
    max_tokens: int | None = None  # None: until a stop or the context length
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    kv_version: int = 0
    min_kv_version: int = 0
    arrival: int = 0  # set by Scheduler.add; FCFS order and preemption order
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(
                f"sequence {self.seq_id!r} has no tokens; give at least one prompt token"
            )
        if self.num_prompt_tokens == -1:
            self.num_prompt_tokens = len(self.token_ids)
        if not 1 <= self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(
                f"sequence {self.seq_id!r}: num_prompt_tokens={self.num_prompt_tokens} must be "
                f"between 1 and the number of tokens ({len(self.token_ids)})"
            )
        if self.max_tokens is not None and self.max_tokens < 0:
            raise ValueError(
                f"sequence {self.seq_id!r}: max_tokens={self.max_tokens} must be >= 0 or None"
            )
        if self.min_kv_version > self.kv_version:
            raise ValueError(
                f"sequence {self.seq_id!r}: min_kv_version={self.min_kv_version} must not exceed "
                f"kv_version={self.kv_version}"
            )

    # -- sizes ---------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        """Tokens sampled so far (after the prompt)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet (what the next step would compute)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def has_kv(self) -> bool:
        """Whether some of its KV is in the cache (computed or a prefix-cache hit)."""
        return self.num_computed_tokens > 0

    @property
    def is_kv_uniform(self) -> bool:
        """All its cached KV was computed under the version new KV is computed under."""
        return self.min_kv_version == self.kv_version

    # -- blocks --------------------------------------------------------------------------

    def num_blocks_needed(self, block_size: int, num_tokens: int | None = None) -> int:
        """Blocks that hold the KV of ``num_tokens`` tokens (default: all current tokens)."""
        n = len(self.token_ids) if num_tokens is None else num_tokens
        return (n + block_size - 1) // block_size

    def block_token_ids(self, index: int, block_size: int) -> list[int]:
        """The token ids that block ``index`` of the table holds (fewer for the last block)."""
        start = index * block_size
        return self.token_ids[start : start + block_size]

    # -- growth --------------------------------------------------------------------------

    def append_token(self, token_id: int) -> None:
        """Append one sampled token; its KV is computed by the next step."""
        self.token_ids.append(token_id)

    def reached_max_tokens(self) -> bool:
        return self.max_tokens is not None and self.num_generated >= self.max_tokens

    def drop_kv(self, weights_version: int) -> None:
        """Forget all KV bookkeeping (the caller frees the blocks first): the sequence will be
        prefilled again from scratch under ``weights_version``."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.block_hashes = []
        self.kv_version = weights_version
        self.min_kv_version = weights_version

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"prompt={self.num_prompt_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, kv_version={self.min_kv_version}..{self.kv_version})"
        )
