"""Scheduler: continuous batching, chunked prefill, preemption, rejection, pause and resume.

The fake model writes each computed token's "KV" (token id, weights version) into its block
slot and samples from what it reads back through the block table, as attention would: a wrong
block table, a wrongly shared block or stale KV changes the output or fails an assertion.
"""

from __future__ import annotations

from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from agentroll.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from agentroll.engine.sequence import FinishReason, Sequence, SequenceStatus
from agentroll.errors import ConfigError

VOCAB = 50_000


def next_token(token_ids: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(repr(token_ids).encode()) % VOCAB


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) < len(prompt) + max_tokens:
        tokens.append(next_token(tokens))
    return tokens


class FakeModel:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.block_size = sched.config.block_size
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}  # (block, offset) -> (token, version)

    def slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // self.block_size], pos % self.block_size

    def step(self, out: SchedulerOutput) -> dict[str, int | None]:
        sampled: dict[str, int | None] = {}
        blocks = self.sched.block_manager.blocks
        for item in out.scheduled:
            seq = item.seq
            # a fork of this step holds the blocks its leader's prompt is written into now
            forked = [f.seq for f in out.forks if f.leader is seq]
            assert item.start == seq.num_computed_tokens
            assert len(seq.block_table) * self.block_size >= item.start + item.num_new_tokens
            for pos in range(item.start, item.start + item.num_new_tokens):
                slot = self.slot(seq, pos)
                holders = 1 + sum(f.block_table.count(slot[0]) for f in forked)
                assert blocks[slot[0]].ref_count == holders, "wrote KV into a shared block"
                self.kv[slot] = (seq.token_ids[pos], self.sched.weights_version)
            if item.samples:
                context = [self.kv[self.slot(seq, pos)] for pos in range(seq.num_tokens)]
                assert [token for token, _ in context] == seq.token_ids
                assert min(version for _, version in context) == seq.min_kv_version
                sampled[seq.seq_id] = next_token(seq.token_ids)
        for fork in out.forks:  # as the engine: copy the partial block, sample the leader's
            assert fork.leader.seq_id in sampled and fork.seq.token_ids == fork.leader.token_ids
            if fork.copy is not None:
                for offset in range(self.block_size):
                    if (fork.copy[0], offset) in self.kv:
                        self.kv[(fork.copy[1], offset)] = self.kv[(fork.copy[0], offset)]
            seq = fork.seq
            context = [self.kv[self.slot(seq, pos)] for pos in range(seq.num_tokens)]
            assert [token for token, _ in context] == seq.token_ids
            sampled[seq.seq_id] = next_token(seq.token_ids)
        return sampled


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    ids = [item.seq.seq_id for item in out.scheduled]
    assert len(ids) == len(set(ids)) <= sched.config.max_num_seqs
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert all(
        i.num_new_tokens >= 1 and i.seq.status is SequenceStatus.RUNNING for i in out.scheduled
    )
    check_blocks(sched)


def check_blocks(sched: Scheduler) -> None:
    bm = sched.block_manager
    live = sched.running + sched.waiting + list(sched.paused.values())
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    for block in bm.blocks:
        assert block.ref_count == sum(seq.block_table.count(block.block_id) for seq in live)
    assert all(s.block_table == [] and s.num_computed_tokens == 0 for s in sched.waiting)


def run(sched: Scheduler, model: FakeModel, steps: int | None = None) -> list[SchedulerOutput]:
    """Run ``steps`` steps, or until the scheduler has no work left."""
    outputs: list[SchedulerOutput] = []
    while sched.has_work() and len(outputs) < (steps or 5000):
        out = sched.schedule()
        check_step(sched, out)
        sched.postprocess(out, model.step(out))
        outputs.append(out)
    assert steps is not None or not sched.has_work(), "the scheduler did not drain"
    return outputs


def make(*seqs: Sequence, **overrides: int | bool) -> tuple[Scheduler, FakeModel]:
    # group sharing off unless asked: many tests here give sequences equal prompts
    args: dict = dict(
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=4,
        num_blocks=64,
        enable_group_sharing=False,
    )
    sched = Scheduler(SchedulerConfig(**(args | overrides)))
    for s in seqs:
        sched.add(s)
    return sched, FakeModel(sched)


