"""Small filesystem helpers shared by the on-disk records (episode checkpoints, request
snapshots, the spool, weight directories, model directories).

Invariant: ``atomic_dir`` either leaves the complete new directory at ``path`` (replacing
an older one) or leaves ``path`` as it was; its temporary directory never survives.
``atomic_file`` is the same for one file, and durable: the file and the rename are fsync'd.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentroll.errors import ConfigError


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``path``; on success it becomes ``path``
    (an existing ``path`` is replaced), on error it is removed."""
    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``, with the same suffix (a format chosen by the
    name holds); once the body has written it, it is fsync'd, renamed over ``path`` and the
    directory fsync'd.  On error ``path`` is left as it was and the temporary file removed."""
    out = Path(path)
    tmp = out.with_name(f".{out.stem}.tmp{os.getpid()}{out.suffix}")
    tmp.unlink(missing_ok=True)
    try:
        yield tmp
        fsync_path(tmp)
        tmp.replace(out)
        fsync_path(out.parent)
    finally:
        tmp.unlink(missing_ok=True)


def fsync_path(path: str | Path) -> None:
    """fsync a file or a directory by its path (a directory: its entries become durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``ConfigError`` naming it when it is unreadable, not
    JSON, or not an object."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
