"""Small filesystem helpers shared by the on-disk records (episode checkpoints, request
snapshots).

Invariant: ``atomic_dir`` either leaves the complete new directory at ``path`` (replacing
an older one) or leaves ``path`` as it was; its temporary directory never survives.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


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
