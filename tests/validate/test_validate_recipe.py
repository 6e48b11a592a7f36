"""``agentroll validate --recipe``: the checks by risk class catch what they must (a
dropped token, perturbed logprobs, a shifted distribution, a changed engine) and pass the
recipe's real optimisations; the table and the exit status say what was found."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import numpy as np
import pytest

from agentroll.errors import ConfigError
from agentroll.run.recipe import parse_recipe
from agentroll.types import Trajectory
from agentroll.validate.recipe import (
    ks_compare,
    parity_check,
    token_parity,
    validate_recipe,
    write_report,
)


def _traj(i: int, ids: list[int], lps: list[float], reward: float = 0.0) -> Trajectory:
    n = len(ids)
    return Trajectory(
        id=f"t{i}",
        task_id=f"task-{i}",
        group_id="g",
        token_ids=np.array([1, 2, *ids]),
        logprobs=np.array([np.nan, np.nan, *lps]),
        loss_mask=np.array([0, 0, *([1] * n)]),
        policy_version=np.array([-1, -1, *([0] * n)]),
        kv_version=np.array([-1, -1, *([0] * n)]),
        reward=reward,
    )


def _run(seed: int, n: int = 64, shift: float = 0.0, length: int = 8) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = max(1, length + rng.randint(-3, 3))
        out.append(
            _traj(
                i,
                [rng.randrange(100) for _ in range(k)],
                [-abs(rng.gauss(1.0, 0.5)) - shift for _ in range(k)],
                reward=float(rng.random() < 0.5),
            )
        )
    return out


def test_token_parity_catches_a_dropped_token_and_a_perturbed_logprob() -> None:
    a = [_traj(0, [5, 6, 7], [-0.1, -0.2, -0.3]), _traj(1, [8, 9], [-0.5, -0.6])]
    same, fig = token_parity(a, [_traj(0, [5, 6, 7], [-0.1, -0.2, -0.3]), a[1]])
    assert same and "differ=0" in fig
    dropped = [_traj(0, [5, 6], [-0.1, -0.2]), a[1]]  # the last token is gone
    same, fig = token_parity(a, dropped)
    assert not same and "differ=1" in fig and "first_diff=task-0/0@2" in fig
    nudged = [_traj(0, [5, 6, 7], [-0.1, -0.2, -0.3 + 1e-6]), a[1]]
    same, fig = token_parity(a, nudged)
    assert not same and "max_abs_logprob_diff=1.0" in fig  # float32 rounding


def test_ks_passes_the_same_distribution_and_fails_a_shifted_one() -> None:
    ok, fig = ks_compare(_run(1), _run(2))
    assert ok, fig
    ok, fig = ks_compare(_run(1), _run(2, shift=0.8))  # logprobs perturbed
    assert not ok and "logprob_ks=" in fig
    ok, fig = ks_compare(_run(1), _run(2, length=3))  # responses cut short
    assert not ok and "length_ks=" in fig


RECIPE = """
[run]
name = "validate-test"
[model]
layers = 2
hidden = 64
[environment]
name = "calculator"
kwargs = {{ num_tasks = 16, max_operand = 9, traces = "{traces}" }}
[backend]
kv_cache_mb = 16
max_num_seqs = 16
[sampling]
max_tokens = 24
[rollout]
concurrency = 8
samples_per_task = 2
[trainer]
batch_size = 8
"""


@pytest.fixture
def recipe_and_model(tmp_path: Path) -> tuple[object, Path]:
    from agentroll.run.loop import prepare_model

    repo = Path(__file__).resolve().parents[2]
    recipe = parse_recipe(
        RECIPE.format(traces=repo / "examples/data/calculator_traces.jsonl")
    ).resolved(tmp_path)
    return recipe, prepare_model(recipe, tmp_path)  # type: ignore[arg-type]


def test_the_recipes_token_parity_optimisations_pass_and_a_changed_engine_fails(
    recipe_and_model: tuple[object, Path], tmp_path: Path
) -> None:
    recipe, model = recipe_and_model
    got = validate_recipe(recipe, model, episodes=8, risk="token_parity", only=None)  # type: ignore[arg-type]
    by = {v.optimisation: v for v in got}
    assert by["prefix_caching"].verdict == "pass", by["prefix_caching"].figure
    assert by["chunked_prefill"].verdict == "pass", by["chunked_prefill"].figure
    # a knob that changes what is sampled (here: the engine's dtype) is caught by the check
    broken = validate_recipe(
        recipe,  # type: ignore[arg-type]
        model,
        episodes=8,
        only="prefix_caching",
        extra={"token_parity:prefix_cache": parity_check(with_={"dtype": "bfloat16"})},
    )
    assert [v.verdict for v in broken] == ["fail"], broken[0].figure
    report = write_report(got + broken, tmp_path / "validate", "validate-test").read_text()
    assert "| prefix_caching | token_parity |" in report and "| fail |" in report


@pytest.mark.parametrize(
    ("fault", "shows"), [("perturb_logprobs", "differ=0"), ("drop_last_token", "first_diff=")]
)
def test_a_deliberately_broken_optimisation_fails_the_check_of_its_class(
    recipe_and_model: tuple[object, Path],
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
    shows: str,
) -> None:
    """A registered token-parity optimisation whose "with" side is the engine's test-only
    fault (logprobs off by 1e-3, or each generation's last token dropped) fails."""
    from agentroll.validate import registry

    broken = registry.Optimisation(
        "broken_for_test", "token_parity", (), lambda r: True, "token_parity:broken", "a fault"
    )
    monkeypatch.setattr(registry, "OPTIMISATIONS", (*registry.OPTIMISATIONS, broken))
    recipe, model = recipe_and_model
    (got,) = validate_recipe(
        recipe,  # type: ignore[arg-type]
        model,
        episodes=8,
        only="broken_for_test",
        extra={"token_parity:broken": parity_check(with_={"test_fault": fault})},
    )
    assert got.verdict == "fail" and shows in got.figure, got.figure
    if fault == "perturb_logprobs":  # the same tokens, logprobs 1e-3 off
        assert "max_abs_logprob_diff=0.001" in got.figure, got.figure


@pytest.fixture
def unbuilt(monkeypatch: pytest.MonkeyPatch) -> str:
    """An optimisation registered with a check nobody built."""
    from agentroll.validate import registry

    o = registry.Optimisation(
        "unbuilt_for_test", "end_to_end", (), lambda r: True, "end_to_end:not_built", "-"
    )
    monkeypatch.setattr(registry, "OPTIMISATIONS", (*registry.OPTIMISATIONS, o))
    return o.name


def test_unit_checks_run_and_unbuilt_ones_say_unchecked(
    recipe_and_model: tuple[object, Path], unbuilt: str
) -> None:
    recipe, model = recipe_and_model
    unit = {v.optimisation: v for v in validate_recipe(recipe, model, risk="unit")}  # type: ignore[arg-type]
    assert unit["delta_sync"].verdict == "pass" and "digest_equal=3/3" in unit["delta_sync"].figure
    (got,) = validate_recipe(recipe, model, only=unbuilt)  # type: ignore[arg-type]
    assert got.verdict == "unchecked" and "no check" in got.figure


def test_bad_requests_say_what_to_do(recipe_and_model: tuple[object, Path]) -> None:
    recipe, model = recipe_and_model
    with pytest.raises(ConfigError, match="unknown optimisation"):
        validate_recipe(recipe, model, only="warp_drive")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="at least 1"):
        validate_recipe(recipe, model, episodes=0)  # type: ignore[arg-type]
    bf16 = parse_recipe(
        RECIPE.format(traces="unused").replace("[backend]\n", "[backend]\ndtype = 'bfloat16'\n")
    )
    with pytest.raises(ConfigError, match="too few for a distribution test: use at least 16"):
        validate_recipe(bf16, model, episodes=8, only="bf16_serving")


