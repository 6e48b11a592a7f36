"""The autoscaler's decisions on synthetic idle fractions: direction, hysteresis, bounds."""

from __future__ import annotations

import pytest

from agentroll.errors import ConfigError
from agentroll.run.autoscale import AutoscaleConfig, Autoscaler, Capacity


def scaler(**kw: int | float) -> Autoscaler:
    config = AutoscaleConfig(**{"cores": 2, "max_replicas": 3, **kw})  # type: ignore[arg-type]
    return Autoscaler(config, Capacity(2, 1))


def test_a_trainer_short_of_capacity_gets_a_replicas_thread_after_patience() -> None:
    a = scaler(patience=2)
    assert a.observe(rollout_idle=0.5, trainer_idle=0.05) is None  # one window is not enough
    d = a.observe(rollout_idle=0.45, trainer_idle=0.05)
    assert d is not None and d.direction == "to_trainer"
    assert (d.before, d.after) == (Capacity(2, 1), Capacity(1, 2))
    assert a.capacity == Capacity(1, 2)
    # the decision rests on the mean of the windows, and records it
    assert abs(d.rollout_idle - 0.475) < 1e-9 and "rollout idle 48%" in d.reason


def test_rollout_short_of_capacity_takes_a_thread_back_when_the_cores_are_taken() -> None:
    a = Autoscaler(AutoscaleConfig(cores=2, patience=1), Capacity(1, 2))
    d = a.observe(rollout_idle=0.0, trainer_idle=0.6)
    assert d is not None and d.direction == "to_rollout" and d.after == Capacity(2, 1)


def test_free_cores_are_not_taken_from_the_trainer() -> None:
    a = Autoscaler(AutoscaleConfig(cores=8, patience=1), Capacity(1, 2))
    d = a.observe(rollout_idle=0.0, trainer_idle=0.6)
    assert d is not None and d.after == Capacity(2, 2)


def test_within_the_band_nothing_moves_and_windows_that_disagree_cancel() -> None:
    a = scaler(patience=2, band=0.2)
    for _ in range(5):
        assert a.observe(0.3, 0.15) is None  # imbalance 0.15 <= band
    b = scaler(patience=2, band=0.2)
    assert b.observe(0.6, 0.0) is None
    assert b.observe(0.0, 0.6) is None  # the other direction: the mean is 0
    assert b.observe(0.6, 0.0) is None
    assert a.decisions == [] and b.decisions == []


def test_one_noisy_window_in_the_band_does_not_hold_a_clear_imbalance_back() -> None:
    a = scaler(patience=2, band=0.15)
    assert a.observe(0.30, 0.05) is None
    d = a.observe(0.17, 0.05)  # this window alone is within the band; the mean is not
    assert d is not None and d.direction == "to_trainer"


def test_cooldown_sits_out_windows_after_a_move() -> None:
    a = Autoscaler(AutoscaleConfig(cores=4, patience=1, cooldown=2, max_replicas=4), Capacity(1, 1))
    assert a.observe(0.0, 0.9) is not None
    assert a.observe(0.0, 0.9) is None
    assert a.observe(0.0, 0.9) is None
    d = a.observe(0.0, 0.9)
    assert d is not None and d.after.replicas == 3


def test_bounds_stop_moves() -> None:
    a = Autoscaler(AutoscaleConfig(cores=2, patience=1, cooldown=0, max_replicas=2), Capacity(2, 1))
    assert a.observe(0.0, 0.9) is None  # at max_replicas
    b = Autoscaler(AutoscaleConfig(cores=2, patience=1, cooldown=0), Capacity(1, 2))
    assert b.observe(0.9, 0.0) is None  # at min_replicas: nothing to hand over


def test_a_move_is_not_undone_unless_it_made_things_worse() -> None:
    a = Autoscaler(AutoscaleConfig(cores=2, patience=1, cooldown=0), Capacity(2, 1))
    first = a.observe(0.5, 0.0)  # imbalance 0.5 -> to the trainer
    assert first is not None and a.capacity == Capacity(1, 2)
    assert a.observe(0.0, 0.3) is None  # overshot, but 0.3 < 0.5: undoing would be worse
    assert a.capacity == Capacity(1, 2)
    back = a.observe(0.0, 0.7)  # now worse than before the move: undo it
    assert back is not None and back.direction == "to_rollout" and a.capacity == Capacity(2, 1)
    # and undoing that would bring back 0.7 > 0.6: it stays
    assert a.observe(0.6, 0.0) is None


@pytest.mark.parametrize(
    "kw",
    [
        {"band": 1.0},
        {"band": -0.1},
        {"patience": 0},
        {"cooldown": -1},
        {"min_replicas": 0},
        {"min_replicas": 3, "max_replicas": 2},
        {"min_trainer_threads": 0},
        {"cores": 0},
    ],
)
def test_bad_config_is_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        AutoscaleConfig(**kw)  # type: ignore[arg-type]


def test_fractions_outside_zero_one_are_refused() -> None:
    with pytest.raises(ValueError, match="fraction"):
        scaler().observe(1.5, 0.0)
