"""Plugins: a name resolves to a built-in first, then to an entry point; an unknown one is a
ConfigError that lists the known names and says how to register one; a package installed
outside agentroll adds a backend, sandbox, tool parser and trainer algorithm that a recipe
then selects and runs."""

from __future__ import annotations

import importlib.metadata
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from agentroll import chat, plugins
from agentroll.errors import ConfigError
from agentroll.plugins import PluginGroup
from agentroll.run.recipe import parse_recipe

EXT = Path(__file__).resolve().parent / "ext_package" / "agentroll_ext_demo.py"


class Target:
    """What the synthetic entry points name."""


def fake_entry_points(monkeypatch: pytest.MonkeyPatch, *eps: tuple[str, str, str]) -> list[str]:
    """Replace the installed entry points by ``(name, value, group)``; returns the groups
    asked for, in order."""
    asked: list[str] = []
    points = [importlib.metadata.EntryPoint(n, v, g) for n, v, g in eps]

    def entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        asked.append(group)
        return [ep for ep in points if ep.group == group]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return asked


GROUP = PluginGroup("agentroll.widgets", "widget", ("plain", "fancy"), "a factory() -> Widget")


def test_a_built_in_name_resolves_without_looking_at_entry_points(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = fake_entry_points(monkeypatch, ("plain", "elsewhere:Shadow", "agentroll.widgets"))
    group = PluginGroup(GROUP.group, GROUP.what, GROUP.builtin, GROUP.contract)
    group.check("plain")
    assert asked == []
    assert group.names() == ["plain", "fancy"]  # a built-in shadows an entry point's name


def test_an_entry_point_resolves_and_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = fake_entry_points(
        monkeypatch,
        ("mine", f"{__name__}:Target", "agentroll.widgets"),
        ("other", f"{__name__}:Target", "agentroll.gadgets"),
    )
    group = PluginGroup(GROUP.group, GROUP.what, GROUP.builtin, GROUP.contract)
    assert group.names() == ["plain", "fancy", "mine"]
    assert group.load("mine") is Target
    asked.clear()
    assert group.load("mine") is Target
    group.check("mine")
    assert asked == []  # loaded once: no further scan of the installed distributions


def test_an_unknown_name_lists_the_known_ones_and_how_to_register(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_entry_points(monkeypatch, ("mine", f"{__name__}:Target", "agentroll.widgets"))
    group = PluginGroup(GROUP.group, GROUP.what, GROUP.builtin, GROUP.contract)
    with pytest.raises(ConfigError) as info:
        group.check("fancyy", field="widget.kind")
    message = str(info.value)
    assert message.startswith("widget.kind 'fancyy' is unknown; built-in: plain, fancy; ")
    assert "installed: mine;" in message
    assert '[project.entry-points."agentroll.widgets"] fancyy = "module:attr"' in message
    assert "a factory() -> Widget" in message
    with pytest.raises(ConfigError, match=r"^widget 'nope' is unknown"):
        group.load("nope")


def test_an_ambiguous_or_broken_entry_point_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_entry_points(
        monkeypatch,
        ("twice", f"{__name__}:Target", "agentroll.widgets"),
        ("twice", f"{__name__}:Target", "agentroll.widgets"),  # one package seen twice
        ("clash", "pkg_a:Widget", "agentroll.widgets"),
        ("clash", "pkg_b:Widget", "agentroll.widgets"),
        ("broken", "agentroll_no_such_module:Widget", "agentroll.widgets"),
    )
    group = PluginGroup(GROUP.group, GROUP.what, GROUP.builtin, GROUP.contract)
    assert group.load("twice") is Target
    with pytest.raises(ConfigError, match=r"'clash' is registered more than once.*pkg_a.*pkg_b"):
        group.check("clash")
    group.check("broken")  # found; importing it is what fails
    with pytest.raises(ConfigError, match=r"'broken': entry point .* cannot be loaded"):
        group.load("broken")


def test_every_built_in_name_is_implemented_where_it_is_chosen() -> None:
    from agentroll.sandbox import open_sandbox
    from agentroll.sandbox.base import SandboxConfig
    from agentroll.trainer.algorithm import GRPO, trainer_algorithm

    assert set(plugins.TOOL_PARSERS.builtin) <= set(chat.TOOL_PARSERS)
    for name in plugins.TOOL_PARSERS.builtin:
        assert chat.get_tool_parser(name) is chat.TOOL_PARSERS[name]
    for name in plugins.SANDBOXES.builtin:
        sandbox = open_sandbox(SandboxConfig(backend=name))  # created, not started
        assert type(sandbox).__module__ == f"agentroll.sandbox.{name}"
    assert [trainer_algorithm(n) for n in plugins.TRAINERS.builtin] == [GRPO]
    for name in plugins.BACKENDS.builtin:
        assert parse_recipe(f'[backend]\nkind = "{name}"\nurls = ["http://x"]\n')


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[backend]\nkind = "tpu"', "backend.kind"),
        ('[sandbox]\nbackend = "k8s"', "sandbox.backend"),
        ('[rollout]\ntool_parser = "json"', "rollout.tool_parser"),
        ('[trainer]\nalgorithm = "ppo"', "trainer.algorithm"),
    ],
)
def test_a_recipe_naming_an_unknown_plugin_is_refused_at_load(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_recipe(text, source="r.toml")
    message = str(info.value)
    assert message.startswith(f"r.toml: {field} "), message
    assert "is unknown; built-in: " in message and "entry-points" in message


# -- a package from outside agentroll --------------------------------------------------------

ENTRY_POINTS = """\
[agentroll.backends]
scripted = agentroll_ext_demo:make_backend

[agentroll.sandboxes]
subprocess = agentroll_ext_demo:SubprocessSandbox

[agentroll.tool_parsers]
call_line = agentroll_ext_demo:CallLineParser

[agentroll.trainers]
baseline_pg = agentroll_ext_demo:ALGORITHM
"""


@pytest.fixture
def ext_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``agentroll_ext_demo`` installed as a distribution on ``sys.path`` (its module and a
    ``.dist-info`` directory, as pip lays them out); the plugins it adds are forgotten
    afterwards."""
    site = tmp_path / "site"
    dist = site / "agentroll_ext_demo-0.1.dist-info"
    dist.mkdir(parents=True)
    shutil.copy(EXT, site / EXT.name)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: agentroll-ext-demo\nVersion: 0.1\n"
    )
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    for group in (plugins.BACKENDS, plugins.SANDBOXES, plugins.TRAINERS, chat._PARSER_PLUGINS):
        monkeypatch.setattr(group, "_loaded", {})
    monkeypatch.syspath_prepend(str(site))  # (invalidates the import caches)
    try:
        yield __import__("agentroll_ext_demo")
    finally:
        sys.modules.pop("agentroll_ext_demo", None)


RECIPE = """\
[environment]
name = "calculator"
kwargs = { num_tasks = 3, seed = 1 }

[backend]
kind = "scripted"
replicas = 2
max_num_seqs = 8

[rollout]
concurrency = 4
samples_per_task = 2
tool_parser = "call_line"

[sandbox]
backend = "subprocess"
options = { label = "ext" }

[trainer]
algorithm = "baseline_pg"
batch_size = 6
"""


async def test_a_recipe_runs_the_plugins_of_an_installed_package(
    ext_package: ModuleType, tiny_model: Path
) -> None:
    from agentroll.rollout.engine import RolloutEngine
    from agentroll.run.build import build_backend, build_environment, rollout_config
    from agentroll.run.loop import build_trainer

    recipe = parse_recipe(RECIPE)
    for group, name in [
        (plugins.BACKENDS, "scripted"),
        (plugins.SANDBOXES, "subprocess"),
        (plugins.TOOL_PARSERS, "call_line"),
        (plugins.TRAINERS, "baseline_pg"),
    ]:
        assert name in group.names()

    env = build_environment(recipe)
    assert env.sandbox_config is not None and env.sandbox_config.backend == "subprocess"
    backend = build_backend(recipe, tiny_model)
    async with backend, RolloutEngine(backend, env, rollout_config(recipe)) as engine:
        trajectories = [t async for t in engine.run(list(env.tasks()))]

    # every answer is right only if the parser found the call, the sandbox ran it and the
    # scripted backend read its result back
    assert len(trajectories) == 6
    assert [(t.status, t.reward) for t in trajectories] == [("ok", 1.0)] * 6
    assert sorted(ext_package.REPLICAS) == [0, 1]
    assert len(ext_package.COMMANDS) == 6 and ext_package.OPTIONS == [{"label": "ext"}] * 6

    trainer, algorithm = build_trainer(recipe, tiny_model)
    assert algorithm is ext_package.ALGORITHM
    batch = algorithm.collate(trajectories, pad_id=0)
    np.testing.assert_array_equal(batch.advantages.numpy(), np.full(6, 0.5, dtype=np.float32))
    stats = trainer.step(batch)
    assert stats.version == 1 and stats.grad_norm > 0
    assert sum(ext_package.OBJECTIVE_TOKENS) == int(stats.extra["loss_tokens"])


def test_a_plugin_of_the_wrong_kind_is_a_config_error(
    ext_package: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentroll.sandbox import open_sandbox
    from agentroll.sandbox.base import SandboxConfig
    from agentroll.trainer.algorithm import trainer_algorithm

    def not_a_sandbox(config: Any, *, episode_id: str | None = None) -> object:
        return object()

    monkeypatch.setitem(plugins.SANDBOXES._loaded, "subprocess", not_a_sandbox)
    with pytest.raises(ConfigError, match="made a object, not a Sandbox"):
        open_sandbox(SandboxConfig(backend="subprocess"))
    monkeypatch.setitem(plugins.TRAINERS._loaded, "baseline_pg", ext_package.truncated_pg)
    with pytest.raises(ConfigError, match=r"must name an agentroll\.trainer\.algorithm\.Algorithm"):
        trainer_algorithm("baseline_pg")
    monkeypatch.setitem(chat._PARSER_PLUGINS._loaded, "call_line", object)
    with pytest.raises(ConfigError, match="without a parse"):
        chat.get_tool_parser("call_line")
