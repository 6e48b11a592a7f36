"""``agentroll bench chaos``: the counting is exact on synthetic event lists (lost, delivered
again after a confirmed ack, groups split), the kill plan covers every moment, and a real run
with two SIGKILLs of a served worker meets the target: nothing durable lost, nothing acked
delivered again, every group whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentroll.bench.chaos import run_chaos_bench, stream_token
from agentroll.bench.chaos_tally import MOMENTS, Event, kill_plan, tally
from agentroll.errors import ConfigError

KEYS = ["kills", "durable", "delivered", "lost", "duplicated_after_dedupe", "groups_incomplete"]


def _line(outcome_line: str) -> dict[str, int]:
    pairs = [field.split("=") for field in outcome_line.split()]
    assert [k for k, _ in pairs] == KEYS
    return {k: int(v) for k, v in pairs}


def test_tally_counts_lost_duplicated_and_incomplete() -> None:
    events = [
        Event("leased", "a1", "a"),
        Event("leased", "a2", "a"),
        Event("acked", "a1"),
        # a2's ack failed with the worker: offered again and acked, a dedupe hit only
        Event("leased", "a2", "a", 1),
        Event("acked", "a2", incarnation=1),
        # b1 came back after the worker confirmed its ack: what a trainer trains twice
        Event("leased", "b1", "b", 1),
        Event("acked", "b1", incarnation=1),
        Event("leased", "b1", "b", 2),
        Event("leased", "b1", "b", 2),
        # group c: one of its two members never arrived
        Event("leased", "c1", "c", 2),
    ]
    outcome = tally(
        kills=2, durable=["a1", "a2", "b1", "c1", "lost-1"], events=events, samples_per_task=2
    )
    assert outcome.duplicated_ids == ("b1",)
    assert outcome.lost_ids == ("lost-1",)
    # b has one member: incomplete too (the list is sorted by group id)
    assert outcome.incomplete_groups == (("b", 1), ("c", 1))
    assert _line(outcome.line()) == {
        "kills": 2,
        "durable": 5,
        "delivered": 4,
        "lost": 1,
        "duplicated_after_dedupe": 1,
        "groups_incomplete": 2,
    }
    assert not outcome.target_met


def test_tally_of_a_clean_run_meets_the_target() -> None:
    # the spool listed only some of what was delivered: delivered ids are durable too
    events = [Event("leased", f"g{i}-{k}", f"g{i}") for i in range(3) for k in range(2)]
    events += [Event("acked", e.trajectory_id) for e in events]
    outcome = tally(kills=0, durable=["g0-0"], events=events, samples_per_task=2)
    assert outcome.target_met
    assert _line(outcome.line()) == dict(zip(KEYS, [0, 6, 6, 0, 0, 0], strict=True))


def test_tally_refuses_what_cannot_happen() -> None:
    with pytest.raises(ValueError, match="acked before it was ever leased"):
        tally(kills=0, durable=[], events=[Event("acked", "x")], samples_per_task=1)
    with pytest.raises(ValueError, match="unknown event kind"):
        tally(kills=0, durable=[], events=[Event("seen", "x")], samples_per_task=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="samples_per_task"):
        tally(kills=0, durable=[], events=[], samples_per_task=0)


def test_kill_plan_covers_every_moment_each_round_and_is_seeded() -> None:
    plan = kill_plan(12, seed=7)
    assert len(plan) == 12 and plan == kill_plan(12, seed=7)
    rounds = [plan[i : i + len(MOMENTS)] for i in range(0, 10, len(MOMENTS))]
    assert all(sorted(r) == sorted(MOMENTS) for r in rounds)
    assert kill_plan(0, seed=7) == []


def test_bad_arguments_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--kills"):
        run_chaos_bench(-1, directory=tmp_path)
    with pytest.raises(ConfigError, match="--samples-per-task"):
        run_chaos_bench(1, samples_per_task=0, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_client_token_is_the_worker_s_file_else_the_one_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTROLL_STREAM_TOKEN", "this-process-not-the-worker")
    assert stream_token(tmp_path, "given") == "given"  # the worker wrote no file
    pytest.importorskip("agentroll.stream.auth")
    (tmp_path / "stream.token").write_text("from-the-worker\n")
    assert stream_token(tmp_path, "given") == "from-the-worker"


@pytest.mark.slow  # starts the worker process three times (torch, the tiny model): ~20 s
def test_two_kills_lose_nothing_repeat_nothing_and_split_no_group(tmp_path: Path) -> None:
    result = run_chaos_bench(2, seed=0, samples_per_task=2, directory=tmp_path)
    values = _line(result.line())
    assert values["kills"] == 2 and [k.moment for k in result.kills] == kill_plan(2, 0)
    assert values["delivered"] > 0 and values["durable"] == values["delivered"] + values["lost"]
    assert result.weight_pushes > 0
    assert result.final_pending == []  # drained: the spool is empty at the end
    explained = (
        f"lost {result.outcome.lost_ids}, delivered again after their ack "
        f"{result.outcome.duplicated_ids}, incomplete groups {result.outcome.incomplete_groups}"
    )
    assert values["lost"] == 0, explained
    assert values["duplicated_after_dedupe"] == 0, explained
    assert values["groups_incomplete"] == 0, explained
    assert result.outcome.target_met