def seq(seq_id: str, prompt: list[int] | int, max_tokens: int | None = 5) -> Sequence:
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    return Sequence(seq_id, tokens, max_tokens=max_tokens)


def trace(outputs: list[SchedulerOutput]) -> list[list[tuple[str, int, int]]]:
    return [[(i.seq.seq_id, i.start, i.num_new_tokens) for i in out.scheduled] for out in outputs]


def forks(outputs: list[SchedulerOutput]) -> list[list[tuple[str, str, bool]]]:
    return [[(f.leader.seq_id, f.seq.seq_id, f.copy is not None) for f in o.forks] for o in outputs]


def test_identical_prompts_fork_the_first_ones_prefill() -> None:
    a, b, c, other = seq("a", 10), seq("b", 10), seq("c", 10), seq("o", [9, 9, 9])
    sched, model = make(
        a, b, c, other, max_num_batched_tokens=4, enable_group_sharing=True
    )  # a prefills in 3 chunks
    outputs = run(sched, model)
    # b and c wait while a prefills (o overtakes them), then start from a's KV
    assert trace(outputs[:3]) == [[("a", 0, 4)], [("a", 4, 4)], [("a", 8, 2), ("o", 0, 2)]]
    assert forks(outputs) == [[], [], [("a", "b", True), ("a", "c", True)]] + [[]] * (
        len(outputs) - 3
    )
    expected = expected_tokens(list(range(1, 11)), 5)
    assert a.token_ids == b.token_ids == c.token_ids == expected
    assert sched.num_shared_tokens == 20 and sched.block_manager.num_used_blocks == 0


def test_a_block_aligned_prompt_forks_without_a_copy_and_grows_its_own_block() -> None:
    a, b = seq("a", 8), seq("b", 8)
    sched, model = make(a, b, enable_group_sharing=True)
    outputs = run(sched, model)
    assert forks(outputs)[0] == [("a", "b", False)]
    assert a.token_ids == b.token_ids == expected_tokens(list(range(1, 9)), 5)


def test_no_fork_when_sharing_is_off_after_the_prefill_or_after_the_leader_left() -> None:
    a, b = seq("a", 10), seq("b", 10)
    sched, model = make(a, b, max_num_batched_tokens=4, enable_group_sharing=False)
    assert not any(forks(run(sched, model))) and sched.num_shared_tokens == 0
    # a twin that arrives after the prefill ended uses the prefix cache instead
    a, late = seq("a", 10), seq("late", 10)
    sched, model = make(a, enable_group_sharing=True)
    run(sched, model, steps=2)
    sched.add(late)
    outputs = run(sched, model)
    assert not any(forks(outputs)) and outputs[0].scheduled[-1].start == 8
    # the leader is aborted mid-prefill: its twin is prefilled on its own
    a, b = seq("a", 10), seq("b", 10)
    sched, model = make(a, b, max_num_batched_tokens=4, enable_group_sharing=True)
    run(sched, model, steps=1)
    sched.abort("a")
    outputs = run(sched, model)
    assert not any(forks(outputs)) and b.token_ids == expected_tokens(list(range(1, 11)), 5)
    assert sched.block_manager.num_used_blocks == 0


def test_a_fork_of_this_step_is_never_preempted_for_a_later_prefill() -> None:
    a, b, c = seq("a", 6, max_tokens=8), seq("b", 6, max_tokens=8), seq("c", 12)
    sched, model = make(a, b, c, num_blocks=6, enable_group_sharing=True)
    outputs = run(sched, model)
    assert a.token_ids == b.token_ids == expected_tokens(list(range(1, 7)), 8)
    assert c.token_ids == expected_tokens(list(range(1, 13)), 5)
    assert any(o.forks for o in outputs) and sched.num_preemptions > 0


def test_config_errors_say_what_to_change() -> None:
    cases: list[tuple[str, Any, str]] = [
        ("max_num_seqs", 0, "max_num_seqs=0"),
        ("max_num_batched_tokens", -1, "max_num_batched_tokens=-1"),
        ("block_size", 0, "block_size=0"),
        ("num_blocks", 0, "num_blocks=0"),
        ("max_model_len", 4096, "raise num_blocks to >= 256"),
    ]
    for field, value, match in cases:
        with pytest.raises(ConfigError, match=match):  # a ConfigError is a ValueError
            SchedulerConfig(**({"block_size": 16, "num_blocks": 8} | {field: value}))


