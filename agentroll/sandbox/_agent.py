"""The in-container agent: one long-lived process that runs commands on request.

A docker sandbox starts this file as its container's main process (``python3 -c SOURCE
TTL WORKDIR``, under tini) and talks to it over the container's attached stdin/stdout, so a
tool call costs one round trip on an open connection instead of one ``docker exec``.  The
same file runs as a plain subprocess in the unit tests.

Wire format, both ways: 4-byte big-endian length, then a UTF-8 JSON object.  Requests carry
``op`` and ``id``; every reply carries the request's ``id``.  The agent first sends
``{"hello": 1, ...}``.  Ops: ``exec`` (run an argv), ``kill`` (SIGKILL a running exec's
process group), ``ping``, ``reset`` (kill every other process, empty directories, verify).

Invariants: stdlib only and Python >= 3.8 (it runs on whatever python3 the image has; it
never imports agentroll); each exec runs in its own session and process group, SIGKILLed
when the command exits, when its timeout passes (a waiting thread, not polling) or on
``kill``; threads and processes are retried for a moment when the pids limit is full;
output is captured in bounded memory per stream (head and tail kept, the total counted);
children get ``oom_score_adj`` 1000, so under the container's memory limit the kernel kills
a command before the agent; the agent exits on stdin EOF (its owner went away) and, through
SIGALRM, after TTL seconds, and the container stops with it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO

_HEADER = struct.Struct(">I")
_GRACE = 1.0  # seconds to wait for output pipes once the group was killed
_SHIM = ["/bin/sh", "-c", 'echo 1000 >/proc/self/oom_score_adj 2>/dev/null; exec "$0" "$@"']
_OOM_FILES = ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events")


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


def _other_pids() -> list[int]:
    me = os.getpid()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (1, me):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                pids.append(int(entry))
    return pids


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


def _make_removable(path: str) -> None:
    """Give back write/search permission on directories a command locked (we own them)."""
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                with contextlib.suppress(OSError):
                    os.chmod(full, 0o700)


class Agent:
    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.write_lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.cancelled: set[int] = set()
        self.shim = os.path.exists("/bin/sh")

    def send(self, msg: dict[str, Any]) -> None:
        data = json.dumps(msg, separators=(",", ":")).encode()
        with self.write_lock:
            self.out.write(_HEADER.pack(len(data)) + data)
            self.out.flush()

    def serve(self, inp: BinaryIO) -> None:
        while True:
            header = inp.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return  # EOF: the owner is gone
            body = inp.read(_HEADER.unpack(header)[0])
            msg = json.loads(body)
            op = msg.get("op")
            if op == "exec" or op == "reset":
                target = self.run_exec if op == "exec" else self.run_reset
                try:
                    _start(target, msg)
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

    def kill(self, exec_id: int) -> None:
        self.cancelled.add(exec_id)  # also when the exec's thread has not spawned it yet
        proc = self.procs.get(exec_id)
        if proc is not None:
            _killpg(proc.pid)

    def run_exec(self, msg: dict[str, Any]) -> None:
        try:
            reply = self.execute(msg)
        except Exception as exc:  # the agent must answer every request
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        reply["id"] = msg["id"]
        self.send(reply)

    def execute(self, msg: dict[str, Any]) -> dict[str, Any]:
        exec_id = msg["id"]
        argv = list(msg["argv"])
        limit = int(msg["max_output"])
        cwd = msg["cwd"]
        if not os.path.isdir(cwd):
            return {"error": "cwd", "detail": f"{cwd} is not a directory"}
        data = None if msg.get("stdin") is None else base64.b64decode(msg["stdin"])
        oom_before = _oom_kills()
        started = time.monotonic()
        try:
            proc = self._spawn(argv, data is not None, cwd, msg["env"])
        except OSError as exc:  # only without /bin/sh: report like a shell would
            code = 126 if isinstance(exc, PermissionError) else 127
            text = f"{argv[0]}: {exc.strerror}\n".encode()
            return {"exit_code": code, "stdout": ["", "", 0], "stderr": [_b64(text), "", len(text)]}
        self.procs[exec_id] = proc
        if exec_id in self.cancelled:
            _killpg(proc.pid)
        out, err = _Capture(limit), _Capture(limit)
        assert proc.stdout is not None and proc.stderr is not None
        try:
            threads = [_start(_pump, proc.stdout.fileno(), out)]
            threads.append(_start(_pump, proc.stderr.fileno(), err))
            if data is not None:
                assert proc.stdin is not None
                stdin_fd = os.dup(proc.stdin.fileno())
                proc.stdin.close()
                _start(_feed, stdin_fd, data)
        except BaseException:
            _killpg(proc.pid)
            proc.wait()
            self.procs.pop(exec_id, None)
            raise
        expired = threading.Event()
        exited = threading.Event()

        def expire() -> None:
            if not exited.wait(float(msg["timeout"])):
                expired.set()
                _killpg(proc.pid)

        try:
            _start(expire)
        except RuntimeError:
            exited.set()
            _killpg(proc.pid)
            proc.wait()
            self.procs.pop(exec_id, None)
            raise
        try:
            proc.wait()
        finally:
            exited.set()
            _killpg(proc.pid)  # what the command left running in its group dies with it
            self.procs.pop(exec_id, None)
        deadline = time.monotonic() + _GRACE
        for t in threads:  # a child that left the group (setsid) may hold the pipes
            t.join(max(0.0, deadline - time.monotonic()))
        duration = time.monotonic() - started
        cancelled = exec_id in self.cancelled
        self.cancelled.discard(exec_id)
        # Any process of the command killed for memory (a shell's child shows as 137).
        oom = oom_before >= 0 and _oom_kills() > oom_before
        return {
            "exit_code": proc.returncode,
            "timed_out": expired.is_set(),
            "cancelled": cancelled,
            "oom": oom,
            "duration": duration,
            "stdout": out.parts(),
            "stderr": err.parts(),
        }

    def _spawn(
        self, argv: list[str], with_stdin: bool, cwd: str, env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        """Popen, retried for up to 3 s on EAGAIN (the pids limit is full for a moment)."""
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
                )
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def run_reset(self, msg: dict[str, Any]) -> None:
        try:
            reply = self.reset(list(msg["dirs"]), bool(msg.get("kill", True)))
        except Exception as exc:
            reply = {"ok": False, "detail": f"{type(exc).__name__}: {exc}"}
        reply["id"] = msg["id"]
        self.send(reply)

    def reset(self, dirs: list[str], kill: bool) -> dict[str, Any]:
        """Kill every process but tini and the agent, empty ``dirs``, then check both."""
        if kill:
            deadline = time.monotonic() + 2.0
            while True:
                pids = _other_pids()
                if not pids:
                    break
                if time.monotonic() > deadline:
                    return {"ok": False, "detail": f"processes survive SIGKILL: {pids[:8]}"}
                for pid in pids:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.01)
        for path in dirs:
            try:
                _empty_dir(path)
            except PermissionError:
                _make_removable(path)
                _empty_dir(path)
            left = os.listdir(path)
            if left:
                return {"ok": False, "detail": f"{path} is not empty: {left[:8]}"}
        return {"ok": True}


def main(argv: list[str]) -> None:
    ttl = float(argv[0]) if argv else 0.0
    workdir = argv[1] if len(argv) > 1 else "/workspace"
    if ttl > 0:
        signal.alarm(max(1, int(ttl)))  # default action: the agent, and the container, end
    os.makedirs(workdir, exist_ok=True)
    agent = Agent(sys.stdout.buffer)
    hello = {"hello": 1, "pid": os.getpid(), "python": sys.version.split()[0]}
    hello["oom_counter"] = _oom_kills() >= 0
    agent.send(hello)
    agent.serve(sys.stdin.buffer)


if __name__ == "__main__":
    main(sys.argv[1:])
