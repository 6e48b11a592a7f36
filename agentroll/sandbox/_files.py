"""Working-directory helpers of the local sandbox: create, snapshot (tar), restore, delete.

Invariants: a restore unpacks into a staging directory first and refuses members that leave
the directory (absolute paths, ``..``, outward links), so a bad blob leaves the working
directory untouched; deletion also removes directories a command left without permissions.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

_TMP_DIRNAME = ".tmp"  # TMPDIR of plain (non-bubblewrap) commands; not part of snapshots


def _make_workdir(make_tmp: bool) -> Path:
    workdir = Path(tempfile.mkdtemp(prefix="agentroll-sb-")).resolve()
    if make_tmp:
        (workdir / _TMP_DIRNAME).mkdir()
    return workdir


def _pack(workdir: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(os.listdir(workdir)):
            if name != _TMP_DIRNAME:
                tar.add(workdir / name, arcname=name)
    return buf.getvalue()


def _unpack(blob: bytes, workdir: Path, make_tmp: bool) -> None:
    staging = Path(tempfile.mkdtemp(prefix=".agentroll-restore-", dir=workdir.parent))
    try:
        try:
            with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
                members = tar.getmembers()
                for member in members:
                    parts = PurePosixPath(member.name).parts
                    if member.name.startswith("/") or ".." in parts:
                        raise ValueError(f"snapshot member {member.name!r} leaves the directory")
                # The "data" filter refuses links leaving the directory, devices, and so on.
                tar.extractall(staging, members=members, filter="data")
        except tarfile.TarError as exc:
            raise ValueError(f"not a usable sandbox snapshot: {exc}") from exc
        _empty(workdir)
        for entry in os.listdir(staging):
            os.replace(staging / entry, workdir / entry)
        if make_tmp:
            (workdir / _TMP_DIRNAME).mkdir(exist_ok=True)
    finally:
        _rmtree(staging)


def _empty(directory: Path) -> None:
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            _rmtree(Path(entry.path))
        else:
            os.unlink(entry.path)


def _rmtree(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except PermissionError:
        # A command may leave directories without write or search permission; we own them.
        os.chmod(path, 0o700)
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                with contextlib.suppress(OSError):
                    if not os.path.islink(os.path.join(root, name)):
                        os.chmod(os.path.join(root, name), 0o700)
        shutil.rmtree(path)