def test_prefill_then_decode_until_max_tokens() -> None:
    a, b = seq("a", 7), seq("b", 3, max_tokens=2)
    sched, model = make(a, b)
    outputs = run(sched, model)
    first = [
        (i.seq.seq_id, i.num_new_tokens, i.is_prefill, i.samples) for i in outputs[0].scheduled
    ]
    assert first == [("a", 7, True, True), ("b", 3, True, True)]
    assert all(not i.is_prefill and i.num_new_tokens == 1 for o in outputs[1:] for i in o.scheduled)
    assert len(outputs) == 5
    assert a.token_ids == expected_tokens(list(range(1, 8)), 5)
    assert b.token_ids == expected_tokens([1, 2, 3], 2)
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
    assert sched.block_manager.num_free_blocks == 64 and sched.num_unfinished == 0


def test_chunked_prefill_splits_a_long_prompt_within_the_budget() -> None:
    a = seq("a", 20, max_tokens=3)
    outputs = run(*make(a, max_num_batched_tokens=8))
    assert trace(outputs) == [[("a", s, n)] for s, n in [(0, 8), (8, 8), (16, 4), (20, 1), (21, 1)]]
    assert [i.samples for o in outputs for i in o.scheduled] == [False, False, True, True, True]
    assert a.token_ids == expected_tokens(list(range(1, 21)), 3)


def test_decodes_go_first_and_prefill_chunks_fill_the_rest() -> None:
    a, b = seq("a", 3, max_tokens=10), seq("b", list(range(50, 70)), max_tokens=1)
    sched, model = make(a, max_num_batched_tokens=8)
    run(sched, model, steps=1)
    sched.add(b)
    outputs = run(sched, model)
    assert trace(outputs)[:3] == [
        [("a", 3, 1), ("b", 0, 7)],
        [("a", 4, 1), ("b", 7, 7)],
        [("a", 5, 1), ("b", 14, 6)],
    ]
    assert b.token_ids == expected_tokens(list(range(50, 70)), 1)
    assert a.token_ids == expected_tokens([1, 2, 3], 10)


def test_max_num_seqs_bounds_each_step() -> None:
    seqs = [seq(f"s{i}", 4, max_tokens=3) for i in range(5)]
    outputs = run(*make(*seqs, max_num_seqs=2))
    assert all(len(o.scheduled) <= 2 for o in outputs)
    assert [i.seq.seq_id for i in outputs[0].scheduled] == ["s0", "s1"]
    assert all(s.token_ids == expected_tokens([1, 2, 3, 4], 3) for s in seqs)


def test_without_chunking_prompts_wait_for_budget_and_oversized_ones_are_rejected() -> None:
    a, big, c = seq("a", 6), seq("big", 11), seq("c", 6)
    sched, model = make(a, big, c, max_num_batched_tokens=10, enable_chunked_prefill=False)
    outputs = run(sched, model)
    assert [(r.seq, "max_num_batched_tokens=10" in r.reason) for r in outputs[0].rejected] == [
        (big, True)
    ]
    assert big.finish_reason is FinishReason.REJECTED
    assert trace(outputs)[0] == [("a", 0, 6)]  # c (6 tokens) does not fit the 4 left
    assert c.token_ids == expected_tokens(list(range(1, 7)), 5)


def test_preemption_under_block_pressure_recomputes_and_finishes_identically() -> None:
    prompts = [[i, i + 1, i + 2, i + 3, i + 4, i + 5] for i in range(3)]
    seqs = [seq(f"s{i}", prompt, max_tokens=10) for i, prompt in enumerate(prompts)]
    sched, model = make(*seqs, num_blocks=6)
    preempted = []
    while sched.has_work():
        before = set(sched.running)
        out = sched.schedule()
        check_step(sched, out)
        assert not out.rejected
        for victim in out.preempted:  # the latest arrivals go first
            preempted.append(victim)
            assert all(s.arrival < victim.arrival for s in sched.running if s in before)
        sched.postprocess(out, model.step(out))
    assert preempted and sched.num_preemptions == len(preempted)
    for s, prompt in zip(seqs, prompts, strict=True):
        assert s.finish_reason is FinishReason.LENGTH
        assert s.token_ids == expected_tokens(prompt, 10)
    assert sched.block_manager.num_free_blocks == 6