def test_the_command_writes_the_table_and_its_exit_status_says_what_was_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], unbuilt: str
) -> None:
    from agentroll.cli import main

    repo = Path(__file__).resolve().parents[2]
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE.format(traces=repo / "examples/data/calculator_traces.jsonl"))
    run = tmp_path / "run"
    base = ["validate", "--recipe", str(recipe), "--run-dir", str(run), "--episodes", "4"]
    assert main([*base, "--only", "prefix_caching"]) == 0
    out = capsys.readouterr().out
    assert "optimisation=prefix_caching class=token_parity" in out and "verdict=pass" in out
    assert "| prefix_caching | token_parity |" in (run / "validate" / "report.md").read_text()
    # an optimisation whose check is not built: unchecked, exit status 2
    assert main([*base, "--only", unbuilt]) == 2
    assert "verdict=unchecked" in capsys.readouterr().out


def test_keep_kv_under_new_weights_is_compared_with_recompute_across_a_real_sync(
    recipe_and_model: tuple[object, Path],
) -> None:
    recipe, model = recipe_and_model
    (v,) = validate_recipe(recipe, model, episodes=16, only="keep_kv_under_new_weights")  # type: ignore[arg-type]
    assert v.risk == "distribution" and v.verdict == "pass", v.figure
    lagged = int(v.figure.split("kv_lagged_tokens=")[1].split()[0])
    assert lagged > 0  # the update landed mid-generation: keep really attended to old KV
    assert "logprob_ks=" in v.figure and "length_ks=" in v.figure
    assert "kv_ratio_median=" in v.figure and "kv_ratio_clipped=" in v.figure
    ratio = next(e for e in v.evidence if e.name == "kv_log_ratio")
    assert len(ratio.with_) == lagged  # one log ratio per kv-lagged sampled token


