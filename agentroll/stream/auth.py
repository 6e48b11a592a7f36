"""The stream's bearer token: where a worker keeps it and where a trainer finds it.

Invariants: a worker always serves with a non-empty token, held in its run directory's
``stream.token`` with mode 0600, written atomically; a consumer reads it from the environment
variable, else from that file.  Loopback is not a trust boundary: a sandbox without its own
network namespace reaches 127.0.0.1 too.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from agentroll._fs import fsync_path
from agentroll.errors import ConfigError

logger = logging.getLogger("agentroll.stream.auth")

TOKEN_FILE = "stream.token"
TOKEN_ENV = "AGENTROLL_STREAM_TOKEN"


def check_token(token: str, what: str) -> str:
    """``token`` without surrounding whitespace; ``ConfigError`` naming ``what`` when that
    leaves nothing (an empty token would let anyone in)."""
    stripped = token.strip()
    if not stripped:
        raise ConfigError(
            f"{what} is empty; give a non-empty stream token, or leave it unset and the "
            f"worker generates one into <run dir>/{TOKEN_FILE}"
        )
    return stripped


def _write_token(path: Path, token: str) -> None:
    """Write ``token`` to ``path`` with mode 0600, atomically (a temporary file in the same
    directory, created 0600, fsync'd, renamed over ``path``, the directory fsync'd)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # the umask may only remove bits; this states them
            os.write(fd, f"{token}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _read_token(path: Path) -> str:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the stream token from {path}: {exc}") from exc
    return check_token(text, f"the stream token in {path} (delete the file to get a new one)")


def ensure_token(run_dir: Path, given: str | None) -> str:
    """The token a worker serves its stream with, also written to ``run_dir/stream.token``
    (mode 0600, atomically; ``run_dir`` is created if missing).

    ``given`` wins (e.g. from the recipe's ``stream.token_env``); else the token already in
    the file (a restarted worker keeps its trainers' token); else a new one
    (``secrets.token_urlsafe(32)``).  Raises
    ``ConfigError`` when ``given`` or the file's token is empty, ``OSError`` when the file
    cannot be written."""
    run_dir = Path(run_dir)
    path = run_dir / TOKEN_FILE
    if given is not None:
        token = check_token(given, "the given stream token")
    elif path.exists():
        token = _read_token(path)
    else:
        token = secrets.token_urlsafe(32)
    run_dir.mkdir(parents=True, exist_ok=True)
    current = None
    if path.exists():
        mode = stat.S_IMODE(path.stat().st_mode)
        current = path.read_text().strip() if mode & 0o077 == 0 else None
        if mode & 0o077:
            logger.warning("%s was readable by others (mode %o); rewriting it 0600", path, mode)
    if current != token:
        _write_token(path, token)
    return token


def load_token(run_dir: str | Path | None = None, *, env: str | None = TOKEN_ENV) -> str:
    """The token a consumer sends: the environment variable ``env`` when it is set (None:
    the environment is not consulted; default ``AGENTROLL_STREAM_TOKEN``), else
    ``run_dir/stream.token``.  Raises ``ConfigError`` naming both places when neither has
    one, or when the one found is empty."""
    if env is not None and env in os.environ:
        return check_token(os.environ[env], f"the environment variable {env}")
    if run_dir is not None:
        path = Path(run_dir) / TOKEN_FILE
        if path.is_file():
            return _read_token(path)
    where = f"${env} is not set" if env is not None else "the environment is not consulted"
    place = (
        f"{Path(run_dir) / TOKEN_FILE} does not exist"
        if run_dir is not None
        else "no run directory was given"
    )
    raise ConfigError(
        f"no stream token: {where} and {place}; pass the worker's token, set "
        f"{env or TOKEN_ENV}, or point at the worker's run directory (its {TOKEN_FILE})"
    )


__all__ = ["TOKEN_ENV", "TOKEN_FILE", "check_token", "ensure_token", "load_token"]
