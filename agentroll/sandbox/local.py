"""The local sandbox: commands run as host processes, inside bubblewrap when it works here.

Invariants: each ``exec`` runs in a new process group (under bubblewrap also in new PID,
network, IPC and mount namespaces) that is SIGKILLed when the command exits, times out or is
cancelled; its environment is built from scratch, never inherited; each output stream keeps
at most ``max_output`` bytes (head and tail) however much the command prints; ``read_file``,
``write_file``, ``cwd`` and ``restore`` never reach outside the working directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from agentroll.errors import SandboxError
from agentroll.sandbox._files import (
    _TMP_DIRNAME,
    _make_workdir,
    _pack,
    _rmtree,
    _unpack,
    reap_workdirs,
)
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
_reaped: asyncio.Future[list[Path]] | None = None  # the once-per-process sweep of dead owners' dirs


async def _reap_once() -> None:
    """Before this process's first working directory: remove those that processes killed
    before they could clean up left in the temp directory (see ``reap_workdirs``)."""
    global _reaped
    sweep = _reaped
    if sweep is not None and sweep.done():
        return
    if sweep is None or sweep.get_loop() is not asyncio.get_running_loop():
        sweep = _reaped = asyncio.ensure_future(asyncio.to_thread(reap_workdirs))
        sweep.add_done_callback(_log_reaped)
    try:
        await asyncio.shield(sweep)
    except Exception as exc:  # a failed sweep never fails a sandbox
        log.debug("sweeping old sandbox directories failed: %s", exc)


def _log_reaped(done: asyncio.Future[list[Path]]) -> None:
    if done.cancelled() or done.exception() is not None:
        return
    if gone := done.result():
        log.info("removed %d sandbox directories left by processes that are gone", len(gone))


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
            await _reap_once()
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
                _kill_early(transport)
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
