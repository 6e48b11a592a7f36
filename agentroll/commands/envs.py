"""``agentroll envs``: one line per built-in environment (module name, first docstring line)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``envs`` takes no options."""


def main(args: argparse.Namespace) -> int:
    import pkgutil

    import agentroll.environments as builtin
    from agentroll.env import environment_class

    # a module whose name starts with "_" holds an environment's data, not an environment
    modules = pkgutil.iter_modules(builtin.__path__)
    for name in sorted(m.name for m in modules if not m.name.startswith("_")):
        doc = (environment_class(name).__doc__ or "").strip().splitlines()
        print(f"{name:16s} {doc[0] if doc else ''}")
    return 0
