"""Working-directory helpers of the local sandbox: create, snapshot (tar), restore, delete,
and reap the ones a dead process left behind.

Invariants: a bad restore blob leaves the working directory untouched; deletion also removes
directories a command left without permissions; a directory whose owner runs, or whose name
carries no owner, is never reaped.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import io
import logging
import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from agentroll.sandbox._owner import HOST, me, owner_alive

log = logging.getLogger("agentroll.sandbox")

_TMP_DIRNAME = ".tmp"  # TMPDIR of plain (non-bubblewrap) commands; not part of snapshots
_WORKDIR_PREFIX = "agentroll-sb-"
_STAGING_PREFIX = ".agentroll-restore-"


_HOST_TAG = hashlib.blake2s(HOST.encode(), digest_size=4).hexdigest()


def _owner_tag() -> str:
    pid, ticks = me()
    return f"{_HOST_TAG}.{pid}.{ticks}-"


def workdir_owner(name: str, host_tag: str = _HOST_TAG) -> tuple[int, str] | None:
    """``(pid, start ticks)`` of the process on this host (``host_tag``) that made the
    working or staging directory called ``name``; None for other names, for directories made
    on another host (a shared temp directory, a container's pid namespace) and for those of
    older versions (no owner in the name)."""
    for prefix in (_WORKDIR_PREFIX, _STAGING_PREFIX):
        if name.startswith(prefix):
            tag = name[len(prefix) :].split("-", 1)
            parts = tag[0].split(".")
            if len(tag) == 2 and len(parts) == 3 and parts[0] == host_tag:
                pid, ticks = parts[1], parts[2]
                if pid.isdigit() and ticks.isdigit():
                    return int(pid), ticks
    return None


def reap_workdirs(
    root: str | Path | None = None,
    *,
    alive: Callable[[int, str], bool] = owner_alive,
) -> list[Path]:
    """Remove the sandbox directories under ``root`` (default: the temp directory) whose
    owner process is gone; returns what was removed.  Blocking.

    Working and staging directories are named after the process that made them
    (``agentroll-sb-<host tag>.<pid>.<start ticks>-*``, the host tag from ``_owner.HOST``), so a
    process killed before it could clean up (``kill -9``, OOM) leaves directories that this
    removes later.  A restore unpacks into a staging directory first and refuses members that
    leave the directory (absolute paths, ``..``, outward links).
    """
    base = Path(root if root is not None else tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        owner = workdir_owner(entry.name)
        if owner is None or not entry.is_dir(follow_symlinks=False) or alive(*owner):
            continue
        try:
            unmount(Path(entry.path))
            _rmtree(Path(entry.path))
        except OSError as exc:  # another process reaping the same directory, or not ours
            log.debug("could not reap %s: %s", entry.path, exc)
            continue
        removed.append(Path(entry.path))
    return removed


_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def mount_tmpfs(path: Path, *, size_bytes: int, mode: int = 0o711) -> None:
    """Mount a tmpfs of ``size_bytes`` on ``path`` (root-owned, ``mode``, nosuid, nodev).
    Needs root (CAP_SYS_ADMIN); raises ``OSError`` otherwise."""
    opts = f"size={size_bytes},mode={mode:o},uid=0,gid=0".encode()
    if _c().mount(b"tmpfs", str(path).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount tmpfs on {path}: {os.strerror(code)}")


def unmount(path: Path) -> None:
    """Detach a mount on ``path`` if there is one (lazily: busy files keep it alive)."""
    if not os.path.ismount(path):
        return
    if _c().umount2(str(path).encode(), _MNT_DETACH) != 0:
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):
            raise OSError(code, f"umount {path}: {os.strerror(code)}")


def _make_workdir(make_tmp: bool) -> Path:
    workdir = Path(tempfile.mkdtemp(prefix=_WORKDIR_PREFIX + _owner_tag())).resolve()
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
    staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX + _owner_tag(), dir=workdir.parent))
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