def test_the_log_ratio_of_a_token_is_zero_when_the_weights_did_not_change(
    recipe_and_model: tuple[object, Path],
) -> None:
    """Rescoring lines up with the sampled positions: marked kv-lagged, tokens sampled by
    the very weights that rescore them have log ratio 0 (batch-invariant fp32)."""
    from agentroll.rollout.engine import RolloutEngine
    from agentroll.run.build import rollout_config
    from agentroll.validate.recipe import _engine, _lagged_log_ratios, _tasks, ratio_figure

    recipe, model = recipe_and_model

    async def run() -> list[float]:
        env, tasks = _tasks(recipe, 4)  # type: ignore[arg-type]
        async with (
            _engine(recipe, model) as backend,  # type: ignore[arg-type]
            RolloutEngine(backend, env, rollout_config(recipe)) as engine,  # type: ignore[arg-type]
        ):
            trajs = [t async for t in engine.run(tasks)]
            for t in trajs:
                t.kv_version = t.policy_version - 1  # as if every token attended to old KV
            return await _lagged_log_ratios(backend, trajs)

    ratios = asyncio.run(run())
    assert ratios and max(abs(r) for r in ratios) < 1e-4
    assert ratio_figure(ratios, 0.2)[0]
    ok, figure = ratio_figure([0.0, 0.5, -0.5, 0.0], 0.2)  # half of them beyond the band
    assert not ok and "kv_ratio_clipped=0.500" in figure


def test_rolling_updates_are_compared_with_an_update_at_once(tmp_path: Path) -> None:
    from agentroll.run.loop import prepare_model

    repo = Path(__file__).resolve().parents[2]
    text = RECIPE.format(traces=repo / "examples/data/calculator_traces.jsonl")
    recipe = parse_recipe(text.replace("[backend]\n", "[backend]\nreplicas = 2\n"))
    model = prepare_model(recipe, tmp_path)
    (v,) = validate_recipe(recipe, model, episodes=16, only="rolling_updates")
    assert v.verdict == "pass", v.figure
    assert "replicas=2 versions=[0, 1]" in v.figure  # episodes really ran on mixed versions


def test_staleness_on_a_model_with_nothing_to_learn_fails_instead_of_passing_vacuously(
    recipe_and_model: tuple[object, Path],
) -> None:
    from agentroll.validate.recipe import staleness_lag

    recipe, model = recipe_and_model
    assert staleness_lag(recipe) == 1  # type: ignore[arg-type]
    (v,) = validate_recipe(recipe, model, episodes=16, only="bounded_staleness")  # type: ignore[arg-type]
    # an untrained tiny model solves nothing: every advantage is 0 and the weights stay put
    assert v.verdict == "fail" and "max_weight_change=0: " in v.figure
    assert "nothing to learn" in v.figure


