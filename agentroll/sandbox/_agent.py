"""The in-container agent: one long-lived process that runs commands and moves files.

Invariants: stdlib only, Python >= 3.8, one self-contained file (a container runs it as
``python3 -c SOURCE TTL WORKDIR UID``); commands run as UID, never as the agent, and nothing
they start outlives their call; file ops use UID's rights and stay inside WORKDIR; output is
bounded per stream; the agent exits on stdin EOF and, through SIGALRM, after TTL seconds.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import hmac
import io
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

_HEADER = struct.Struct(">I")
_GRACE = 1.0  # seconds to wait for output pipes once the group was killed
_KILL_DEADLINE = 2.0  # seconds to get rid of a command uid's processes
_SHIM = ["/bin/sh", "-c", 'echo 1000 >/proc/self/oom_score_adj 2>/dev/null; exec "$0" "$@"']
_OOM_FILES = ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events")
_MAX_TRANSFER = 192 * 1024 * 1024  # bytes of a read or snapshot (the host's frame cap, base64)


class _Capture:
    """First and last bytes of a stream in bounded memory; counts the rest."""

    def __init__(self, limit: int) -> None:
        self.head_cap = limit // 2
        self.tail_cap = limit - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.lock = threading.Lock()

    def feed(self, data: bytes) -> None:
        with self.lock:
            self.total += len(data)
            room = self.head_cap - len(self.head)
            if room > 0:
                self.head += data[:room]
                data = data[room:]
            if not data or not self.tail_cap:
                return
            self.tail += data[-self.tail_cap :]
            excess = len(self.tail) - self.tail_cap
            if excess > 0:
                del self.tail[:excess]

    def parts(self) -> list[Any]:
        with self.lock:
            return [_b64(bytes(self.head)), _b64(bytes(self.tail)), self.total]


class _Refused(Exception):
    """A file op the agent will not do (``kind`` tells the host which error to raise)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _start(target: Any, *args: Any) -> threading.Thread:
    """Start a daemon thread, waiting up to 3 s while the container's pids limit is full
    (threads count against it; a killed fork bomb takes a moment to be reaped)."""
    deadline = time.monotonic() + 3.0
    while True:
        thread = threading.Thread(target=target, args=args, daemon=True)
        try:
            thread.start()
            return thread
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _pump(fd: int, capture: _Capture) -> None:
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            capture.feed(chunk)
    except OSError:
        return


def _feed(fd: int, data: bytes) -> None:
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError:  # the command exited without reading everything
        pass
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _oom_kills() -> int:
    """The memory cgroup's OOM-kill counter (-1 if this kernel/cgroup does not show it)."""
    for path in _OOM_FILES:
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            continue
    return -1


def _read_first(*paths: str) -> str | None:
    for path in paths:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            continue
    return None


