"""The bubblewrap command line of the local sandbox (pure: paths in, argv out).

Invariants: the host's system files are read-only and only the working directory (and a
size-capped ``/tmp``) is writable; a command runs with no capabilities, as uid/gid 1000 of
a user namespace it cannot nest, with no network (unless asked), IPC, UTS or cgroup
namespace of the host.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SANDBOX_UID = 1000  # the uid (and gid) a command has inside its user namespace

# Top-level system directories: bound read-only when they are directories, recreated as
# the same links when they are links (a merged-/usr host has /bin -> usr/bin).
_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# /etc files commands need (dynamic loader, alternatives links, time zone, name service
# configuration, certificates); nothing secret: no shadow, ssh, sudoers or credentials.
_ETC_FILES = (
    "alternatives",
    "ca-certificates",
    "ca-certificates.conf",
    "gai.conf",
    "host.conf",
    "hosts",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "mime.types",
    "nsswitch.conf",
    "protocols",
    "services",
    "ssl/certs",
    "timezone",
)


def passwd_lines(home: str = "/tmp") -> tuple[str, str]:
    """The synthetic ``/etc/passwd`` and ``/etc/group`` a command sees."""
    u = SANDBOX_UID
    passwd = f"root:x:0:0::/nonexistent:/usr/sbin/nologin\nsandbox:x:{u}:{u}::{home}:/bin/sh\n"
    group = f"root:x:0:\nsandbox:x:{u}:\n"
    return passwd, group


def make_etc(target: Path, host_root: Path = Path("/")) -> None:
    """Fill ``target`` with the sandbox's ``/etc``: copies of the host's non-secret files
    (links kept as links) and the synthetic passwd/group.  One bind of this directory costs
    less per exec than a bind per file.  Blocking."""
    for name in _ETC_FILES:
        src = host_root / "etc" / name
        dst = target / name
        if not src.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
        elif src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    resolv = host_root / "etc" / "resolv.conf"
    if resolv.is_file():  # its content: the link may point into /run, which is not bound
        shutil.copyfile(resolv, target / "resolv.conf")
    passwd, group = passwd_lines()
    (target / "passwd").write_text(passwd)
    (target / "group").write_text(group)
    for root, dirs, files in os.walk(target):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o644)
    os.chmod(target, 0o755)


def bwrap_argv(
    bwrap: str,
    *,
    workdir: Path,
    run_dir: Path,
    etc_dir: Path,
    tmp_bytes: int,
    network: bool,
    host_root: Path = Path("/"),
) -> list[str]:
    """The ``bwrap ... --`` prefix that runs a command in ``run_dir`` inside the sandbox.

    ``etc_dir`` is the sandbox's ``/etc`` (``make_etc``); ``host_root`` is where the host's
    system directories are looked up (a test may point it at a fake tree).

    What a command sees: the host's system binaries and libraries read-only (``/usr`` and the
    ``/bin``, ``/lib``... links or directories), a handful of non-secret ``/etc`` files, a
    synthetic ``/etc/passwd``, a fresh ``/proc`` of its own pid namespace, a minimal ``/dev``,
    a size-capped ``/tmp``, and its working directory read-write; the root itself is read-only.
    """
    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns"]
    if network:
        args.append("--share-net")
    args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    args += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    for name in _SYSTEM_DIRS:
        path = host_root / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), f"/{name}"]
        elif path.is_dir():
            args += ["--ro-bind", str(path), f"/{name}"]
    args += ["--ro-bind", str(etc_dir), "/etc"]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp"]
    args += ["--bind", str(workdir), str(workdir), "--chdir", str(run_dir)]
    # Last: the root tmpfs bwrap builds becomes read-only, so nothing can be written
    # outside /tmp and the working directory (both size-capped).
    args += ["--remount-ro", "/", "--"]
    return args