def test_reward_curves_start_from_the_same_weights_and_run_their_steps(
    recipe_and_model: tuple[object, Path],
) -> None:
    from agentroll.validate.recipe import reward_curve

    recipe, model = recipe_and_model
    on_policy = reward_curve(recipe, model, lag=0, steps=2)  # type: ignore[arg-type]
    stale = reward_curve(recipe, model, lag=1, steps=2)  # type: ignore[arg-type]
    assert len(on_policy) == len(stale) == 2
    assert on_policy[0] == stale[0]  # step 0 samples the starting weights either way
    assert all(0.0 <= r <= 1.0 for r in on_policy + stale)


def test_admission_compares_what_the_trainer_keeps_with_everything_sampled(
    recipe_and_model: tuple[object, Path], tmp_path: Path
) -> None:
    from agentroll.validate.recipe import consumed_episodes

    recipe, model = recipe_and_model
    every, kept = asyncio.run(consumed_episodes(recipe, model, 16, admission=True))  # type: ignore[arg-type]
    assert len(every) == 16 and {t.id for t in kept} <= {t.id for t in every}
    # the stand-in trainer stepped (a batch of 2 groups, 4 in flight): versions really moved
    assert max(int(t.policy_version.max()) for t in every) >= 1
    (v,) = validate_recipe(recipe, model, episodes=16, only="admission_control")  # type: ignore[arg-type]
    assert v.risk == "distribution" and v.verdict == "pass", v.figure
    assert "batch=4 concurrency=4 " in v.figure and "dropped=" in v.figure and "reward_" in v.figure
    assert {e.name for e in v.evidence} == {"logprob", "length", "reward", "tool_calls"}
    report = write_report([v], tmp_path / "validate", "t").read_text()
    png = tmp_path / "validate" / "admission_control.png"
    assert "![admission_control](admission_control.png)" in report
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_kv_lag_curve_trains_on_batches_with_kv_lagged_tokens(
    recipe_and_model: tuple[object, Path],
) -> None:
    from agentroll.validate.recipe import kv_lag_curve

    recipe, model = recipe_and_model
    rewards, lagged = kv_lag_curve(recipe, model, steps=2)  # type: ignore[arg-type]
    assert len(rewards) == 2 and lagged > 0  # the second batch's update landed mid-generation


@pytest.mark.parametrize(
    ("stats", "verdict", "shows"),
    [
        ({"hits": 40, "misses": 24, "verified": 4, "impure": []}, "pass", "hits=40 misses=24"),
        ({"hits": 40, "misses": 24, "verified": 4, "impure": ["clock"]}, "fail", "impure=clock"),
        ({"hits": 0, "misses": 64, "verified": 0, "impure": []}, "fail", "use more --episodes"),
    ],
    ids=["served", "impure", "no-hit"],
)
def test_the_tool_cache_check_fails_an_impure_tool_and_a_run_with_nothing_cached(
    monkeypatch: pytest.MonkeyPatch,
    recipe_and_model: tuple[object, Path],
    stats: dict[str, object],
    verdict: str,
    shows: str,
) -> None:
    import msgspec

    from agentroll.validate import recipe as mod

    seen: list[dict[str, object]] = []

    async def fake(
        recipe: object, model: Path, episodes: int, *, rollout: dict[str, object], **kw: object
    ) -> list[Trajectory]:
        seen.append(rollout)
        if isinstance(kw.get("tool_cache"), dict):
            kw["tool_cache"].update(stats)  # type: ignore[union-attr]
        return _run(seed=len(seen), n=episodes)

    monkeypatch.setattr(mod, "recipe_episodes", fake)
    recipe, model = recipe_and_model
    on = msgspec.structs.replace(
        recipe,  # type: ignore[type-var]
        rollout=msgspec.structs.replace(recipe.rollout, tool_cache=True),  # type: ignore[attr-defined]
    )
    (v,) = validate_recipe(on, model, episodes=64, only="tool_cache")
    assert (v.risk, v.verdict) == ("distribution", verdict), v.figure
    assert shows in v.figure
    assert seen == [{"tool_cache": True}, {"tool_cache": False}]