def _limits(workdir: str) -> dict[str, Any]:
    """What the kernel enforces here (cgroup v2 or v1, tmpfs sizes), for the host to check."""
    out: dict[str, Any] = {}
    pids = _read_first("/sys/fs/cgroup/pids.max", "/sys/fs/cgroup/pids/pids.max")
    out["pids"] = int(pids) if pids and pids.isdigit() else None
    mem = _read_first("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
    out["memory"] = int(mem) if mem and mem.isdigit() and int(mem) < 1 << 60 else None
    cpu = _read_first("/sys/fs/cgroup/cpu.max")
    quota_period = cpu.split() if cpu else []
    if not quota_period:  # cgroup v1
        v1 = [
            _read_first(f"/sys/fs/cgroup/cpu/cpu.cfs_{n}_us", f"/sys/fs/cgroup/cpu.cfs_{n}_us")
            for n in ("quota", "period")
        ]
        quota_period = [v1[0] or "max", v1[1] or "100000"]
    try:
        out["cpus"] = int(quota_period[0]) / int(quota_period[1])
    except (ValueError, IndexError, ZeroDivisionError):
        out["cpus"] = None
    for name, path in (("disk", workdir), ("tmp", "/tmp")):
        try:
            st = os.statvfs(path)
            out[name] = st.f_blocks * st.f_frsize
        except OSError:
            out[name] = None
    return out


def _procs() -> Iterator[tuple[int, str, list[str]]]:
    """(pid, state, [real, effective, saved uid]) of every process."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            yield int(entry), fields["State"].split()[0], fields["Uid"].split()[:3]
        except (OSError, KeyError, ValueError, IndexError):
            continue


def _other_pids() -> list[int]:
    me = os.getpid()
    return [pid for pid, state, _ in _procs() if pid not in (1, me) and state != "Z"]


def _uid_pids(uid: int) -> list[int]:
    me, wanted = os.getpid(), str(uid)
    return [p for p, state, uids in _procs() if p != me and state != "Z" and wanted in uids]


def _kill_until_gone(find: Any) -> list[int]:
    """SIGKILL what ``find()`` lists until it lists nothing; what is left at the deadline."""
    deadline = time.monotonic() + _KILL_DEADLINE
    while True:
        pids = find()
        if not pids or time.monotonic() > deadline:
            return list(pids)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.002)  # killed processes turn into zombies when next scheduled


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def _empty_dir(path: str) -> None:
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.unlink(os.path.join(root, name))
        for name in dirs:
            full = os.path.join(root, name)
            if os.path.islink(full):
                os.unlink(full)
            else:
                os.rmdir(full)


def _empty(path: str) -> None:
    try:
        _empty_dir(path)
    except PermissionError:  # give back write/search on directories a command locked
        for root, dirs, _ in os.walk(path):
            for name in dirs:
                full = os.path.join(root, name)
                if not os.path.islink(full):
                    with contextlib.suppress(OSError):
                        os.chmod(full, 0o700)
        _empty_dir(path)


class _Libc:
    """setfsuid/setfsgid (per thread: only the calling thread's filesystem identity) and
    prctl, through ctypes; None where this python has no ctypes."""

    def __init__(self) -> None:
        import ctypes

        self.lib = ctypes.CDLL(None, use_errno=True)

    def become(self, uid: int, gid: int) -> None:
        self.lib.setfsgid(gid)
        self.lib.setfsuid(uid)
        # setfsuid returns the previous fsuid and never fails loudly: check it took.
        if self.lib.setfsuid(uid) != uid or self.lib.setfsgid(gid) != gid:
            raise PermissionError(f"cannot take the filesystem identity of uid {uid}")

    def not_dumpable(self) -> None:
        self.lib.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no ptrace, /proc/<pid>/* root-only


class Agent:
    """Serves ``_channel``'s protocol on stdin/stdout: frames of a 4-byte big-endian length
    and a UTF-8 JSON body; the first request is ``{"key": HEX}``, every reply is
    ``HMAC-SHA256(key, json) + json`` with its request's ``id``, the first ``{"hello": 1}``.
    Ops: ``exec``, ``kill`` (SIGKILL a running exec's group), ``ping``, ``reset`` (kill every
    other process, empty directories), ``read``, ``write``, ``snapshot``, ``restore``.  UID
    ``-1`` (unit tests): commands run as the agent's own user, only their groups are killed."""

    def __init__(self, out: BinaryIO, key: bytes, workdir: str, uid: int = -1) -> None:
        self.out = out
        self.key = key
        self.workdir = os.path.realpath(workdir)
        self.uid = uid
        self.libc: _Libc | None = None
        self.write_lock = threading.Lock()
        self.spawn_lock = threading.Lock()  # spawns and the idle kill exclude each other
        self.active = 0
        self.procs: dict[Any, subprocess.Popen[bytes]] = {}
        self.cancelled: set[Any] = set()
        self.shim = os.path.exists("/bin/sh")

    # -- set-up and the wire ----------------------------------------------------------

    def isolate(self) -> str | None:
        """Drop what commands could use against the agent; the problem, if any."""
        if self.uid < 0:
            return None
        try:
            self.libc = _Libc()
            os.setgroups([])
            self.libc.not_dumpable()
            probe: list[BaseException] = []

            def check() -> None:
                try:
                    assert self.libc is not None
                    self.libc.become(self.uid, self.uid)
                except BaseException as exc:
                    probe.append(exc)

            _start(check).join()
            if probe:
                raise probe[0]
        except (OSError, ImportError, AttributeError) as exc:
            return f"cannot run commands as uid {self.uid}: {type(exc).__name__}: {exc}"
        return None

    def send(self, msg: dict[str, Any]) -> None:
        data = json.dumps(msg, separators=(",", ":")).encode()
        mac = hmac.new(self.key, data, hashlib.sha256).digest()
        with self.write_lock:
            self.out.write(_HEADER.pack(len(mac) + len(data)) + mac + data)
            self.out.flush()

    def serve(self, inp: BinaryIO) -> None:
        handlers = {
            "exec": self.execute,
            "reset": lambda m: self.reset(list(m["dirs"]), bool(m.get("kill", True))),
            "read": self.file_op,
            "write": self.file_op,
            "snapshot": self.file_op,
            "restore": self.file_op,
        }
        while True:
            msg = _read_frame(inp)
            if msg is None:
                return  # EOF: the owner is gone
            op = msg.get("op")
            if op in handlers:
                try:
                    _start(self.answer, handlers[op], msg)
                except RuntimeError as exc:  # the pids limit stays full: answer, keep serving
                    self.send({"id": msg.get("id"), "error": f"RuntimeError: {exc}"})
            elif op == "kill":
                self.kill(msg["target"])
            elif op == "ping":
                self.send(
                    {"id": msg["id"], "ok": True, "pid": os.getpid(), "running": len(self.procs)}
                )
            else:
                self.send({"id": msg.get("id"), "error": f"unknown op {op!r}"})

    @contextlib.contextmanager
    def as_command(self) -> Iterator[None]:
        """This thread's file accesses (and what it forks) use the command uid's rights."""
        if self.libc is None:
            yield
            return
        self.libc.become(self.uid, self.uid)
        try:
            yield
        finally:
            self.libc.become(0, 0)

    # -- commands -----------------------------------------------------------------------

    def kill(self, exec_id: Any) -> None:
        self.cancelled.add(exec_id)  # also when the exec's thread has not spawned it yet
        proc = self.procs.get(exec_id)
        if proc is not None:
            _killpg(proc.pid)

    def answer(self, handler: Any, msg: dict[str, Any]) -> None:
        """Send ``handler(msg)``'s reply, or its failure's: the agent answers every request."""
        try:
            reply = handler(msg)
        except Exception as exc:
            reply = _failure(msg["op"], exc)
        reply["id"] = msg["id"]
        self.send(reply)

    def execute(self, msg: dict[str, Any]) -> dict[str, Any]:
        exec_id, argv, limit, cwd = msg["id"], list(msg["argv"]), int(msg["max_output"]), msg["cwd"]
        data = None if msg.get("stdin") is None else base64.b64decode(msg["stdin"])
        oom_before = _oom_kills()
        started = time.monotonic()
        with self.spawn_lock:
            # The cwd check and the fork's chdir use the command uid's rights.
            with self.as_command():
                if not os.path.isdir(cwd):
                    return {"error": "cwd", "detail": f"{cwd} is not a directory"}
                try:
                    proc = self._spawn(argv, data is not None, cwd, msg["env"])
                except OSError as exc:  # only without /bin/sh: report like a shell would
                    code = 126 if isinstance(exc, PermissionError) else 127
                    text = f"{argv[0]}: {exc.strerror}\n".encode()
                    parts = [_b64(text), "", len(text)]
                    return {"exit_code": code, "stdout": ["", "", 0], "stderr": parts}
            self.active += 1
        try:
            out, err, expired, threads = self._supervise(
                exec_id, proc, data, limit, float(msg["timeout"])
            )
        finally:
            survivors = self._finished()
        deadline = time.monotonic() + _GRACE
        for t in threads:  # a child that left the group may hold the pipes (no uid: no kill)
            t.join(max(0.0, deadline - time.monotonic()))
        duration = time.monotonic() - started
        cancelled = exec_id in self.cancelled
        self.cancelled.discard(exec_id)
        if survivors:
            return {"error": f"processes of uid {self.uid} survive SIGKILL: {survivors[:8]}"}
        # Any process of the command killed for memory (a shell's child shows as 137).
        oom = oom_before >= 0 and _oom_kills() > oom_before
        return {
            "exit_code": proc.returncode,
            "timed_out": expired,
            "cancelled": cancelled,
            "oom": oom,
            "duration": duration,
            "stdout": out.parts(),
            "stderr": err.parts(),
        }

    def _supervise(
        self,
        exec_id: Any,
        proc: subprocess.Popen[bytes],
        data: bytes | None,
        limit: int,
        timeout: float,
    ) -> tuple[_Capture, _Capture, bool, list[threading.Thread]]:
        """Capture ``proc``'s output until it exits (or times out or is killed); the
        threads still pumping its pipes."""
        self.procs[exec_id] = proc
        if exec_id in self.cancelled:
            _killpg(proc.pid)
        out, err = _Capture(limit), _Capture(limit)
        assert proc.stdout is not None and proc.stderr is not None
        expired = threading.Event()
        exited = threading.Event()

        def expire() -> None:
            if not exited.wait(timeout):
                expired.set()
                _killpg(proc.pid)

        threads: list[threading.Thread] = []
        try:
            threads.append(_start(_pump, proc.stdout.fileno(), out))
            threads.append(_start(_pump, proc.stderr.fileno(), err))
            if data is not None:
                assert proc.stdin is not None
                stdin_fd = os.dup(proc.stdin.fileno())
                proc.stdin.close()
                _start(_feed, stdin_fd, data)
            _start(expire)
            proc.wait()
        finally:
            exited.set()
            _killpg(proc.pid)  # what the command left running in its group dies with it
            proc.wait()
            self.procs.pop(exec_id, None)
        return out, err, expired.is_set(), threads

    def _finished(self) -> list[int]:
        """One exec fewer; when none runs, every process of the command uid must be gone."""
        with self.spawn_lock:
            self.active -= 1
            if self.uid < 0 or self.active:
                return []
            return _kill_until_gone(lambda: _uid_pids(self.uid))

    def _spawn(
        self, argv: list[str], with_stdin: bool, cwd: str, env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        """Popen, retried for up to 3 s on EAGAIN (the pids limit is full for a moment)."""
        ids: dict[str, Any] = {}
        if self.uid >= 0:
            if sys.version_info >= (3, 9):  # noqa: UP036 - the image's python may be 3.8
                ids = {"user": self.uid, "group": self.uid, "extra_groups": []}
            else:
                uid = self.uid

                def drop() -> None:
                    os.setgroups([])
                    os.setgid(uid)
                    os.setuid(uid)

                ids = {"preexec_fn": drop}
        deadline = time.monotonic() + 3.0
        while True:
            try:
                return subprocess.Popen(
                    (_SHIM + argv) if self.shim else argv,
                    stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                    env=env,
                    start_new_session=True,
                    close_fds=True,
                    **ids,
                )
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def reset(self, dirs: list[str], kill: bool) -> dict[str, Any]:
        """Kill every process but tini and the agent, empty ``dirs``, then check both."""
        if kill:
            # Without a command uid the agent shares its uid with the test: groups only.
            find = _other_pids if self.uid >= 0 else lambda: []
            for proc in list(self.procs.values()):
                _killpg(proc.pid)
            with self.spawn_lock:
                left = _kill_until_gone(find)
            if left:
                return {"ok": False, "detail": f"processes survive SIGKILL: {left[:8]}"}
        with self.as_command():
            for path in dirs:
                _empty(path)
                left_files = os.listdir(path)
                if left_files:
                    return {"ok": False, "detail": f"{path} is not empty: {left_files[:8]}"}
        return {"ok": True}

    # -- files, inside the working directory, with the command uid's rights -------------

    def file_op(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        with self.as_command():
            if op == "read":
                return {"data": _b64(self.read(msg["path"]))}
            if op == "snapshot":
                return {"data": _b64(self.snapshot())}
            if op == "write":
                self.write(msg["path"], base64.b64decode(msg["data"]))
            else:
                self.restore(base64.b64decode(msg["data"]))
        return {"ok": True}

    def _full(self, rel: str) -> str:
        full = os.path.normpath(os.path.join(self.workdir, rel))
        if not _within(full, self.workdir):
            raise _Refused("outside", f"{rel!r} is outside the working directory")
        return full

    def read(self, rel: str) -> bytes:
        full = self._full(rel)
        if not _within(os.path.realpath(full), self.workdir):
            raise _Refused("outside", f"{rel!r} links outside the working directory")
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            # What was opened, not what the name said a moment ago, must be inside.
            if not _within(_fd_path(fd), self.workdir):
                raise _Refused("outside", f"{rel!r} links outside the working directory")
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise OSError(errno.EISDIR, f"{rel!r} is a directory")
            if not stat.S_ISREG(st.st_mode):
                raise _Refused("not_regular", f"{rel!r} is not a regular file")
            if st.st_size > _MAX_TRANSFER:
                raise _Refused("too_large", f"{rel!r} has {st.st_size} bytes")
            chunks: list[bytes] = []
            total = 0
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return b"".join(chunks)
                total += len(chunk)
                if total > _MAX_TRANSFER:
                    raise _Refused("too_large", f"{rel!r} has over {_MAX_TRANSFER} bytes")
                chunks.append(chunk)
        finally:
            os.close(fd)

    def write(
        self, rel: str, data: bytes, mode: int | None = None, mtime: float | None = None
    ) -> None:
        """Write ``rel`` (parents made); an existing file keeps its mode unless ``mode``."""
        full = self._full(rel)
        parent, name = os.path.split(full)
        if not name or full == self.workdir:
            raise _Refused("outside", f"{rel!r} names the working directory")
        os.makedirs(parent, exist_ok=True)
        dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if not _within(_fd_path(dfd), self.workdir):
                raise _Refused("outside", f"{rel!r} links outside the working directory")
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(name, flags, 0o644, dir_fd=dfd)
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                os.unlink(name, dir_fd=dfd)  # a symlink is replaced, never written through
                fd = os.open(name, flags, 0o644, dir_fd=dfd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if mode is not None:
                    os.fchmod(fd, mode)
                if mtime is not None:
                    os.utime(fd, (mtime, mtime))
            finally:
                os.close(fd)
        finally:
            os.close(dfd)

    def snapshot(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name in sorted(os.listdir(self.workdir)):
                tar.add(os.path.join(self.workdir, name), arcname=name, filter=_anonymous)
                if buf.tell() > _MAX_TRANSFER:
                    raise _Refused("too_large", f"the snapshot exceeds {_MAX_TRANSFER} bytes")
        if buf.tell() > _MAX_TRANSFER:
            raise _Refused("too_large", f"the snapshot exceeds {_MAX_TRANSFER} bytes")
        return buf.getvalue()

    def restore(self, blob: bytes) -> None:
        """Empty the working directory, then unpack ``blob`` (checked by the host: no
        absolute names, ``..``, devices or outward links) with the command uid's rights."""
        _empty(self.workdir)
        dir_modes = []
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
            for member in tar:
                full = self._full(member.name)
                mode = member.mode & 0o777
                if member.isdir():
                    os.makedirs(full, exist_ok=True)
                    dir_modes.append((full, mode))
                elif member.isreg():
                    src = tar.extractfile(member)
                    data = src.read() if src else b""
                    self.write(member.name, data, mode, float(member.mtime))
                elif member.issym():
                    os.makedirs(os.path.dirname(full), exist_ok=True)
                    os.symlink(member.linkname, full)
                elif member.islnk():
                    os.link(self._full(member.linkname), full, follow_symlinks=False)
        for full, mode in reversed(dir_modes):  # last: a read-only directory gets its files
            os.chmod(full, mode)


def _failure(op: str, exc: Exception) -> dict[str, Any]:
    """The reply to a request whose op raised ``exc``."""
    detail = f"{type(exc).__name__}: {exc}"
    if op == "exec":
        return {"error": detail}
    if op == "reset":
        return {"ok": False, "detail": detail}
    if isinstance(exc, _Refused):
        return {"error": exc.kind, "detail": str(exc)}
    if isinstance(exc, OSError):
        return {"error": "os", "errno": exc.errno or 0, "detail": str(exc)}
    return {"error": "other", "detail": detail}


def _anonymous(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _read_frame(inp: BinaryIO) -> dict[str, Any] | None:
    header = inp.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    msg = json.loads(inp.read(_HEADER.unpack(header)[0]))
    return msg if isinstance(msg, dict) else {}


def main(argv: list[str]) -> None:
    ttl = float(argv[0]) if argv else 0.0
    workdir = argv[1] if len(argv) > 1 else "/workspace"
    uid = int(argv[2]) if len(argv) > 2 else -1
    if ttl > 0:
        signal.alarm(max(1, int(ttl)))  # default action: the agent, and the container, end
    os.umask(0o022)
    first = _read_frame(sys.stdin.buffer)  # the key comes first, never in argv or env
    if first is None or not isinstance(first.get("key"), str):
        sys.stderr.write("agent: the first frame must carry the key\n")
        sys.exit(2)
    key = bytes.fromhex(first["key"])
    if uid < 0:
        os.makedirs(workdir, exist_ok=True)
    agent = Agent(sys.stdout.buffer, key, workdir, uid)
    hello: dict[str, Any] = {"hello": 1, "pid": os.getpid(), "python": sys.version.split()[0]}
    hello["oom_counter"] = _oom_kills() >= 0
    problem = agent.isolate()
    if problem:
        hello["error"] = problem
    hello["limits"] = _limits(agent.workdir)
    agent.send(hello)
    if not problem:
        agent.serve(sys.stdin.buffer)


if __name__ == "__main__":
    main(sys.argv[1:])