def test_without_chunking_a_preempted_sequence_is_recomputed_in_chunks() -> None:
    a, b = seq("a", 6, max_tokens=8), seq("b", 5, max_tokens=8)
    outputs = run(*make(a, b, num_blocks=4, max_num_batched_tokens=6, enable_chunked_prefill=False))
    assert any(o.preempted for o in outputs) and not any(o.rejected for o in outputs)
    assert a.token_ids == expected_tokens(list(range(1, 7)), 8)
    assert b.token_ids == expected_tokens(list(range(1, 6)), 8)


def test_a_request_too_long_for_the_pool_or_the_model_is_rejected_alone() -> None:
    a, big = seq("a", 5, max_tokens=3), seq("big", 17)
    sched, model = make(num_blocks=4)
    sched.add(a)
    assert not sched.add(big)
    assert big.is_finished and big.block_table == []
    outputs = run(sched, model)
    assert [(r.seq, "num_blocks=4" in r.reason) for r in outputs[0].rejected] == [(big, True)]
    assert trace(outputs)[0] == [("a", 0, 5)]
    assert a.token_ids == expected_tokens([1, 2, 3, 4, 5], 3)
    sched, model = make(max_model_len=10)
    assert not sched.add(seq("long", 11))
    sched.add(a := seq("a", 8, max_tokens=None))
    run(sched, model)
    assert (a.num_tokens, a.finish_reason) == (10, FinishReason.LENGTH)


def test_a_sequence_outgrowing_the_whole_pool_is_rejected_mid_generation() -> None:
    a, b = seq("a", 6, max_tokens=None), seq("b", 3, max_tokens=2)
    sched, model = make(a, num_blocks=2)
    outputs = run(sched, model)
    assert [r.seq for o in outputs for r in o.rejected] == [a]
    assert a.num_tokens == 9  # 8 tokens of KV fit; the 9th would need a third block
    assert a.token_ids == expected_tokens([1, 2, 3, 4, 5, 6], 3)
    assert sched.block_manager.num_free_blocks == 2
    sched.add(b)
    run(sched, model)
    assert b.finish_reason is FinishReason.LENGTH


def test_pause_keeps_blocks_and_excludes_the_sequence_until_resumed() -> None:
    a, b = seq("a", 6, max_tokens=8), seq("b", 6, max_tokens=8)
    sched, model = make(a, b)
    run(sched, model, steps=2)
    table, computed = list(a.block_table), a.num_computed_tokens
    assert sched.pause("a") is a and a.status is SequenceStatus.PAUSED
    outputs = run(sched, model, steps=3)
    assert all(i.seq is b for o in outputs for i in o.scheduled)
    assert (a.block_table, a.num_computed_tokens) == (table, computed)
    assert all(sched.block_manager.blocks[i].ref_count == 1 for i in table)
    sched.resume("a")
    outputs = run(sched, model)
    assert trace(outputs)[0][0] == ("a", computed, 1)  # decodes on its kept KV
    assert a.token_ids == b.token_ids == expected_tokens(list(range(1, 7)), 8)


def test_pause_all_stops_everything_and_resume_all_continues() -> None:
    a, w = seq("a", 3), seq("w", 9)  # w is mid-prefill when paused
    sched, model = make(a, w, max_num_batched_tokens=4)
    run(sched, model, steps=1)
    assert [s.seq_id for s in sched.pause_all()] == ["a", "w"]
    assert not sched.has_work() and sched.schedule().is_empty
    assert [s.seq_id for s in sched.resume_all()] == ["a", "w"]
    run(sched, model)
    assert a.token_ids == expected_tokens([1, 2, 3], 5)
    assert w.token_ids == expected_tokens(list(range(1, 10)), 5)


