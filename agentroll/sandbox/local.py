"""The local sandbox: commands run as host processes, inside bubblewrap when it works here.

Invariants: every process of an ``exec`` is SIGKILLed when the command exits, times out or
is cancelled; a limit that cannot be enforced is named in a warning; the environment is
built from scratch; output is bounded; ``read_file``, ``write_file``, ``cwd`` and
``restore`` never reach outside the working directory.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import os
import resource
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from agentroll.errors import SandboxError
from agentroll.sandbox import _cgroup
from agentroll.sandbox._bwrap import bwrap_argv, make_etc
from agentroll.sandbox._files import (
    _HOST_TAG,
    _TMP_DIRNAME,
    _WORKDIR_PREFIX,
    _make_workdir,
    _owner_tag,
    _pack,
    _rmtree,
    _unpack,
    mount_tmpfs,
    reap_workdirs,
    unmount,
)
from agentroll.sandbox._owner import owner_alive
from agentroll.sandbox._process import _ExecProtocol, _kill_early, _kill_spawned, _killpg
from agentroll.sandbox.base import Sandbox, SandboxConfig
from agentroll.types import ExecResult

__all__ = ["LocalSandbox", "bwrap_available"]

log = logging.getLogger("agentroll.sandbox")

_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
_KILL_GRACE = 1.0  # seconds to wait for exit and pipe EOF once the group was killed
_MIB = 1024 * 1024
_BWRAP_HINT = (
    "install it with `apt-get install bubblewrap` and make sure unprivileged user "
    "namespaces are allowed (sysctl kernel.unprivileged_userns_clone=1, "
    "user.max_user_namespaces > 0)"
)
# Sandbox uids: far above system, login and subuid ranges; one per sandbox, so a uid's
# RLIMIT_NPROC is a per-sandbox total and no two sandboxes can signal or read each other.
_UID_LOW, _UID_HIGH = 1 << 28, 1 << 31
# The leader joins its cgroups, then execs the rest of the chain (prlimit, setpriv, bwrap).
_JOIN = 'while [ "$1" != -- ]; do echo $$ >"$1" || exit 125; shift; done; shift; exec "$@"'

_bwrap_exe: str | None = shutil.which("bwrap")
# Limits are applied by exec'ing through util-linux `prlimit` rather than a preexec_fn: a
# preexec_fn runs Python in a forked child of a multi-threaded process (to_thread workers,
# tokenizer threads), which can deadlock, and it disables the vfork() fast path, so every
# exec would copy the page tables of a possibly multi-GB trainer process.  preexec_fn is the
# fallback where prlimit is missing.
_prlimit_exe: str | None = shutil.which("prlimit")
# util-linux `setpriv` drops to the sandbox's uid with no groups, capabilities (bounding set
# included) or new privileges; as root, a sandbox refuses to start without it.
_setpriv_exe: str | None = shutil.which("setpriv")
_bwrap_works: bool | None = None
_bwrap_warned = False
_warned: set[str] = set()
_reaped: asyncio.Future[list[Path]] | None = None  # the once-per-process sweep of dead owners' dirs
_sandbox_ids = itertools.count()


def _is_root() -> bool:
    return os.geteuid() == 0


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def _reap_all() -> list[Path]:
    gone = reap_workdirs()
    if _is_root():
        gone += _cgroup.reap_cgroups(_cgroup_owner_alive)
    return gone


def _cgroup_owner_alive(owner: str) -> bool:
    """Whether the process named by a cgroup's owner tag runs (foreign tags: assumed so)."""
    parts = owner.split(".")
    if len(parts) != 3 or parts[0] != _HOST_TAG or not parts[1].isdigit():
        return True
    return owner_alive(int(parts[1]), parts[2])


async def _reap_once() -> None:
    """Before this process's first sandbox: remove the directories and cgroups that
    processes killed before they could clean up left behind (see ``reap_workdirs``)."""
    global _reaped
    sweep = _reaped
    if sweep is not None and sweep.done():
        return
    if sweep is None or sweep.get_loop() is not asyncio.get_running_loop():
        sweep = _reaped = asyncio.ensure_future(asyncio.to_thread(_reap_all))
        sweep.add_done_callback(_log_reaped)
    try:
        await asyncio.shield(sweep)
    except Exception as exc:  # a failed sweep never fails a sandbox
        log.debug("sweeping old sandbox directories failed: %s", exc)


