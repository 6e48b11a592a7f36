"""The local sandbox: commands run as host processes, inside bubblewrap when it works here.

Invariants: each ``exec`` runs in a new process group (under bubblewrap also in new PID,
network, IPC and mount namespaces) that is SIGKILLed when the command exits, times out or is
cancelled; its environment is built from scratch, never inherited; each output stream keeps
at most ``max_output`` bytes (head and tail) however much the command prints; ``read_file``,
``write_file``, ``cwd`` and ``restore`` never reach outside the working directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import resource
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath

from agentroll.errors import SandboxError
from agentroll.sandbox.base import Sandbox, SandboxConfig
from agentroll.types import ExecResult

__all__ = ["LocalSandbox", "bwrap_available"]

log = logging.getLogger("agentroll.sandbox")

_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
_TMP_DIRNAME = ".tmp"  # TMPDIR of plain (non-bubblewrap) commands; not part of snapshots
_KILL_GRACE = 1.0  # seconds to wait for exit and pipe EOF once the group was killed
_MIB = 1024 * 1024
_BWRAP_HINT = (
    "install it with `apt-get install bubblewrap` and make sure unprivileged user "
    "namespaces are allowed (sysctl kernel.unprivileged_userns_clone=1)"
)

_bwrap_exe: str | None = shutil.which("bwrap")
# Limits are applied by exec'ing through util-linux `prlimit` rather than a preexec_fn: a
# preexec_fn runs Python in a forked child of a multi-threaded process (to_thread workers,
# tokenizer threads), which can deadlock, and it disables the vfork() fast path, so every
# exec would copy the page tables of a possibly multi-GB trainer process.  preexec_fn is the
# fallback where prlimit is missing.
_prlimit_exe: str | None = shutil.which("prlimit")
_bwrap_works: bool | None = None
_bwrap_warned = False


def bwrap_available() -> bool:
    """Whether bubblewrap is installed and can build a sandbox here (probed once per process)."""
    global _bwrap_works
    if _bwrap_works is None:
        _bwrap_works = _probe_bwrap()
    return _bwrap_works


def _probe_bwrap() -> bool:
    if _bwrap_exe is None:
        return False
    try:
        done = subprocess.run(
            [*_bwrap_base(network=False), "--", "true"],
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
    if done.returncode != 0:
        log.debug("bubblewrap probe failed: %s", done.stderr.decode(errors="replace").strip())
        return False
    return True


def _bwrap_base(*, network: bool) -> list[str]:
    assert _bwrap_exe is not None
    args = [_bwrap_exe, "--unshare-all"]
    if network:
        args.append("--share-net")
    args += ["--die-with-parent", "--new-session", "--ro-bind", "/", "/"]
    args += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    if os.path.isdir("/run") and not os.path.islink("/run"):
        # Host daemons' unix sockets (docker.sock, ...) live here, and neither a read-only
        # bind nor a network namespace stops connect() on a socket file.
        args += ["--tmpfs", "/run"]
        resolv = os.path.realpath("/etc/resolv.conf")
        if network and resolv.startswith("/run/") and os.path.isfile(resolv):
            args += ["--ro-bind", resolv, resolv]
    return args


class _Capture:
    """Keeps the first and last bytes of a stream in bounded memory and counts the rest."""

    __slots__ = ("_head", "_head_cap", "_tail", "_tail_cap", "total")

    def __init__(self, limit: int) -> None:
        self._head_cap = limit // 2
        self._tail_cap = limit - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if not data or not self._tail_cap:
            return
        if len(data) >= self._tail_cap:
            self._tail[:] = data[-self._tail_cap :]
        else:
            self._tail += data
            excess = len(self._tail) - self._tail_cap
            if excess > 0:
                del self._tail[:excess]

    @property
    def elided(self) -> int:
        return self.total - len(self._head) - len(self._tail)

    def text(self) -> str:
        """UTF-8 text (errors replaced) with a marker where bytes were elided."""
        if not self.elided:
            return (self._head + self._tail).decode("utf-8", "replace")
        # Cut whole characters only, so the seams do not show replacement characters.
        head_cut = _incomplete_utf8_suffix(self._head)
        tail_cut = 0
        while tail_cut < min(3, len(self._tail)) and self._tail[tail_cut] & 0xC0 == 0x80:
            tail_cut += 1
        head = self._head[: len(self._head) - head_cut].decode("utf-8", "replace")
        tail = self._tail[tail_cut:].decode("utf-8", "replace")
        return f"{head}\n...[elided {self.elided + head_cut + tail_cut} bytes]...\n{tail}"


def _incomplete_utf8_suffix(data: bytearray) -> int:
    """Length of a trailing, incomplete UTF-8 sequence (0 if the data ends on a boundary)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        if byte < 0xC0:
            return 0
        need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
        return back if need > back else 0
    return 0


class _ExecProtocol(asyncio.SubprocessProtocol):
    """Feeds both output pipes into bounded captures; futures for exit and pipe EOF.

    ``Process.wait()`` is not used because it also waits for the pipes to close, which a
    background child holding stdout can postpone forever.
    """

    def __init__(self, max_output: int, loop: asyncio.AbstractEventLoop) -> None:
        self.stdout = _Capture(max_output)
        self.stderr = _Capture(max_output)
        self.exited: asyncio.Future[None] = loop.create_future()
        self.drained: asyncio.Future[None] = loop.create_future()
        self._open_fds = {1, 2}

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else data
        (self.stdout if fd == 1 else self.stderr).feed(raw)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self._open_fds.discard(fd)
        if not self._open_fds and not self.drained.done():
            self.drained.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


