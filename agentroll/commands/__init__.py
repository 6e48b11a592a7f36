"""The subcommands of ``agentroll``: one module each, exposing ``add_arguments(parser)`` and
``main(args) -> int``, which call into the product modules (argparse stays here, never there).

A subcommand's module is imported only when its parser is used, so ``agentroll --help`` and
``agentroll bench --help`` import no subcommand, benchmark or torch.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any, Protocol, cast


class Subcommand(Protocol):
    """What a subcommand or benchmark module exposes."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def main(self, args: argparse.Namespace) -> int: ...


def load(module: str) -> Subcommand:
    """The subcommand module named by its dotted path."""
    return cast(Subcommand, importlib.import_module(module))


class LazyParser(argparse.ArgumentParser):
    """A subparser that imports ``module`` and lets it add its arguments on first use.

    ``add_subparsers(parser_class=LazyParser)`` then ``add_parser(name, module=...)``; a
    parser without ``module`` (a nested subparser a module adds itself) is a plain one.
    """

    def __init__(self, *args: Any, module: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._module = module

    def load(self) -> None:
        """Add the module's arguments (once; imports the module)."""
        if self._module is not None:
            module, self._module = self._module, None
            load(module).add_arguments(self)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self.load()
        return super().parse_known_args(args, namespace)