def test_abort_and_finish_free_everything() -> None:
    a, b, w = seq("a", 6), seq("b", 6), seq("w", 6)
    sched, model = make(a, b, w, num_blocks=8)
    run(sched, model, steps=1)
    sched.pause("b")
    assert sched.abort("a") is a
    assert sched.abort("a") is None and sched.abort("nope") is None
    assert sched.finish("b") is b  # a stop token seen by the engine, while paused
    assert sched.abort("w") is w
    assert (a.finish_reason, b.finish_reason) == (FinishReason.ABORT, FinishReason.STOP)
    assert sched.block_manager.num_free_blocks == 8
    assert sched.num_unfinished == 0 and not sched.has_work()
    with pytest.raises(KeyError):
        sched.pause("a")


def test_second_turn_prefills_only_its_new_tokens() -> None:
    a = seq("a", 9, max_tokens=4)
    sched, model = make(a)
    run(sched, model)
    b = seq("b", a.token_ids + [7, 7, 7], max_tokens=2)
    sched.add(b)
    outputs = run(sched, model)
    assert trace(outputs)[0] == [("b", 12, 4)]  # a computed 12 of its 13 tokens: 3 full blocks
    assert b.token_ids == expected_tokens(a.token_ids + [7, 7, 7], 2)
    assert sched.block_manager.prefix_hit_rate == pytest.approx(12 / (9 + 16))


def test_keep_after_a_weight_update_records_the_old_kv_version() -> None:
    a, b = seq("a", 9, max_tokens=8), seq("b", 9, max_tokens=2)
    sched, model = make(a)
    run(sched, model, steps=2)
    sched.pause_all()
    sched.set_weights_version(1)
    sched.resume_all()
    assert (a.min_kv_version, a.kv_version) == (0, 1)
    cached = sched.block_manager.num_cached_blocks
    sched.add(b)  # same prompt, new weights: no reuse of the old KV
    outputs = run(sched, model)  # the fake model checks min(version attended) == min_kv_version
    assert ("b", 0, 9) in trace(outputs)[0]
    assert a.token_ids == expected_tokens(list(range(1, 10)), 8)
    assert (b.min_kv_version, b.kv_version) == (1, 1)
    assert sched.block_manager.num_cached_blocks == cached + 2  # b's blocks; never a's mixed ones
    with pytest.raises(ValueError, match="older"):
        sched.set_weights_version(0)


def test_a_block_straddling_a_weight_update_is_never_reused() -> None:
    a = seq("a", 2, max_tokens=6)
    sched, model = make(a)
    run(sched, model, steps=1)  # block 0 holds 3 tokens, 2 computed under v0
    sched.pause_all()
    sched.set_weights_version(1)
    sched.resume_all()
    run(sched, model, steps=3)  # block 0 fills up under v1: its KV mixes both versions
    assert a.num_computed_tokens == 5 and sched.block_manager.num_cached_blocks == 0
    b = seq("b", a.token_ids + [1], max_tokens=1)  # the next turn, under v1
    sched.add(b)
    outputs = run(sched, model)  # the fake model checks that b attends only to v1 KV
    assert ("b", 0, 7) in trace(outputs)[0]


def test_recompute_after_a_weight_update_prefills_again_under_the_new_version() -> None:
    a = seq("a", 9, max_tokens=6)
    sched, model = make(a)
    run(sched, model, steps=3)
    sched.pause("a")
    sched.set_weights_version(2)
    sched.recompute("a")
    assert a.status is SequenceStatus.PAUSED and a.block_table == []
    assert (a.min_kv_version, a.kv_version) == (2, 2)
    sched.resume("a")
    assert a.status is SequenceStatus.WAITING
    outputs = run(sched, model)
    assert trace(outputs)[0] == [("a", 0, 12)]  # prompt + 3 generated, nothing reused
    assert a.token_ids == expected_tokens(list(range(1, 10)), 6)