def _log_reaped(done: asyncio.Future[list[Path]]) -> None:
    if done.cancelled() or done.exception() is not None:
        return
    if gone := done.result():
        log.info("removed %d sandbox leftovers of processes that are gone", len(gone))


def bwrap_available() -> bool:
    """Whether bubblewrap is installed and can build a sandbox here (probed once per process)."""
    global _bwrap_works
    if _bwrap_works is None:
        _bwrap_works = _probe_bwrap()
    return _bwrap_works


def _probe_bwrap() -> bool:
    """Run ``true`` in a sandbox built exactly as commands' are (as an unprivileged uid)."""
    if _bwrap_exe is None:
        return False
    root = Path(tempfile.mkdtemp(prefix="agentroll-bwrap-probe-"))
    uid = _new_uid() if _is_root() else None
    try:
        _layout(root, uid, isolated=True)
        argv = bwrap_argv(
            _bwrap_exe,
            workdir=root / "work",
            run_dir=root / "work",
            etc_dir=_etc_dir(),
            tmp_bytes=_MIB,
            network=False,
        )
        done = subprocess.run(
            [*_drop_privileges(uid), *argv, "true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={"PATH": _DEFAULT_PATH},
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.debug("bubblewrap probe failed: %s", exc)
        return False
    finally:
        _rmtree(root)
    if done.returncode != 0:
        log.debug("bubblewrap probe failed: %s", done.stderr.decode(errors="replace").strip())
        return False
    return True


def _new_uid() -> int:
    return _UID_LOW + secrets.randbelow(_UID_HIGH - _UID_LOW)


def _drop_privileges(uid: int | None) -> list[str]:
    """The ``setpriv`` prefix that runs the rest as ``uid`` (nothing when not root)."""
    if uid is None:
        return []
    if _setpriv_exe is None:
        raise SandboxError(
            "running as root, the local sandbox needs util-linux `setpriv` to run commands "
            "as an unprivileged uid; install util-linux (apt-get install util-linux)"
        )
    return [
        _setpriv_exe,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--",
    ]


def _layout(root: Path, uid: int | None, *, isolated: bool) -> None:
    """The sandbox's directory holds ``work``, the command's (owned by ``uid``); the root
    stays ours (0711: passable, not writable), so a command running on the host (no
    bubblewrap) cannot swap ``work`` for a link."""
    work = root / "work"
    work.mkdir()
    if not isolated:
        (work / _TMP_DIRNAME).mkdir()
    os.chmod(root, 0o711)
    if uid is not None:
        for path in (work, *([] if isolated else [work / _TMP_DIRNAME])):
            os.chown(path, uid, uid)


_etc: tuple[int, Path] | None = None  # (pid, dir): the /etc of this process's sandboxes


def _etc_dir() -> Path:
    """This process's sandbox ``/etc`` (made once; named like a working directory, so the
    reaper removes it after the process is gone, and removed at exit).  Blocking."""
    global _etc
    if _etc is None or _etc[0] != os.getpid():
        directory = Path(tempfile.mkdtemp(prefix=_WORKDIR_PREFIX + _owner_tag() + "etc-"))
        make_etc(directory)
        _etc = (os.getpid(), directory)
        atexit.register(_rmtree, directory)
    return _etc[1]


class LocalSandbox(Sandbox):
    """A fresh working directory; commands run in it as host processes.

    With bubblewrap (``config.use_bwrap`` True, or None and bubblewrap works here) each
    command sees only the system directories read-only (``_bwrap``), a fresh ``/proc``, a
    size-capped ``/tmp``, its working directory read-write at the same path, and no network
    unless ``config.network``; it has no capabilities and cannot nest user namespaces.
    Without bubblewrap, commands run as plain processes (host filesystem and network
    visible; not a security boundary).  Either way, when this process is root, commands run
    as the sandbox's own unprivileged uid; its cgroups bound memory, pids and CPU in total
    and kill every process of a finished command; the working directory is a tmpfs of
    ``config.disk_mb``.  Each process also gets the rlimits of ``config``.

    The environment is ``PATH``, ``HOME`` (the working directory), ``LANG`` and ``TMPDIR``
    plus the ``env`` passed to ``exec``.

    Each ``exec`` runs in a new process group (under bubblewrap also in new user, PID, network,
    IPC and mount namespaces, with no capabilities) whose every process is SIGKILLed at the end
    (the exec's own cgroup reaches those that left the group).  When agentroll runs as root,
    commands run as an unprivileged uid of their sandbox's own; memory, pids and CPU are totals
    per sandbox where cgroups work, and ``/tmp`` and the working directory are size-capped tmpfs
    where mounting works.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._root: Path | None = None
        self._etc = Path("/nonexistent")  # the /etc commands see under bubblewrap
        self._workdir: Path | None = None
        self._workdir_dev: int | None = None
        self._uid: int | None = None
        self._cgroups: _cgroup.Cgroups | None = None
        self._exec_ids = itertools.count()
        self._is_isolated = False
        self._closed = False
        self._pgids: set[int] = set()
        self._start_lock = asyncio.Lock()

    @property
    def workdir(self) -> Path:
        """The working directory on the host; raises ``SandboxError`` before ``start()``."""
        if self._workdir is None:
            state = "closed" if self._closed else "not started; call start() first"
            raise SandboxError(f"the sandbox is {state}")
        return self._workdir

    @property
    def is_isolated(self) -> bool:
        """True when commands run inside bubblewrap (known after ``start()``)."""
        return self._is_isolated

    @property
    def enforced(self) -> dict[str, str]:
        """How each per-sandbox limit is enforced here (``"none"`` where it is not)."""
        cg = f"cgroup v{self._cgroups.version}" if self._cgroups else None
        nproc = "RLIMIT_NPROC of the sandbox uid" if self._uid is not None else None
        disk = "tmpfs" if self._root is not None and os.path.ismount(self._root) else None
        return {
            "memory_mb": cg or "none (RLIMIT_AS per process only)",
            "pids": cg or nproc or "none",
            "cpus": cg or "none (RLIMIT_CPU per process only)",
            "disk_mb": disk or "none (RLIMIT_FSIZE per file only)",
            "tmp_mb": "tmpfs" if self._is_isolated else "none (TMPDIR is in the working dir)",
            "uid": "per sandbox" if self._uid is not None else "the caller's",
        }

    async def start(self) -> None:
        """Create the working directory, its cgroups and its uid; decide on bubblewrap.

        Raises ``SandboxError`` if the sandbox is closed, or if ``use_bwrap`` is True and
        bubblewrap does not work here.  Limits this host cannot enforce are named in a
        warning (once per process).
        """
        async with self._start_lock:
            if self._closed:
                raise SandboxError("the sandbox is closed")
            if self._workdir is not None:
                return
            self._is_isolated = await asyncio.to_thread(self._decide_bwrap)
            await _reap_once()
            try:
                await asyncio.to_thread(self._make)
            except BaseException:
                await asyncio.shield(asyncio.to_thread(self._unmake))
                raise
            self._warn_unenforced()

    def _make(self) -> None:
        cfg = self.config
        root = _make_workdir(make_tmp=False)
        self._root = root
        if _is_root():
            self._uid = _new_uid()
            try:
                mount_tmpfs(root, size_bytes=cfg.disk_mb * _MIB)
            except OSError as exc:
                log.debug("no size-capped working directory: %s", exc)
            name = f"{_owner_tag()}{next(_sandbox_ids)}"
            self._cgroups = _cgroup.open_cgroups(
                name, memory_bytes=cfg.memory_mb * _MIB, pids=cfg.pids, cpus=cfg.cpus
            )
        _layout(root, self._uid, isolated=self._is_isolated)
        if self._is_isolated:
            self._etc = _etc_dir()
        self._workdir = root / "work"
        self._workdir_dev = os.stat(self._workdir).st_dev

    def _unmake(self) -> None:
        cgroups, self._cgroups = self._cgroups, None
        if cgroups is not None:
            cgroups.remove()
        root, self._root, self._workdir = self._root, None, None
        if root is not None:
            unmount(root)
            _rmtree(root)

    def _warn_unenforced(self) -> None:
        for limit, how in self.enforced.items():
            if how.startswith("none"):
                _warn_once(
                    limit,
                    "local sandbox: %s is not enforced per sandbox on this host (%s); "
                    "run as root on a host with cgroups (v1, or v2 delegated) to bound it",
                    limit,
                    how,
                )

    def _decide_bwrap(self) -> bool:
        global _bwrap_warned
        wanted = self.config.use_bwrap
        if wanted is False:
            return False
        if bwrap_available():
            return True
        if wanted:
            raise SandboxError(f"bubblewrap (bwrap) does not work here; {_BWRAP_HINT}")
        if not _bwrap_warned:
            _bwrap_warned = True
            log.warning(
                "bubblewrap (bwrap) is missing or does not work here, so sandboxed commands run "
                "as plain processes with rlimits only (host filesystem readable, network "
                "reachable); to isolate them, %s",
                _BWRAP_HINT,
            )
        return False

    async def _started(self) -> Path:
        if self._workdir is None:
            await self.start()
        return self.workdir

    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        max_output: int | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (``/bin/sh -c`` for a string, an argv for a list) in the sandbox.

        ``timeout`` defaults to ``config.timeout`` seconds, ``max_output`` to
        ``config.max_output`` bytes per stream, ``cwd`` (relative to the working directory)
        to the working directory.  When the command's leader process exits, times out or
        the call is cancelled, its whole process group is SIGKILLed: nothing it started
        outlives the call.  ``exit_code`` is the negative signal number if the leader was
        killed by a signal (under bubblewrap a signal inside shows as ``128 + signal``).
        A command that cannot be found gives exit code 127, like a shell.

        Raises ``ValueError`` for a bad argument or a ``cwd`` outside the working directory,
        ``FileNotFoundError`` if ``cwd`` is not a directory, ``SandboxError`` if the
        sandbox is closed or a process cannot be started.  On cancellation the group is
        killed (and the leader reaped, briefly waited for) before ``CancelledError``
        propagates.
        """
        workdir = await self._started()
        timeout = self.config.timeout if timeout is None else timeout
        max_output = self.config.max_output if max_output is None else max_output
        if not timeout > 0:  # NaN too (it timed out at once)
            raise ValueError(f"exec timeout must be > 0 seconds, got {timeout}")
        if max_output <= 0:
            raise ValueError(f"exec max_output must be > 0 bytes, got {max_output}")
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if not argv:
            raise ValueError("exec needs a non-empty command")
        run_dir = workdir if cwd is None else self._resolve(cwd, allow_absolute=True)
        if not run_dir.is_dir():
            raise FileNotFoundError(f"exec cwd {cwd!r} is not a directory in the sandbox")
        data = stdin.encode() if isinstance(stdin, str) else stdin

        loop = asyncio.get_running_loop()
        started = time.monotonic()
        group: Path | None = None
        joins: list[Path] = []
        if self._cgroups is not None and self._is_isolated:
            # The command's pid namespace dies with its leader: no group of its own needed.
            joins = self._cgroups.joins
        elif self._cgroups is not None:
            try:
                group, joins = self._cgroups.exec_group(next(self._exec_ids))
            except OSError as exc:
                raise SandboxError(f"cannot create the command's cgroup: {exc}") from exc
        spawn = loop.create_task(
            loop.subprocess_exec(
                lambda: _ExecProtocol(max_output, loop),
                *self._wrap(argv, workdir, run_dir, joins),
                stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=run_dir,
                env=self._environ(workdir, env),
                start_new_session=True,
                preexec_fn=None if _prlimit_exe else self._preexec(),
            )
        )
        try:
            # Shielded: the process already runs while subprocess_exec connects its pipes,
            # and a cancelled subprocess_exec kills only the leader and then waits for the
            # pipes to close, i.e. for as long as any child lives.
            transport, proto = await asyncio.shield(spawn)
        except asyncio.CancelledError:
            spawn.add_done_callback(_kill_spawned)
            await asyncio.wait([spawn], timeout=_KILL_GRACE)  # kill before propagating
            self._kill_group(group)
            raise
        except (FileNotFoundError, PermissionError) as exc:
            # Only reachable without a prlimit/bwrap wrapper, which report these as 127/126.
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            self._kill_group(group)
            return ExecResult(
                exit_code=code,
                stderr=f"{argv[0]}: {exc.strerror}\n",
                duration=time.monotonic() - started,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            self._kill_group(group)
            raise SandboxError(f"cannot start {argv[0]!r} in the sandbox: {exc}") from exc

        pgid = transport.get_pid()
        self._pgids.add(pgid)
        if self._closed:  # close() ran while we were spawning
            _killpg(pgid)
        killed = False
        timed_out = False
        try:
            if data is not None:
                pipe = transport.get_pipe_transport(0)
                if isinstance(pipe, asyncio.WriteTransport):
                    pipe.write(data)
                    pipe.close()  # flushes, then closes: the command sees EOF
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(proto.exited)
            except TimeoutError:
                timed_out = True
            # Also after a normal exit: background children must not outlive the call, and
            # the exec's cgroup reaches those that left the process group (setsid).
            _killpg(pgid)
            if group is not None:
                await asyncio.to_thread(self._kill_group, group)
            killed = True
            # A process that left the group (setsid) may still hold the pipes: bounded wait.
            await asyncio.wait([proto.exited, proto.drained], timeout=_KILL_GRACE)
        finally:
            self._pgids.discard(pgid)
            if not killed:  # cancelled (or failed): kill, and reap the leader before leaving
                _kill_early(transport)
                self._kill_group(group)
                if not proto.exited.done():
                    await asyncio.wait([proto.exited], timeout=_KILL_GRACE)
            transport.close()

        returncode = transport.get_returncode()
        elided = proto.stdout.elided + proto.stderr.elided
        return ExecResult(
            exit_code=-signal.SIGKILL if returncode is None else returncode,
            stdout=proto.stdout.text(),
            stderr=proto.stderr.text(),
            timed_out=timed_out,
            truncated=elided > 0,
            elided_bytes=elided,
            duration=time.monotonic() - started,
        )

    def _kill_group(self, group: Path | None) -> None:
        if group is not None and self._cgroups is not None and not self._cgroups.kill_exec(group):
            log.warning("processes of a finished command kept forking; left in %s", group)

    def _environ(self, workdir: Path, extra: Mapping[str, str] | None) -> dict[str, str]:
        tmp = "/tmp" if self._is_isolated else str(workdir / _TMP_DIRNAME)
        environ = {"PATH": _DEFAULT_PATH, "HOME": str(workdir), "LANG": "C.UTF-8", "TMPDIR": tmp}
        if extra:
            environ.update(extra)
        return environ

    def _limits(self) -> list[tuple[str, int, int]]:
        """(prlimit option, resource, value) for each limit to set, capped at the hard limit."""
        cfg = self.config
        wanted = [
            ("--cpu", resource.RLIMIT_CPU, cfg.cpu_seconds),
            ("--as", resource.RLIMIT_AS, cfg.memory_mb * _MIB),
            ("--fsize", resource.RLIMIT_FSIZE, cfg.file_size_mb * _MIB),
            ("--nofile", resource.RLIMIT_NOFILE, cfg.open_files),
        ]
        if self._uid is not None:  # per uid, and the uid is the sandbox's own: a total
            wanted.append(("--nproc", resource.RLIMIT_NPROC, cfg.pids))
        out = []
        for option, res, value in wanted:
            if value <= 0:
                continue
            hard = resource.getrlimit(res)[1]
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)  # only root may raise a hard limit
            out.append((option, res, value))
        return out

    def _preexec(self) -> Callable[[], None]:
        limits = [(res, value) for _, res, value in self._limits()]

        def apply_limits() -> None:
            for res, value in limits:
                resource.setrlimit(res, (value, value))

        return apply_limits

    def _wrap(self, argv: list[str], workdir: Path, run_dir: Path, joins: list[Path]) -> list[str]:
        if self._is_isolated:
            assert _bwrap_exe is not None
            argv = [
                *bwrap_argv(
                    _bwrap_exe,
                    workdir=workdir,
                    run_dir=run_dir,
                    etc_dir=self._etc,
                    tmp_bytes=self.config.tmp_mb * _MIB,
                    network=self.config.network,
                ),
                # bwrap exits 1 for a command it cannot find; through sh it is 127 as elsewhere
                *(argv if argv[0] == "/bin/sh" else ["/bin/sh", "-c", 'exec "$@"', "sh", *argv]),
            ]
        argv = [*_drop_privileges(self._uid), *argv]
        if _prlimit_exe:
            argv = [_prlimit_exe, *(f"{o}={v}" for o, _, v in self._limits()), "--", *argv]
        if joins:
            argv = ["/bin/sh", "-c", _JOIN, "sh", *map(str, joins), "--", *argv]
        return argv

    def _resolve(self, path: str, *, allow_absolute: bool) -> Path:
        """``path`` inside the working directory, symlinks resolved; ``ValueError`` if it escapes."""
        workdir = self.workdir
        if not allow_absolute and os.path.isabs(path):
            raise ValueError(f"sandbox path {path!r} must be relative to the working directory")
        full = (workdir / path).resolve()
        if not full.is_relative_to(workdir):
            raise ValueError(f"sandbox path {path!r} is outside the working directory")
        return full

    async def read_file(self, path: str) -> bytes:
        """Read ``path`` (relative to the working directory).

        Raises ``FileNotFoundError`` if missing, ``ValueError`` if absolute or escaping
        (also when a command swaps a directory for an outward link while it is read).
        """
        await self._started()
        return await asyncio.to_thread(self._read, path)

    def _read(self, path: str) -> bytes:
        full = self._resolve(path, allow_absolute=False)
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            # The working directory is a file system of its own (where mounted): a file on
            # another device was reached through a link swapped in after the check.
            if self._workdir_dev is not None and info.st_dev != self._workdir_dev:
                raise ValueError(f"sandbox path {path!r} is outside the working directory")
            return f.read()

    async def write_file(self, path: str, data: str | bytes) -> None:
        """Write ``path`` (relative to the working directory), creating parent directories;
        what is created belongs to the sandbox's uid, so commands can change it.

        A ``str`` is written as UTF-8.  Raises ``ValueError`` if absolute or escaping.
        """
        workdir = await self._started()
        target = self._resolve(path, allow_absolute=False)
        raw = data.encode() if isinstance(data, str) else data

        def write() -> None:
            made = [p for p in target.parents if p.is_relative_to(workdir) and not p.exists()]
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                if self._uid is not None:
                    os.fchown(f.fileno(), self._uid, self._uid)
            if self._uid is not None:
                for directory in made:
                    os.chown(directory, self._uid, self._uid, follow_symlinks=False)

        await asyncio.to_thread(write)

    async def snapshot(self) -> bytes:
        """The working directory as an uncompressed tar archive (symlinks kept as links).

        ``TMPDIR`` contents are not included.
        """
        workdir = await self._started()
        return await asyncio.to_thread(_pack, workdir)

    async def restore(self, blob: bytes) -> None:
        """Replace the working directory's contents with those of a ``snapshot()`` blob.

        The blob is extracted aside first, so a blob that is not a tar archive or holds an
        absolute path, a ``..`` component, a device or a link leaving the directory raises
        ``ValueError`` and leaves the working directory untouched.  What it restores
        belongs to the sandbox's uid.
        """
        workdir = await self._started()

        def unpack() -> None:
            _unpack(blob, workdir, not self._is_isolated)
            if self._uid is not None:
                _chown_tree(workdir, self._uid)

        await asyncio.to_thread(unpack)

    async def close(self) -> None:
        """Kill running commands, remove the cgroups and delete the working directory.
        Idempotent.

        Raises ``SandboxError`` if the directory cannot be deleted.
        """
        if self._closed:
            return
        self._closed = True
        for pgid in list(self._pgids):
            _killpg(pgid)
        root = self._root
        try:
            await asyncio.to_thread(self._unmake)
        except OSError as exc:
            raise SandboxError(f"cannot delete sandbox directory {root}: {exc}") from exc


def _chown_tree(top: Path, uid: int) -> None:
    for root, dirs, files in os.walk(top):
        for name in (*dirs, *files):
            os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)
