"""One exception tree for agentroll; every error names the boundary it crossed.

``AgentrollError`` is the root and its docstring draws the tree; ``ConfigError`` and
``CheckpointError`` are also ``ValueError``s, ``MissingDependencyError`` an ``ImportError``.
Foreign errors (OSError, httpx, docker, torch.distributed) are translated where they are
caught, with ``raise ... from exc``.  Cancellation is never translated.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class AgentrollError(Exception):
    """Base class of every error raised by agentroll.

    The tree, with what each error means:

        AgentrollError
        ├── ConfigError (ValueError)        bad user configuration; the message says what to change
        ├── MissingDependencyError (ImportError)  an optional extra is not installed
        ├── EnvError                        an environment hook (reset, reward, ...) failed
        ├── ToolError                       raised by tools to return an error text to the model
        ├── ToolCallParseError              the model's output holds a malformed tool call
        ├── ChatTemplateError               a chat template cannot be rendered incrementally
        ├── SandboxError                    the sandbox itself failed (not the command it ran)
        ├── BackendError                    the generation backend failed
        │   └── GenerationTimeout           one generation exceeded its stage timeout
        ├── EpisodeTimeout                  a whole episode exceeded its timeout
        ├── StreamError                     the trajectory stream failed (unreachable, refused)
        ├── CheckpointError (ValueError)    a checkpoint file is corrupt, truncated or unframed
        └── WeightSyncError                 a weight update was refused or failed (nothing changed)
    """


class ConfigError(AgentrollError, ValueError):
    """Invalid configuration; the message says which value to change and how."""


class MissingDependencyError(AgentrollError, ImportError):
    """An optional dependency is missing; the message gives the pip command."""

    def __init__(self, package: str, extra: str) -> None:
        super().__init__(
            f"{package} is not installed; install it with: pip install 'agentroll[{extra}]'"
        )
        self.package = package
        self.extra = extra


class EnvError(AgentrollError):
    """An environment hook raised; the original exception is the ``__cause__``."""


class ToolError(AgentrollError):
    """Raised by a tool to report a failure; its message is shown to the model verbatim."""


class ToolCallParseError(AgentrollError):
    """The model produced a tool call that cannot be parsed."""


class ChatTemplateError(AgentrollError):
    """A chat template cannot render a conversation incrementally (it rewrites history)."""


class SandboxError(AgentrollError):
    """The sandbox failed to start, run or clean up (a failing command is not an error)."""


class BackendError(AgentrollError):
    """The generation backend failed."""


class GenerationTimeout(BackendError):
    """A generation call exceeded its stage timeout."""


class EpisodeTimeout(AgentrollError):
    """An episode exceeded its whole-episode timeout."""


def require(module: str, extra: str) -> Any:
    """Import ``module`` or raise :class:`MissingDependencyError` naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(module, extra) from exc


class WeightSyncError(AgentrollError):
    """A weight update was refused (wrong base, bad checksum, unknown tensor, broken
    transport); the replica keeps its previous weights and version, bit for bit."""


class StreamError(AgentrollError):
    """The trajectory stream failed: worker unreachable, request refused, bad reply."""


class CheckpointError(AgentrollError, ValueError):
    """A checkpoint file (an episode checkpoint, or what a stop saved beside them) is
    corrupt, truncated or not in this version's framed format; ``path`` names the file.
    Nothing of it is used; the message says what happens instead."""

    def __init__(self, path: str | os.PathLike[str], message: str) -> None:
        super().__init__(message)
        self.path = Path(path)
