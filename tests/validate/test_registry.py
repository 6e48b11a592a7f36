"""The optimisation registry: every recipe field is classified, names and classes are
checked, and a recipe's enabled optimisations follow its settings."""

from __future__ import annotations

import pytest

from agentroll.errors import ConfigError
from agentroll.run.recipe import Recipe, parse_recipe
from agentroll.validate.registry import (
    NOT_OPTIMISATIONS,
    OPTIMISATIONS,
    RISK_CLASSES,
    enabled,
)


def recipe_fields() -> set[str]:
    out = set()
    for section in Recipe.__struct_fields__:
        kind = type(getattr(Recipe(), section))
        out |= {f"{section}.{f}" for f in kind.__struct_fields__}
    return out


def test_every_recipe_field_is_an_optimisation_or_says_why_not() -> None:
    owned = {f for o in OPTIMISATIONS for f in o.fields}
    fields = recipe_fields()
    unclassified = fields - owned - set(NOT_OPTIMISATIONS)
    assert not unclassified, (
        f"recipe fields {sorted(unclassified)} select no registered optimisation: register "
        "them in agentroll/validate/registry.py (OPTIMISATIONS) with their risk class, or "
        "list them in NOT_OPTIMISATIONS with the reason"
    )
    assert not (owned & set(NOT_OPTIMISATIONS)), "a field is both an optimisation and not"
    assert owned | set(NOT_OPTIMISATIONS) <= fields, "the registry names fields that do not exist"


def test_names_are_unique_and_classes_known() -> None:
    names = [o.name for o in OPTIMISATIONS]
    assert len(names) == len(set(names))
    assert {o.risk for o in OPTIMISATIONS} <= set(RISK_CLASSES)
    assert all(o.check.split(":")[0] == o.risk for o in OPTIMISATIONS)


def test_enabled_follows_the_recipe() -> None:
    default = {o.name for o in enabled(Recipe())}
    assert {"delta_sync", "pause_keep", "bounded_staleness", "cpu_kernels"} <= default
    assert "bf16_serving" not in default and "autoscale" not in default
    r = parse_recipe(
        "[backend]\ndtype = 'bfloat16'\n[buffer]\nmax_staleness = 0\n"
        "[sync]\nencoding = 'full'\npolicy = 'recompute'\n"
    )
    names = {o.name for o in enabled(r)}
    assert "bf16_serving" in names
    assert not names & {
        "delta_sync",
        "pause_keep",
        "bounded_staleness",
        "keep_kv_under_new_weights",
    }
    assert [o.risk for o in enabled(Recipe(), risk="unit")] == ["unit"] * len(
        enabled(Recipe(), risk="unit")
    )
    assert [o.name for o in enabled(Recipe(), only="delta_sync")] == ["delta_sync"]


def test_bad_selections_say_what_exists() -> None:
    with pytest.raises(ConfigError, match="unknown optimisation 'nope'; known: delta_sync"):
        enabled(Recipe(), only="nope")
    with pytest.raises(ConfigError, match="unknown risk class"):
        enabled(Recipe(), risk="vibes")
    with pytest.raises(ConfigError, match="does not turn 'bf16_serving' on"):
        enabled(Recipe(), only="bf16_serving")
