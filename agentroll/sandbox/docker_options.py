"""What a docker sandbox is made from: ``DockerOptions`` and the container spec they give.

Invariants: options come from ``SandboxConfig.options`` and are checked at construction
(``ValueError`` names the field); containers of equal ``_Spec`` are interchangeable, so the
warm pools are keyed by it.
"""

from __future__ import annotations

import posixpath

import msgspec

from agentroll.sandbox.base import SandboxConfig

DEFAULT_IMAGE = "agentroll/base:host"  # empty image; the host's runtime is bind-mounted
_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"


class DockerOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Docker-only settings, read from ``SandboxConfig.options``."""

    docker_host: str | None = None  # default: $DOCKER_HOST, else unix:///var/run/docker.sock
    ttl: float = 3600.0  # seconds a container may live at most
    workdir: str = "/workspace"
    command_uid: int = 1000  # uid and gid of every command (the agent runs as 0)
    pool_size: int = 2  # warm containers kept ready per image and limits
    reuse: bool = False  # put a container back in the pool after a verified reset
    host_mounts: bool | None = None  # bind the host's /usr, /lib...; None: default image only
    python: str = "python3"  # the image's interpreter for the agent
    run_id: str = ""
    create_rate: float = 10.0  # container creations per second
    create_burst: int = 8
    max_connections: int = 64  # docker client connection pool = SDK thread pool size
    start_timeout: float = 30.0

    @classmethod
    def from_config(cls, config: SandboxConfig) -> DockerOptions:
        try:
            opts = msgspec.convert(config.options, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(f"sandbox options: {exc}") from None
        if opts.max_connections < 1:
            raise ValueError("sandbox options: max_connections must be >= 1")
        if not 1 <= opts.command_uid <= 65534:
            raise ValueError(
                f"sandbox options: command_uid = {opts.command_uid} is out of range; use "
                "1..65534 (0 is the agent's)"
            )
        if not posixpath.isabs(opts.workdir) or posixpath.normpath(opts.workdir) == "/":
            raise ValueError(f"sandbox options: workdir {opts.workdir!r} must be absolute, not /")
        return opts


class _Spec(msgspec.Struct, frozen=True):
    """Everything a container is created from; containers of equal specs are interchangeable."""

    image: str
    memory_mb: int
    cpus: float
    pids: int
    ttl: float
    workdir: str
    disk_mb: int
    tmp_mb: int
    command_uid: int
    host_mounts: bool
    python: str
    file_size_mb: int
    open_files: int
    run_id: str
    start_timeout: float
