"""``agentroll envs``: one line per built-in environment (module name, first docstring line)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``envs`` takes no options."""


def main(args: argparse.Namespace) -> int:
    import pkgutil

    import agentroll.environments as builtin
    from agentroll.env import environment_class

    for name in sorted(m.name for m in pkgutil.iter_modules(builtin.__path__)):
        doc = (environment_class(name).__doc__ or "").strip().splitlines()
        print(f"{name:16s} {doc[0] if doc else ''}")
    return 0
