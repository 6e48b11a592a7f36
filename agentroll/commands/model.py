"""``agentroll model sizes | create-tiny``: model checkpoint sizes, and the tiny checkpoint."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from agentroll.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TinyModelConfig:
    """The options of ``agentroll model create-tiny``: a hidden size of whole 64-wide heads."""

    dir: str
    seed: int
    layers: int
    hidden: int

    def __post_init__(self) -> None:
        if self.hidden % 64 or self.hidden < 64:
            raise ConfigError(
                f"--hidden must be a positive multiple of 64 (head_dim is 64), got "
                f"{self.hidden}; use 64, 128, 192, ..."
            )

    @property
    def heads(self) -> int:
        return self.hidden // 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", required=True)
    sizes = sub.add_parser("sizes", help="training-state vs inference-export sizes of a model")
    sizes.add_argument(
        "target",
        metavar="MODEL",
        help="checkpoint dir (with config.json) or a parameter count, e.g. 70e9",
    )
    sizes.add_argument("--dtype", default="bfloat16", help="serving dtype of the inference export")
    tiny = sub.add_parser(
        "create-tiny", help="write the project-made tiny Qwen2 checkpoint (offline)"
    )
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--hidden", type=int, default=128, help="hidden size (heads x 64)")


def _sizes(args: argparse.Namespace) -> int:
    from agentroll.model.sizes import sizes_for_checkpoint, sizes_for_params

    try:
        result = sizes_for_params(int(float(args.target)), args.dtype)
    except ValueError:  # not a number: a checkpoint directory
        result = sizes_for_checkpoint(args.target, args.dtype)
    print(result.line())
    return 0


def _create_tiny(args: argparse.Namespace) -> int:
    from agentroll.model.tiny import create_tiny

    config = TinyModelConfig(args.dir, args.seed, args.layers, args.hidden)
    out = create_tiny(
        config.dir,
        seed=config.seed,
        layers=config.layers,
        hidden=config.hidden,
        heads=config.heads,
    )
    print(f"wrote {out}")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.model_command == "sizes":
        return _sizes(args)
    return _create_tiny(args)