def test_group_prefill_sharing_keeps_every_token_and_shares_the_prompts(
    recipe_and_model: tuple[object, Path],
) -> None:
    recipe, model = recipe_and_model
    (v,) = validate_recipe(recipe, model, episodes=16, only="group_prefill_sharing")  # type: ignore[arg-type]
    assert (v.risk, v.verdict) == ("token_parity", "pass"), v.figure
    shared, prompts = map(int, v.figure.split()[0].removeprefix("shared_tokens=").split("/"))
    assert 0 < shared < prompts


def test_early_group_cutoff_compares_the_advantages_with_and_without(
    recipe_and_model: tuple[object, Path],
) -> None:
    import msgspec

    recipe, model = recipe_and_model
    rollout = msgspec.structs.replace(
        recipe.rollout,  # type: ignore[attr-defined]
        samples_per_task=4,
        group_cutoff=0.5,
        concurrency=1,  # one at a time: two finish, then the group is decided
    )
    on = msgspec.structs.replace(recipe, rollout=rollout)  # type: ignore[type-var]
    (v,) = validate_recipe(on, model, episodes=16, only="early_group_cutoff")
    assert v.risk == "distribution" and v.verdict == "pass", v.figure
    cut, total = map(int, v.figure.split("cut=")[1].split()[0].split("/"))
    assert total == 16 and cut == 8  # every group decided after two: two stragglers cut
    assert "advantage_ks=" in v.figure and {e.name for e in v.evidence} == {"advantage", "reward"}


def test_colocated_training_and_partial_rollouts_are_checked(tmp_path: Path) -> None:
    from agentroll.run.loop import prepare_model

    # long-tailed episodes (one task in four takes eight turns): stragglers at each switch
    text = RECIPE.replace(
        'name = "calculator"\nkwargs = {{ num_tasks = 16, max_operand = 9, traces = "{traces}" }}',
        'name = "agentroll.testing:LongTail"\nkwargs = { num_tasks = 16, long_turns = 8, every = 4 }',
    )
    recipe = parse_recipe(text + '\n[placement]\nmode = "colocated"\n').resolved(tmp_path)
    assert recipe.environment.name == "agentroll.testing:LongTail"
    model = prepare_model(recipe, tmp_path)
    (partial,) = validate_recipe(recipe, model, episodes=16, only="partial_rollouts")
    (colocated,) = validate_recipe(recipe, model, episodes=16, only="colocated")
    assert (partial.risk, partial.verdict) == ("distribution", "pass"), partial.figure
    assert int(partial.figure.split("parked=")[1].split()[0]) > 0
    assert (colocated.risk, colocated.verdict) == ("end_to_end", "pass"), colocated.figure
    assert "steps=8 reward_start=" in colocated.figure
    assert [e.kind for e in colocated.evidence] == ["curve"]


def test_sandbox_prewarm_keeps_every_token(recipe_and_model: tuple[object, Path]) -> None:
    import msgspec

    recipe, model = recipe_and_model
    rollout = msgspec.structs.replace(recipe.rollout, prewarm_sandboxes=True)  # type: ignore[attr-defined]
    on = msgspec.structs.replace(recipe, rollout=rollout)  # type: ignore[type-var]
    (v,) = validate_recipe(on, model, episodes=8, only="sandbox_prewarm")
    assert (v.risk, v.verdict) == ("token_parity", "pass"), v.figure
    assert "differ=0" in v.figure


def test_autoscale_is_compared_with_fixed_capacity(tmp_path: Path) -> None:
    from agentroll.run.loop import prepare_model

    repo = Path(__file__).resolve().parents[2]
    text = RECIPE.format(traces=repo / "examples/data/calculator_traces.jsonl")
    text = text.replace("[backend]\n", "[backend]\nreplicas = 2\n")
    # a window per step and a narrow band: the tiny trainer is the slow side, so the
    # autoscaler hands it a replica's core within the run
    text += "\n[placement]\nautoscale = true\nwindow_steps = 1\nautoscale_band = 0.05\n"
    recipe = parse_recipe(text).resolved(tmp_path)
    model = prepare_model(recipe, tmp_path)
    (v,) = validate_recipe(recipe, model, episodes=32, only="autoscale")
    assert (v.risk, v.verdict) == ("distribution", "pass"), v.figure
    assert int(v.figure.split("moves=")[1].split()[0]) >= 1
    assert {e.name for e in v.evidence} == {"reward", "length"}
