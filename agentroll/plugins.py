"""Plugins: the names a recipe or a config chooses, resolved to built-ins or entry points.

A name resolves to a built-in first (implemented where the choice is made), then to an entry
point another package registers in the group; an unknown name is a ``ConfigError`` saying
how to register one.  Invariants: nothing is read at import; entry points are looked up
only for a name that is not built in; a loaded plugin is kept (per group, by name).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Collection
from typing import Any

from agentroll.errors import ConfigError


class PluginGroup:
    """One kind of pluggable choice: its entry point ``group``, the ``builtin`` names (a live
    collection: a dict's keys count as they are when a name is looked up), the word for it
    in errors and the ``contract`` of what an entry point names.

    What an entry point names, per group (``pyproject.toml`` of the plugin package:
    ``[project.entry-points."agentroll.sandboxes"]`` then ``mine = "my_pkg.sandbox:MySandbox"``):

    - ``agentroll.backends``: ``factory(recipe, model_dir, index) -> Backend``, called once per
      replica (``index`` 0 .. ``backend.replicas - 1``) with the whole ``Recipe``; the replicas
      join a fleet as the built-in kinds do.
    - ``agentroll.sandboxes``: ``factory(config, *, episode_id) -> Sandbox`` (a ``Sandbox``
      subclass whose ``__init__`` takes a ``SandboxConfig`` and ``episode_id=None``), not yet
      started; ``config.options`` carries the recipe's ``sandbox.options``.
    - ``agentroll.tool_parsers``: ``factory() -> ToolParser`` (a class with a ``parse`` method
      that never raises), called once per rollout engine.
    - ``agentroll.trainers``: an ``agentroll.trainer.algorithm.Algorithm``: the advantage
      estimator and the per-token objective the reference trainer uses (either may stay the
      GRPO default).  A whole trainer is no plugin: an external one consumes the stream.
    """

    def __init__(self, group: str, what: str, builtin: Collection[str], contract: str) -> None:
        self.group = group
        self.what = what
        self.builtin = builtin
        self.contract = contract
        # loaded plugins by name: a sandbox is opened per episode, and a scan of the
        # installed distributions costs milliseconds
        self._loaded: dict[str, Any] = {}

    def over(self, builtin: Collection[str]) -> PluginGroup:
        """This group with other built-in names (``agentroll.chat`` passes its live
        ``TOOL_PARSERS``, which code may extend at run time)."""
        return PluginGroup(self.group, self.what, builtin, self.contract)

    def installed(self) -> dict[str, list[importlib.metadata.EntryPoint]]:
        """Entry points of the group by name, leaving out names a built-in takes (a name
        registered twice with different targets keeps both, for the error)."""
        out: dict[str, list[importlib.metadata.EntryPoint]] = {}
        for ep in importlib.metadata.entry_points(group=self.group):
            if ep.name in self.builtin:
                continue
            found = out.setdefault(ep.name, [])
            if all(e.value != ep.value for e in found):  # a distribution seen twice on the path
                found.append(ep)
        return out

    def names(self) -> list[str]:
        """The built-in names, then the installed ones (sorted)."""
        return [*self.builtin, *sorted(self.installed())]

    def _unknown(self, name: str, field: str | None) -> ConfigError:
        installed = sorted(self.installed())
        return ConfigError(
            f"{field or self.what} {name!r} is unknown; built-in: {', '.join(self.builtin)}; "
            f"installed: {', '.join(installed) or 'none'}; a package adds one with an entry "
            f'point in group "{self.group}" naming {self.contract} (pyproject.toml: '
            f'[project.entry-points."{self.group}"] {name} = "module:attr")'
        )

    def _entry_point(self, name: str, field: str | None) -> importlib.metadata.EntryPoint:
        found = self.installed().get(name, [])
        if not found:
            raise self._unknown(name, field)
        if len(found) > 1:
            targets = ", ".join(repr(ep.value) for ep in found)
            raise ConfigError(
                f"{field or self.what} {name!r} is registered more than once in group "
                f'"{self.group}" ({targets}); uninstall one of the packages'
            )
        return found[0]

    def check(self, name: str, *, field: str | None = None) -> None:
        """Raise ``ConfigError`` unless ``name`` is built in or installed (nothing is
        imported).  ``field`` names the setting in the error (e.g. ``backend.kind``)."""
        if name not in self.builtin and name not in self._loaded:
            self._entry_point(name, field)

    def load(self, name: str, *, field: str | None = None) -> Any:
        """The object the entry point ``name`` names (not for built-in names: their callers
        implement them).  Raises ``ConfigError`` when it is unknown, ambiguous, or cannot be
        imported.  A loaded plugin is kept: later calls return the same object."""
        if name in self._loaded:
            return self._loaded[name]
        ep = self._entry_point(name, field)
        try:
            self._loaded[name] = ep.load()
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"{field or self.what} {name!r}: entry point {ep.value!r} of group "
                f'"{self.group}" cannot be loaded: {exc}'
            ) from exc
        return self._loaded[name]


BACKENDS = PluginGroup(
    "agentroll.backends",
    "backend kind",
    ("torch", "mock", "vllm", "http"),
    "a factory(recipe, model_dir, index) -> Backend",
)
SANDBOXES = PluginGroup(
    "agentroll.sandboxes",
    "sandbox backend",
    ("local", "docker"),
    "a factory(config, *, episode_id) -> Sandbox",
)
TOOL_PARSERS = PluginGroup(
    "agentroll.tool_parsers",
    "tool parser",
    ("hermes", "qwen3_coder", "llama3_json", "mistral", "deepseek_v3"),
    "a factory() -> ToolParser",
)
TRAINERS = PluginGroup(
    "agentroll.trainers",
    "trainer algorithm",
    ("grpo",),
    "an agentroll.trainer.algorithm.Algorithm",
)


__all__ = ["BACKENDS", "SANDBOXES", "TOOL_PARSERS", "TRAINERS", "PluginGroup"]