def test_add_with_kv_restores_a_snapshot_and_continues_exactly() -> None:
    a = seq("a", 10, max_tokens=9)
    sched, model = make(a)
    run(sched, model, steps=3)
    snap_tokens, snap_computed = list(a.token_ids), a.num_computed_tokens
    snap_kv = [model.kv[model.slot(a, pos)] for pos in range(snap_computed)]
    sched.abort("a")

    fresh, fresh_model = make()  # another process
    restored = Sequence("a", snap_tokens, num_prompt_tokens=10, max_tokens=9)
    with pytest.raises(ValueError, match="between 1 and"):
        fresh.add_with_kv(Sequence("x", [1, 2]), 2)
    assert fresh.add_with_kv(restored, snap_computed)
    assert restored.status is SequenceStatus.RUNNING
    for pos, entry in enumerate(snap_kv):
        fresh_model.kv[fresh_model.slot(restored, pos)] = entry
    run(fresh, fresh_model)
    assert restored.token_ids == expected_tokens(list(range(1, 11)), 9)
    assert fresh.block_manager.num_cached_blocks == 4

    tiny, _ = make(seq("z", 7, max_tokens=1), num_blocks=2)
    tiny.schedule()
    assert not tiny.add_with_kv(Sequence("y", list(range(7))), 6)  # no free blocks now


def test_the_same_calls_give_the_same_schedule() -> None:
    def scenario() -> list[list[tuple[str, int, int]]]:
        seqs = [seq(f"s{i}", [i % 2] * 3 + [i] * (i + 1), max_tokens=4 + i % 3) for i in range(6)]
        return trace(
            run(*make(*seqs, num_blocks=7, block_size=2, max_num_batched_tokens=9, max_num_seqs=3))
        )

    assert scenario() == scenario()


BASE = [11, 12, 13, 14, 15, 16, 17, 18, 19]
OPS = ["pause", "resume", "abort", "finish", "recompute"]


class SchedulerMachine(RuleBasedStateMachine):
    """Random interleavings of every public operation: blocks never leak, budgets hold, every
    sequence that finishes by length has exactly the uninterrupted tokens."""

    @initialize(
        config=st.builds(
            SchedulerConfig,
            max_num_seqs=st.integers(1, 4),
            max_num_batched_tokens=st.integers(1, 16),
            block_size=st.integers(1, 4),
            num_blocks=st.integers(2, 12),
            enable_chunked_prefill=st.booleans(),
            enable_prefix_caching=st.booleans(),
            enable_group_sharing=st.booleans(),
        )
    )
    def configure(self, config: SchedulerConfig) -> None:
        self.seqs: list[Sequence] = []
        self.sched = Scheduler(config)
        self.model = FakeModel(self.sched)

    def _add(self, prompt: list[int], max_tokens: int) -> None:
        self.seqs.append(Sequence(f"s{len(self.seqs)}", prompt, max_tokens=max_tokens))
        self.sched.add(self.seqs[-1])

    @rule(
        shared=st.integers(0, 9),
        extra=st.lists(st.integers(0, 5), max_size=10),
        n=st.integers(0, 6),
    )
    def add(self, shared: int, extra: list[int], n: int) -> None:
        self._add(BASE[:shared] + extra or [1], n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 5), max_size=4), n=st.integers(0, 6))
    def add_next_turn(self, data: st.DataObject, extra: list[int], n: int) -> None:
        self._add(data.draw(st.sampled_from(self.seqs)).token_ids + extra, n)

    @rule()
    def step(self) -> None:
        run(self.sched, self.model, steps=1)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), op=st.sampled_from(OPS), during_a_step=st.booleans())
    def control(self, data: st.DataObject, op: str, during_a_step: bool) -> None:
        out = self.sched.schedule() if during_a_step else SchedulerOutput()
        check_step(self.sched, out)
        sampled = self.model.step(out)
        seq = data.draw(st.sampled_from(self.seqs))
        if op in ("abort", "finish") or not seq.is_finished:
            getattr(self.sched, op)(seq.seq_id)
        self.sched.postprocess(out, sampled)

    @rule(resume=st.booleans())
    def weight_update(self, resume: bool) -> None:
        self.sched.pause_all()
        self.sched.set_weights_version(self.sched.weights_version + 1)
        if resume:
            self.sched.resume_all()

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        if hasattr(self, "sched"):
            check_blocks(self.sched)

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        self.sched.resume_all()
        run(self.sched, self.model)
        bm = self.sched.block_manager
        assert self.sched.num_unfinished == 0
        assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
        for s in self.seqs:
            assert s.is_finished and s.block_table == []
            full = expected_tokens(s.prompt_token_ids, s.max_tokens or 0)
            assert s.token_ids == (
                full if s.finish_reason is FinishReason.LENGTH else full[: s.num_tokens]
            )


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