def _killpg(pgid: int) -> None:
    # After a normal exit the leader is already reaped; the group id stays reserved by the
    # kernel as long as any member lives, so this reaches only our leftovers (or nobody).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _kill_spawned(spawn: asyncio.Task[tuple[asyncio.SubprocessTransport, _ExecProtocol]]) -> None:
    """Done-callback of a spawn whose caller was cancelled: kill the group, drop the pipes."""
    if spawn.cancelled() or spawn.exception() is not None:
        return
    transport, _ = spawn.result()
    _killpg(transport.get_pid())
    transport.close()


class LocalSandbox(Sandbox):
    """A fresh temporary working directory; commands run in it as host processes.

    With bubblewrap (``config.use_bwrap`` True, or None and bubblewrap works here) each
    command sees the host filesystem read-only, the working directory read-write at the
    same path, private ``/tmp``, ``/run`` and ``/dev``, and no network unless
    ``config.network``.  Without it, commands run as plain processes with rlimits only; a
    process that calls ``setsid()`` can then escape the group kill.

    Every command gets the rlimits of ``config`` (a non-positive value leaves that limit
    alone) and an environment of ``PATH``, ``HOME`` (the working directory), ``LANG`` and
    ``TMPDIR`` plus the ``env`` passed to ``exec``.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._workdir: Path | None = None
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

    async def start(self) -> None:
        """Create the working directory and decide on bubblewrap.

        Raises ``SandboxError`` if the sandbox is closed, or if ``use_bwrap`` is True and
        bubblewrap does not work here.
        """
        async with self._start_lock:
            if self._closed:
                raise SandboxError("the sandbox is closed")
            if self._workdir is not None:
                return
            self._is_isolated = await asyncio.to_thread(self._decide_bwrap)
            self._workdir = await asyncio.to_thread(_make_workdir, not self._is_isolated)

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
                "as plain processes with rlimits only (host filesystem writable, network "
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
        if timeout <= 0:
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
        spawn = loop.create_task(
            loop.subprocess_exec(
                lambda: _ExecProtocol(max_output, loop),
                *self._wrap(argv, workdir, run_dir),
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
            raise
        except (FileNotFoundError, PermissionError) as exc:
            # Only reachable without a prlimit/bwrap wrapper, which report these as 127/126.
            code = 127 if isinstance(exc, FileNotFoundError) else 126
            return ExecResult(
                exit_code=code,
                stderr=f"{argv[0]}: {exc.strerror}\n",
                duration=time.monotonic() - started,
            )
        except (OSError, subprocess.SubprocessError) as exc:
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
            # Also after a normal exit: background children must not outlive the call.
            _killpg(pgid)
            killed = True
            # A process that left the group (setsid) may still hold the pipes: bounded wait.
            await asyncio.wait([proto.exited, proto.drained], timeout=_KILL_GRACE)
        finally:
            self._pgids.discard(pgid)
            if not killed:  # cancelled (or failed): kill, and reap the leader before leaving
                _killpg(pgid)
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
            ("--nproc", resource.RLIMIT_NPROC, cfg.max_processes),
        ]
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

    def _wrap(self, argv: list[str], workdir: Path, run_dir: Path) -> list[str]:
        if self._is_isolated:
            argv = [
                *_bwrap_base(network=self.config.network),
                *("--bind", str(workdir), str(workdir), "--chdir", str(run_dir), "--"),
                # bwrap exits 1 for a command it cannot find; through sh it is 127 as elsewhere
                *(argv if argv[0] == "/bin/sh" else ["/bin/sh", "-c", 'exec "$@"', "sh", *argv]),
            ]
        if _prlimit_exe:
            argv = [_prlimit_exe, *(f"{o}={v}" for o, _, v in self._limits()), "--", *argv]
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

        Raises ``FileNotFoundError`` if missing, ``ValueError`` if absolute or escaping.
        """
        await self._started()
        return await asyncio.to_thread(self._resolve(path, allow_absolute=False).read_bytes)

    async def write_file(self, path: str, data: str | bytes) -> None:
        """Write ``path`` (relative to the working directory), creating parent directories.

        A ``str`` is written as UTF-8.  Raises ``ValueError`` if absolute or escaping.
        """
        await self._started()
        target = self._resolve(path, allow_absolute=False)
        raw = data.encode() if isinstance(data, str) else data

        def write() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(raw)

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
        ``ValueError`` and leaves the working directory untouched.
        """
        workdir = await self._started()
        await asyncio.to_thread(_unpack, blob, workdir, not self._is_isolated)

    async def close(self) -> None:
        """Kill running commands and delete the working directory.  Idempotent.

        Raises ``SandboxError`` if the directory cannot be deleted.
        """
        if self._closed:
            return
        self._closed = True
        for pgid in list(self._pgids):
            _killpg(pgid)
        workdir, self._workdir = self._workdir, None
        if workdir is not None:
            try:
                await asyncio.to_thread(_rmtree, workdir)
            except OSError as exc:
                raise SandboxError(f"cannot delete sandbox directory {workdir}: {exc}") from exc


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
